"""The status document: everything an operator asks first, as plain JSON-ready data.

Built from the machines on demand (never kept), so it cannot drift from them. The API, the CLI (from a
saved snapshot when no daemon runs) and the metrics all read this one shape.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fsm.cluster import Cluster
from fsm.download import DownloadState
from fsm.instance import InstanceState

NODE = "local"  # every rank of an instance runs on this machine, over loopback
UNKNOWN = "unknown"  # a state no live controller vouches for (`unvouched`)


def status_of(cluster: Cluster, batching: Mapping[str, tuple[int, str]] | None = None) -> dict[str, Any]:
    """Everything an operator asks first: states, attempts, next retry, last cause, per runner; ``batching``:
    what each runner said it decodes at once, and why (`exod.runner.protocol.Batching`)."""
    batching = batching or {}
    view = cluster.view()
    instances = []
    for iid, placement in cluster.instances.items():
        m, seen = placement.machine, view.instances[iid]
        runners = []
        for slot, r in view.slot_runners(view.instances[iid]):
            runners.append(
                {
                    "runner_id": slot.runner_id,
                    "rank": slot.rank,
                    "node": slot.node_id,
                    "incarnation": None if r is None else r.incarnation,
                    "state": None if r is None else r.state.value,
                    "phase": None if r is None or r.phase is None else r.phase.value,
                    "layers": None if r is None else [r.layers_loaded, r.layers_total],
                    "in_flight": 0 if r is None else r.in_flight,  # requests it decodes or has queued
                    "failure": None if r is None or r.failure is None else r.failure.message,
                }
            )
        download = cluster.downloads.get((placement.slots[0].node_id, placement.model_id))  # rank 0's node
        # Runners are created only once the model is on the node (fsm.plan): until then, say what it waits for.
        fetching = download is None or download.download_state is not DownloadState.COMPLETED
        waiting_for = "download" if m.instance_state is InstanceState.STARTING and fetching else None
        instances.append(
            {
                "instance_id": iid,
                "model_id": placement.model_id,
                "ranks": len(placement.slots),
                "state": m.instance_state.value,
                "generation": m.generation,
                "attempts": m.attempts,
                "uncharged": m.uncharged,  # failures of the host (no fds, a port taken): they spend no retry
                "max_failures": m.policy.max_failures,
                "max_retries": m.policy.max_failures,  # its old name, kept for clients that read it
                "next_retry_at": m.deadline,
                "delete_reason": None if m.delete_reason is None else m.delete_reason.value,
                "last_failure": None if m.last_failure is None else m.last_failure.message,
                "waiting_for": waiting_for,
                # loaded, parked, unparking … (fsm.Residency); when it was last used, when it will be parked
                "residency": seen.residency.value,
                "keep_alive": seen.keep_alive,  # seconds it stays loaded unused (None: forever)
                "last_used": seen.last_used,
                "park_at": seen.park_at,
                "download": None
                if download is None
                else {
                    "state": download.download_state.value,
                    "attempts": download.attempts,
                    "retry_at": download.retry_at,
                    "last_error": download.last_error,
                    "bytes": [download.bytes_done, download.bytes_total],
                },
                "runners": runners,
                # what rank 0 decodes at once, and why (sized from the KV budget and the model, unless set)
                "batch": None
                if (said := batching.get(placement.slots[0].runner_id)) is None
                else {"max_sequences": said[0], "why": said[1]},
            }
        )
    return {"instances": instances}


def unvouched(doc: dict[str, Any], why: str) -> dict[str, Any]:
    """The status as the last controller wrote it, said by a node when no controller answers: every state
    that may have changed since (its runners may be gone with it) is `UNKNOWN`, the one written kept as
    ``last_known_state``, and ``as_of`` says why. A deletion is final, so it stays as it is."""

    def forget(entry: dict[str, Any]) -> dict[str, Any]:
        return {**entry, "state": UNKNOWN, "last_known_state": entry["state"]}

    instances = [
        inst if inst["delete_reason"] is not None else {**forget(inst), "runners": [forget(r) for r in inst["runners"]]}
        for inst in doc["instances"]
    ]
    return {**doc, "instances": instances, "as_of": why}
