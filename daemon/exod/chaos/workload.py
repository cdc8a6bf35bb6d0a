"""The campaign's clients: chats in both dialects (streamed and not), placements, parks, unparks and deletes,
and `/events` readers that resume with ``Last-Event-ID`` — each answer classified as the client sees it and
recorded.

A request is sent to a node drawn at random, whatever state the node is in: clients do not know what the
campaign did to it. Each thread has its own seeded random source, so a seed gives the same requests.
"""

from __future__ import annotations

import contextlib
import json
import random
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import httpx
import httpx_sse
from httpx_sse._decoders import SSEDecoder  # not re-exported; `until_stopped` says why

from exod.chaos.history import NOT_STORED, History, Operation, Outcome

CONNECT_S = 3.0  # a node whose port takes longer to answer is counted as unreachable
# A fresh connection per request: a kept-alive one that the server closes as idle just as a request goes out
# fails that request ("disconnected without sending a response"), which says nothing about the daemon.
FRESH = httpx.Limits(max_keepalive_connections=0)


class Workload:
    """``urls()``: each node's name and API URL now (a restarted node has a new port); ``models``: the
    models to chat with; ``nodes``: the nodes placements may pin ranks to."""

    def __init__(
        self,
        history: History,
        clock: Callable[[], float],
        urls: Callable[[], dict[str, str]],
        *,
        seed: int,
        models: tuple[str, ...],
        api_key: str,
        bound: float,
        placements_until: float,
    ) -> None:
        self.history, self.clock, self.urls, self.models = history, clock, urls, models
        self.headers = {"Authorization": f"Bearer {api_key}"}
        self.timeout = httpx.Timeout(bound, connect=CONNECT_S)
        self.placements_until = placements_until
        self._stop = threading.Event()
        self._seed = seed
        jobs: list[tuple[str, Callable[[random.Random], None]]] = [
            ("chat-1", self._chats),
            ("chat-2", self._chats),
            ("placer", self._placements),
            ("events-1", lambda rng: self._events("events-1", rng)),
            ("events-2", lambda rng: self._events("events-2", rng)),
        ]
        self._threads = [
            threading.Thread(target=self._run, args=(job, n), name=name, daemon=True)
            for n, (name, job) in enumerate(jobs)
        ]

    def __enter__(self) -> Workload:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> list[str]:
        """Stop every client after its request in flight (each ends within the bound); the names of those that
        did not end by then."""
        self._stop.set()
        for thread in self._threads:
            thread.join(self.timeout.read + CONNECT_S + 5)
        return [t.name for t in self._threads if t.is_alive()]

    def _run(self, job: Callable[[random.Random], None], n: int) -> None:
        job(random.Random(self._seed * 101 + n))

    def _node(self, rng: random.Random) -> tuple[str, str]:
        urls = self.urls()
        name = rng.choice(sorted(urls))
        return name, urls[name]

    # -- chats ------------------------------------------------------------------------

    def _chats(self, rng: random.Random) -> None:
        with httpx.Client(timeout=self.timeout, headers=self.headers, limits=FRESH) as client:
            while not self._stop.is_set():
                node, url = self._node(rng)
                dialect, stream = rng.choice(("openai", "anthropic")), rng.random() < 0.5
                name = f"chat-{dialect}" + ("-stream" if stream else "")
                model = rng.choice(self.models)
                started = self.clock()
                outcome, detail = _chat(client, url, dialect, stream, model)
                self.history.operation(Operation(name, node, started, self.clock(), outcome, detail))
                self._stop.wait(rng.uniform(0.05, 0.5))

    # -- placements -------------------------------------------------------------------

    def _placements(self, rng: random.Random) -> None:
        """Place an instance of 1–3 ranks (pinned to nodes, or spread by the placer), keep it a while, delete it;
        on the way, often park it (at once, while it may still be Pending, or once it runs) and unpark it."""
        with httpx.Client(timeout=self.timeout, headers=self.headers, limits=FRESH) as client:
            while not self._stop.is_set() and self.clock() < self.placements_until:
                body = placement_body(rng, self.models, sorted(self.urls()))
                iid = self._ask(client, rng, "place", "POST", "/instances", body)
                self._stop.wait(0.0 if rng.random() < 0.3 else rng.uniform(2.0, 10.0))
                if iid and rng.random() < 0.6:
                    self._ask(client, rng, "park", "POST", f"/instances/{iid}/park", None, iid)
                    self._stop.wait(rng.uniform(1.0, 5.0))
                    self._ask(client, rng, "unpark", "POST", f"/instances/{iid}/unpark", None, iid)
                    self._stop.wait(rng.uniform(2.0, 8.0))
                if iid:
                    self._ask(client, rng, "delete", "DELETE", f"/instances/{iid}", None, iid)
                self._stop.wait(rng.uniform(1.0, 4.0))

    def _ask(
        self, client: httpx.Client, rng: random.Random, name: str, method: str, path: str, body: Any, iid: str = ""
    ) -> str:
        """One placement, park, unpark or delete, recorded; the instance id, if the answer acknowledged it."""
        node, url = self._node(rng)
        started = self.clock()
        try:
            answer = client.request(method, url + path, json=body)
        except (httpx.TransportError, httpx.TimeoutException) as exc:
            outcome, detail = _broken(exc)
        else:
            outcome, detail = _classify_json(answer, "openai")
            if outcome is Outcome.OK and name == "place":
                iid = answer.json().get("instance_id", "")
        self.history.operation(Operation(name, node, started, self.clock(), outcome, detail, iid))
        return iid if outcome is Outcome.OK else ""

    # -- /events ----------------------------------------------------------------------

    def _events(self, reader: str, rng: random.Random) -> None:
        """Follow the transition log from its start; on any break, resume from the last id at another node."""
        last = "0"
        with httpx.Client(timeout=httpx.Timeout(30.0, connect=CONNECT_S), headers=self.headers) as client:
            while not self._stop.is_set():
                _, url = self._node(rng)
                with (
                    contextlib.suppress(httpx.HTTPError, httpx_sse.SSEError),
                    httpx_sse.connect_sse(client, "GET", url + "/events", headers={"Last-Event-ID": last}) as source,
                ):
                    for event in until_stopped(source.response.iter_lines(), self._stop):
                        if event.event == "transition":
                            self.history.event(reader, json.loads(event.data))
                        if event.id:
                            last = event.id
                self._stop.wait(0.2)


def until_stopped(lines: Iterable[str], stop: threading.Event) -> Iterator[httpx_sse.ServerSentEvent]:
    """A stream's events until ``stop``, looked at on every line: the daemon's keepalive comments included, which
    `EventSource.iter_sse` swallows (a reader of a quiet log never saw the stop; found by the 30-min campaign,
    seed 1452815653)."""
    decoder = SSEDecoder()  # httpx-sse's own decoder, fed line by line
    for line in lines:
        if stop.is_set():
            return
        if (event := decoder.decode(line.rstrip("\n"))) is not None:
            yield event


def _chat(client: httpx.Client, url: str, dialect: str, stream: bool, model: str) -> tuple[Outcome, str]:
    body: dict[str, Any] = {"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": "hello"}]}
    path = "/v1/chat/completions" if dialect == "openai" else "/v1/messages"
    body["stream"] = stream
    try:
        if not stream:
            return _classify_json(client.post(url + path, json=body), dialect)
        with client.stream("POST", url + path, json=body) as answer:
            if answer.status_code != 200:
                answer.read()
                return _classify_json(answer, dialect)
            return _classify_stream(answer.iter_lines(), dialect)
    except (httpx.TransportError, httpx.TimeoutException) as exc:
        return _broken(exc)


def _broken(exc: Exception) -> tuple[Outcome, str]:
    """No answer: hung if the node took the request and said nothing within the bound; indeterminate if the
    connection could not be made (a node cut off or down) or broke."""
    hung = isinstance(exc, httpx.TimeoutException) and not isinstance(exc, httpx.ConnectTimeout)
    return (Outcome.HUNG if hung else Outcome.INDETERMINATE), repr(exc)


def _classify_json(answer: httpx.Response, dialect: str) -> tuple[Outcome, str]:
    """An answer that is a success, or an error in the dialect's shape; anything else is malformed."""
    try:
        doc = answer.json()
    except ValueError:
        return Outcome.MALFORMED, f"HTTP {answer.status_code}, not JSON: {answer.text[:200]!r}"
    if answer.is_success:
        return Outcome.OK, ""
    error = doc.get("error") if isinstance(doc, dict) else None
    shaped = isinstance(error, dict) and "message" in error
    if dialect == "anthropic":
        shaped = shaped and doc.get("type") == "error"
    if shaped and error.get("code") == "not_stored_yet":  # made, not yet written: it may yet happen, or not
        return Outcome.INDETERMINATE, f"{NOT_STORED}: HTTP {answer.status_code}: {error['message'][:200]}"
    if shaped:
        return Outcome.REFUSED, f"HTTP {answer.status_code}: {error['message'][:200]}"
    return Outcome.MALFORMED, f"HTTP {answer.status_code}, not an error in the {dialect} dialect: {doc!r:.200}"


def _classify_stream(lines: Iterator[str], dialect: str) -> tuple[Outcome, str]:
    """A stream ends with its end (``[DONE]``, ``message_stop``) or an error event; one that just stops is
    malformed (when its node was not faulted, a violation)."""
    error = ""
    for line in lines:
        data = line.removeprefix("data:").strip() if line.startswith("data:") else ""
        if not data:
            continue
        if data == "[DONE]":
            return (Outcome.REFUSED, error) if error else (Outcome.OK, "")
        with contextlib.suppress(ValueError):
            doc = json.loads(data)
            if isinstance(doc, dict) and isinstance(doc.get("error"), dict):
                error = str(doc["error"].get("message", ""))[:200]
                if dialect == "anthropic":
                    return Outcome.REFUSED, error
            elif isinstance(doc, dict) and doc.get("type") == "message_stop":
                return Outcome.OK, ""
    if error:  # OpenAI's streams end with their error event
        return Outcome.REFUSED, error
    return Outcome.MALFORMED, "the stream ended without its end or an error"


def placement_body(rng: random.Random, models: Sequence[str], nodes: Sequence[str]) -> dict[str, Any]:
    """A placement of 1–3 ranks, half of them pinned to nodes the workload can reach now (spread by the placer
    when fewer are up than it has ranks: a 10-min campaign, seed 911, drew 3 ranks while a daemon was down,
    and the sampling error ended the workload's placements for the rest of the run)."""
    ranks = rng.randint(1, 3)
    body: dict[str, Any] = {"model": rng.choice(models), "ranks": ranks}
    if rng.random() < 0.5 and len(nodes) >= ranks:
        body["nodes"] = rng.sample(list(nodes), ranks)
    return body
