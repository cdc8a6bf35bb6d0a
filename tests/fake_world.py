"""A fake world around `fsm.cluster.Cluster` for Hypothesis: `fsm.world` completions, delivered on demand."""

from __future__ import annotations

import fsm
from fsm.cluster import Cluster
from fsm.world import Pending, complete, pending_for


class FakeWorld:
    def __init__(self, cluster: Cluster, nodes: list[str], now: float = 0.0) -> None:
        self.cluster = cluster
        self.nodes = nodes
        self.now = now
        self.pending: list[Pending] = []
        self.executed: list[tuple[float, fsm.Action]] = []

    def step(self, node_id: str) -> list[fsm.Action]:
        """Plan on ``node_id`` and execute every action; their completions become pending."""
        actions = fsm.plan(self.cluster.view(), node_id, self.now)
        for action in actions:
            self.before_execute(action)
            self.cluster.execute(action, self.now)
            self.executed.append((self.now, action))
            if (op := pending_for(action)) is not None:
                self.pending.append(op)
        return actions

    def before_execute(self, action: fsm.Action) -> None:
        """A hook for invariants that must hold at the moment an action is taken."""

    def deliver(self, index: int, *, ok: bool = True) -> bool:
        return complete(self.cluster, self.pending.pop(index), self.now, ok=ok)

    def settle(self, max_rounds: int = 400) -> int:
        """Plan, execute and complete everything, advancing time to deadlines, until nothing is left.

        Returns the rounds used; raises AssertionError if the system is still busy after ``max_rounds``.
        """
        for rounds in range(max_rounds):
            acted = any([self.step(node) for node in self.nodes])
            delivered = False
            while self.pending:
                delivered = self.deliver(0) or delivered
            if acted or delivered:
                continue
            deadlines = [fsm.next_deadline(self.cluster.view(), n, self.now) for n in self.nodes]
            future = [d for d in deadlines if d is not None]
            if not future:
                return rounds
            self.now = min(future)
        raise AssertionError(f"no quiescence after {max_rounds} rounds: {self.cluster.view()}")
