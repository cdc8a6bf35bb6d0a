"""Drive a 2-rank instance through the library alone: start, a SIGKILL, recovery.

A toy world stands in for processes: every action the planner returns
succeeds at once (`fsm.world`). At t=5 rank 1 is killed; the planner stops rank 0
(one_for_all), the instance backs off 2 s, and a new generation comes up.
Every transition is printed as it is logged. Run: ``python examples/drive_machines.py``.
"""

from __future__ import annotations

import fsm
from fsm import runner
from fsm.cluster import Cluster
from fsm.world import World

NODES = ("node-a", "node-b")


def main() -> None:
    cluster = Cluster()
    slots = [fsm.Slot(rank, node, f"demo/{rank}") for rank, node in enumerate(NODES)]
    cluster.place("demo", "exod/tiny-qwen2", slots)
    world = World(cluster, NODES)
    printed = 0
    now = 0.0
    while now <= 12.0:
        world.advance(now)
        if now == 5.0:
            inc = cluster.runner("demo/1").incarnation
            cluster.runner_event(runner.Exited("demo/1", inc, exit_code=-9, stop_delivered=False), now)
        while any([world.step(node) for node in NODES]) or world.deliver_all():
            pass  # the toy world answers at once: plan and deliver until nothing is left at this instant
        for entry in cluster.log[printed:]:
            cause = f"  ({entry.cause})" if entry.cause else ""
            move = f"{entry.source or '·':>11} → {entry.target:<11}"
            print(f"t={entry.time:5.1f}  {entry.machine:<8} {entry.key:<22} {move} on {entry.event}{cause}")
        printed = len(cluster.log)
        now += 0.5
    machine = cluster.instance("demo")
    print(
        f"\ninstance demo: {machine.instance_state.value}, generation {machine.generation}, attempts {machine.attempts}"
    )


if __name__ == "__main__":
    main()
