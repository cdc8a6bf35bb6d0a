"""Transitions per second: the library's RunnerLifecycle.apply against bare python-statemachine and a dict.

One run of each, the same event sequence for all three: per round, a fresh runner (rank 0 of 2)
goes connect → connected → load → progress ×4 → weights_loaded → warm_up → warmed (10 events), then
``--cycles`` request_started/request_finished pairs (available ⇄ busy). Construction is not timed.

* library: `fsm.RunnerLifecycle.apply` with typed events (validation, incarnation check, step log), as the
  daemon runs it: in Ready, ``request_started`` / ``request_finished`` skip python-statemachine's engine;
* library, every event through the engine: the same, that shortcut switched off (what ``apply`` did until
  2026-12-06, and what every other event still does): the library's own cost over the engine;
* bare python-statemachine: a minimal `StateMachine` of the same shape (the same compound states,
  events and guards, an in-flight counter), driven by ``send(name)``;
* dict: ``state = table[(state, event)]`` over the leaf states (no guards, no counters).

Prints a table and writes bench/results/machines.json. Run: ``.venv/bin/python bench/machines.py [--smoke]``.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time

import statemachine
from _common import parse_args, write_result  # type: ignore[import-not-found]
from statemachine import State, StateMachine

from fsm import runner as rn

RID, INC = "bench/0", 0


class BareRunner(StateMachine):
    """The runner's shape with nothing of ours: no typed events, no step log, no validation."""

    class running(State.Compound):
        idle = State(initial=True)

        class connecting(State.Compound):
            joining = State(initial=True)
            joined = State()

        class loading(State.Compound):
            weights = State(initial=True)
            loaded = State()
            warming_up = State()

        class ready(State.Compound):
            available = State(initial=True)
            busy = State()

    failed = State()

    class shutdown(State.Compound):
        stopping = State(initial=True)
        stopped = State(final=True)

    connect = running.idle.to(running.connecting, cond="multi_rank")
    connected = running.connecting.joining.to(running.connecting.joined)
    load = running.idle.to(running.loading, cond="single_rank") | running.connecting.joined.to(running.loading)
    progress = running.loading.weights.to.itself(internal=True)
    weights_loaded = running.loading.weights.to(running.loading.loaded)
    warm_up = running.loading.loaded.to(running.loading.warming_up)
    warmed = running.loading.warming_up.to(running.ready)
    request_started = running.ready.available.to(running.ready.busy, on="_in") | running.ready.busy.to.itself(
        internal=True, on="_in"
    )
    request_finished = running.ready.busy.to(
        running.ready.available, cond="last_request", on="_out"
    ) | running.ready.busy.to.itself(internal=True, unless="last_request", on="_out")
    fail = running.to(failed)
    stop = running.to(shutdown)
    exited = shutdown.stopping.to(shutdown.stopped) | failed.to(shutdown.stopped)

    def __init__(self) -> None:
        self.world_size = 2
        self.in_flight = 0
        super().__init__()

    @property
    def multi_rank(self) -> bool:
        return self.world_size > 1

    @property
    def single_rank(self) -> bool:
        return self.world_size == 1

    @property
    def last_request(self) -> bool:
        return self.in_flight == 1

    def _in(self) -> None:
        self.in_flight += 1

    def _out(self) -> None:
        self.in_flight -= 1


SETUP = ["connect", "connected", "load", "progress", "progress", "progress", "progress"]
SETUP += ["weights_loaded", "warm_up", "warmed"]

TABLE = {
    ("idle", "connect"): "joining",
    ("joining", "connected"): "joined",
    ("joined", "load"): "weights",
    ("weights", "progress"): "weights",
    ("weights", "weights_loaded"): "loaded",
    ("loaded", "warm_up"): "warming_up",
    ("warming_up", "warmed"): "available",
    ("available", "request_started"): "busy",
    ("busy", "request_finished"): "available",
}


def _library_events(cycles: int) -> list[rn.RunnerEvent]:
    setup = [
        rn.Connect(RID, INC),
        rn.Connected(RID, INC),
        rn.Load(RID, INC),
        *(rn.Progress(RID, INC, layers_loaded=n, layers_total=4) for n in (1, 2, 3, 4)),
        rn.WeightsLoaded(RID, INC),
        rn.WarmUp(RID, INC),
        rn.Warmed(RID, INC),
    ]
    return setup + [rn.RequestStarted(RID, INC), rn.RequestFinished(RID, INC)] * cycles


def run_library(rounds: int, cycles: int) -> tuple[int, float]:
    events = _library_events(cycles)
    elapsed = 0.0
    for _ in range(rounds):
        machine = rn.RunnerLifecycle(RID, rank=0, world_size=2, incarnation=INC)
        apply = machine.apply
        t0 = time.perf_counter()
        for event in events:
            apply(event)
        elapsed += time.perf_counter() - t0
        assert machine.leaf == "available", machine.leaf
    return rounds * len(events), elapsed


def run_library_engine(rounds: int, cycles: int) -> tuple[int, float]:
    shortcut, rn._SERVING = rn._SERVING, {}  # no leaf of Ready is taken without the engine
    try:
        return run_library(rounds, cycles)
    finally:
        rn._SERVING = shortcut


def run_bare(rounds: int, cycles: int) -> tuple[int, float]:
    names = SETUP + ["request_started", "request_finished"] * cycles
    elapsed = 0.0
    for _ in range(rounds):
        machine = BareRunner()
        send = machine.send
        t0 = time.perf_counter()
        for name in names:
            send(name)
        elapsed += time.perf_counter() - t0
        assert machine.available.is_active
    return rounds * len(names), elapsed


def run_dict(rounds: int, cycles: int) -> tuple[int, float]:
    names = SETUP + ["request_started", "request_finished"] * cycles
    table = TABLE
    elapsed = 0.0
    for _ in range(rounds):
        state = "idle"
        t0 = time.perf_counter()
        for name in names:
            state = table[(state, name)]
        elapsed += time.perf_counter() - t0
        assert state == "available"
    return rounds * len(names), elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=100, help="fresh machines per contestant (default 100)")
    parser.add_argument("--cycles", type=int, default=100, help="busy ⇄ available pairs per machine (default 100)")
    args = parse_args(parser, smoke={"rounds": 2, "cycles": 5})

    results = {}
    for name, fn, rounds in (
        ("library: RunnerLifecycle.apply", run_library, args.rounds),
        ("library, every event through the engine", run_library_engine, args.rounds),
        ("bare python-statemachine: send", run_bare, args.rounds),
        ("dict: table[(state, event)]", run_dict, args.rounds * 20),
    ):
        transitions, seconds = fn(rounds, args.cycles)
        results[name] = {"transitions": transitions, "seconds": seconds, "per_second": transitions / seconds}

    library = results["library: RunnerLifecycle.apply"]["per_second"]
    print(f"{'contestant':<40} {'transitions':>11} {'seconds':>8} {'per second':>12} {'µs each':>8} {'vs library':>10}")
    for name, r in results.items():
        r["speedup_vs_library"] = r["per_second"] / library
        print(
            f"{name:<40} {r['transitions']:>11} {r['seconds']:>8.3f} {r['per_second']:>12,.0f} "
            f"{1e6 / r['per_second']:>8.2f} {r['speedup_vs_library']:>9.1f}×"
        )
    bare = results["bare python-statemachine: send"]["per_second"]
    engine = results["library, every event through the engine"]["per_second"]
    print(f"\nlibrary overhead over bare python-statemachine: {bare / engine:.2f}× the time per transition")
    print(f"the Ready shortcut: {library / engine:.1f}× the transitions per second over this sequence")

    doc = {
        "benchmark": "machines",
        "python": sys.version.split()[0],
        "python_statemachine": statemachine.__version__,
        "machine": f"{platform.system()} {platform.machine()}",
        "rounds": args.rounds,
        "cycles": args.cycles,
        "results": results,
        "library_over_bare": bare / engine,  # the library's own cost, every event through the engine
        "shortcut_speedup": library / engine,
    }
    write_result("machines", doc, args)


if __name__ == "__main__":
    main()
