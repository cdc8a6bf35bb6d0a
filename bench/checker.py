"""States explored per second by the model checker, against itself without its transition table.

The table memoizes each machine's transitions as the real python-statemachine classes compute them; the
baseline, in the same run, computes every transition afresh. Same space, same answer, different speed.

    python bench/checker.py [--max-retries N] [--smoke]
"""

from __future__ import annotations

import argparse
import time

import attrs
from _common import machine_info, parse_args, write_result  # type: ignore[import-not-found]

import fsm
from fsm.check import CheckConfig, check


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-retries", type=int, default=3)
    args = parse_args(parser, smoke={"max_retries": 1})
    config = CheckConfig(policy=fsm.RetryPolicy(max_failures=args.max_retries))
    runs = {
        "table": check(config, timer=time.perf_counter),
        "no table": check(attrs.evolve(config, transition_table=False), timer=time.perf_counter),
    }
    if not all(r.ok for r in runs.values()) or len({(r.states, r.transitions) for r in runs.values()}) != 1:
        raise SystemExit(f"the two explorations disagree or found a violation: {runs}")
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
    doc = {"max_retries": args.max_retries, "runs": rows, "speedup": speedup, "machine": machine_info()}
    write_result("checker", doc, args)


if __name__ == "__main__":
    main()
