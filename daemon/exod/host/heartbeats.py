"""The runners' heartbeat: each runner process is asked whether it is alive, and must say so in time.

A stopped (SIGSTOP), wedged or frozen process says nothing, and while it serves no request nothing else
waits for it to speak: its rank would look Ready for ever. So every process is pinged (`Ping`) a few
times per ``[timeouts] heartbeat``, and the thread that reads its channel answers (`Pong`,
`exod.runner.process`), whatever the model is doing. The answers reach the controller like any report
(`exod.reports`), which tells its cluster (`fsm.Cluster.heard`). Nothing here decides.

The pings are sent where the process runs: by `exod.processes` on one host, by the node's agent in a
cluster (`exod.cluster.agent`), whose report stream carries the answers like every other report. And
where the controller runs, a `Beat` says as often that it listened (`fsm.Cluster.listened`), or that it
`resumed` after a break: longer than half the limit, the daemon paused or its event loop starved; or the
channel the answers come by silent past its own beat (a cluster node's report stream: its node is being
lost, the host's failure, not the runner's). Answers may then wait unread, or never come for the
runner's own sake, so the plan gives the runner a whole limit again rather than fail it for that. A missed
heartbeat is a silence the controller heard while it listened.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from exod.host.supervisor import Process
from exod.runner import protocol as p

PINGS_PER_LIMIT = 5  # a missed heartbeat is seen at most a fifth of the limit late


class Beat:
    """One process's pings (``ping``) and its controller's listening (``listened``, called with ``resumed``),
    from its start until `stop` (its supervisor ended)."""

    def __init__(
        self,
        process: Process,
        limit: float,
        *,
        ping: bool = True,
        listened: Callable[[bool], None] | None = None,
        unheard: Callable[[], bool] = lambda: False,
    ) -> None:
        """``unheard``: whether the channel the answers come by is silent past its own beat (a cluster node's
        report stream)."""
        self.process, self.limit, self.every = process, limit, limit / PINGS_PER_LIMIT
        self._ping, self._listened, self._unheard = ping, listened, unheard
        self._scope = trio.CancelScope()

    async def run(self) -> None:
        """Every ``limit / PINGS_PER_LIMIT`` seconds, the first at once (a ping is queued until it is spawned)."""
        with self._scope:
            due = trio.current_time()
            while True:
                now = trio.current_time()
                if self._ping:
                    self.process.post(p.Ping())
                if self._listened is not None:
                    late = now - due > self.limit / 2  # this daemon did not run meanwhile
                    self._listened(late or self._unheard())
                due = now + self.every
                await trio.sleep_until(due)

    def stop(self) -> None:
        """No more pings (before `run` began too: then it ends at once)."""
        self._scope.cancel()
