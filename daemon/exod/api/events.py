"""GET /events: every lifecycle transition as server-sent events, from the durable log, resumable."""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator

import trio
from fastapi import APIRouter, Header, Query

from exod.api.sse import EventStream, comment, event
from exod.controller import Controller, StoreUnavailable

KEEPALIVE_S = 15.0
MAX_SEQ = 2**63 - 1  # the log's sequence numbers are SQLite INTEGERs: signed 64-bit
BATCH = 500  # log entries read at a time


def router(controller: Controller) -> APIRouter:
    api = APIRouter()

    @api.get("/events", response_class=EventStream, status_code=200)
    async def events(
        last_event_id: int | None = Header(None, ge=0, le=MAX_SEQ, description="resume after this sequence number"),
        after: int = Query(0, ge=0, le=MAX_SEQ, description="resume after this sequence number, if no Last-Event-ID"),
    ) -> EventStream:
        """Server-sent events: every lifecycle transition, from the durable log, resumable.

        A resume point must be a sequence number the log could hold (0..2^63-1), or it is a 400 before the
        stream starts. One beyond the newest entry is not an error: the stream waits for entries past it.
        One older than the log's start (`exod.state.retention` pruned what came after it) gets a ``truncated``
        event first, whose id is the last pruned entry's, then the stream from the oldest entry kept.
        """
        start = last_event_id if last_event_id is not None else after
        return EventStream(_stream(controller, start), keepalive=math.inf)  # the stream sends its own

    return api


async def _stream(controller: Controller, seen: int) -> AsyncIterator[bytes]:
    """The log's entries after ``seen``, then each new one as it is written; a keepalive when idle."""
    while True:
        try:
            if seen < (oldest := await controller.log_start()) - 1:  # also when a slow reader is overtaken
                doc = {"oldest_seq": oldest, "after": seen}
                yield event(json.dumps(doc), "truncated", id=str(oldest - 1))
                seen = oldest - 1
            batch = await controller.transitions(after=seen, limit=BATCH)
            for seq, e in batch:
                seen = seq
                doc = {"seq": seq, **e.as_record()}
                yield event(json.dumps(doc), "transition", id=str(seq))
            if len(batch) == BATCH:
                continue  # more are waiting
            with trio.move_on_after(KEEPALIVE_S) as idle:
                await controller.log_grew(seen)
            if idle.cancelled_caught:
                yield comment("keepalive")
        except StoreUnavailable as exc:  # the cluster's etcd is away: the stream waits for it
            yield comment(f"{exc}; trying again")
            await trio.sleep(1.0)
