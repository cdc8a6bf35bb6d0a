"""States explored per second by the model checker, against itself without its transition table.

The table memoizes each machine's transitions as the real python-statemachine classes compute them; the
baseline, in the same run, computes every transition afresh. Same space, same answer, different speed.

    python bench/checker.py [--max-retries N]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import attrs

import fsm
from fsm.check import CheckConfig, check


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-retries", type=int, default=3)
    args = parser.parse_args()
    config = CheckConfig(policy=fsm.RetryPolicy(max_retries=args.max_retries))
    runs = {
        "table": check(config, timer=time.perf_counter),
        "no table": check(attrs.evolve(config, transition_table=False), timer=time.perf_counter),
    }
    assert all(r.ok for r in runs.values()) and len({(r.states, r.transitions) for r in runs.values()}) == 1
    print(f"{'checker':<10} {'states':>8} {'transitions':>12} {'seconds':>8} {'states/s':>9} {'transitions/s':>14}")
    rows = {}
    for name, r in runs.items():
        rows[name] = {
            "states": r.states,
            "transitions": r.transitions,
            "seconds": r.seconds,
            "states_per_s": r.states / r.seconds,
            "transitions_per_s": r.transitions / r.seconds,
        }
        print(
            f"{name:<10} {r.states:>8} {r.transitions:>12} {r.seconds:>8.2f} {r.states / r.seconds:>9,.0f}"
            f" {r.transitions / r.seconds:>14,.0f}"
        )
    speedup = rows["table"]["states_per_s"] / rows["no table"]["states_per_s"]
    print(f"transition table speed-up: {speedup:.2f}x")
    out = Path(__file__).parent / "results" / "checker.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"max_retries": args.max_retries, "runs": rows, "speedup": speedup}, indent=2) + "\n")


if __name__ == "__main__":
    main()
