"""Model-check your own variant of the system: here, a planner that forgets one_for_all.

The checker explores every event sequence (planner runs, completions, crashes, errors, deletes, clock
jumps) of 2 ranks with the real machines and this planner, and prints the shortest trace to the broken
invariant. Run the same with ``fsm.plan`` to see every invariant hold.
"""

from __future__ import annotations

import fsm
from fsm.check import CheckConfig, check


def forgetful_plan(view: fsm.ClusterView, node_id: str, now: float) -> list[fsm.Action]:
    """fsm.plan, minus the rule that stops a runner whose sibling failed."""
    gone = (fsm.StopReason.SIBLING_FAILED, fsm.StopReason.RECOVERING)
    return [a for a in fsm.plan(view, node_id, now) if not (isinstance(a, fsm.StopRunner) and a.reason in gone)]


def main() -> None:
    policy = fsm.RetryPolicy(max_failures=3)
    print("== fsm.plan ==")
    print(check(CheckConfig(policy=policy)).report())
    print("\n== a planner without one_for_all ==")
    print(check(CheckConfig(policy=policy, plan=forgetful_plan)).report())


if __name__ == "__main__":
    main()
