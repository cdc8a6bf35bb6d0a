"""States explored per second by the control plane's model checker (`fsm.fencing`), and the time of its
exhaustive configuration (the one CI runs), against the machines' checker (`fsm.check`) in the same run.

    python bench/fencing_checker.py [--smoke]
"""

from __future__ import annotations

import argparse
import time

from _common import machine_info, parse_args, verdict, write_result  # type: ignore[import-not-found]

import fsm
from fsm.check import CheckConfig, check
from fsm.fencing import FencingConfig, check_fencing

GOAL_STATES_PER_S = 20_000  # issue #24: fast enough that CI's configuration is exhaustive


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=3, help="the exhaustive configuration's, by default")
    args = parse_args(parser, smoke={"nodes": 2})
    fencing = check_fencing(FencingConfig(nodes=args.nodes), timer=time.perf_counter)
    machines = check(CheckConfig(policy=fsm.RetryPolicy(max_failures=1)), timer=time.perf_counter)
    if not (fencing.ok and fencing.exhaustive and machines.ok):
        raise SystemExit(f"a checker found a violation or stopped short:\n{fencing.report()}\n{machines.report()}")
    rate, baseline = fencing.states / fencing.seconds, machines.states / machines.seconds
    print(f"{'checker':<22} {'states':>9} {'seconds':>8} {'states/s':>9}")
    print(f"{'fsm.fencing':<22} {fencing.states:>9} {fencing.seconds:>8.2f} {rate:>9,.0f}")
    print(f"{'fsm.check (baseline)':<22} {machines.states:>9} {machines.seconds:>8.2f} {baseline:>9,.0f}")
    print(f"fsm.fencing / fsm.check: {rate / baseline:.1f}x states/s")
    print(f"fsm.fencing states/s >= {GOAL_STATES_PER_S:,}: {verdict(args, rate >= GOAL_STATES_PER_S)}")
    doc = {
        "nodes": args.nodes,
        "fencing": {"states": fencing.states, "seconds": fencing.seconds, "states_per_s": rate},
        "machines_baseline": {"states": machines.states, "seconds": machines.seconds, "states_per_s": baseline},
        "ratio": rate / baseline,
        "machine": machine_info(),
    }
    write_result("fencing_checker", doc, args)


if __name__ == "__main__":
    main()
