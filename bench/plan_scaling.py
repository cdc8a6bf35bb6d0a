"""How `fsm.plan` scales: views of 10, 100 and 1,000 instances × 4 runners, realistic mixed states.

Each instance is a model on 4 ranks, rank r on node r (4 nodes), so every node hosts one runner of
every instance. The instances cycle through the states a busy cluster holds at once:

* ready, serving (runners Ready, available or busy; a pending request for every third one);
* starting, loading (runners mid-weights, with layer progress);
* starting, connecting (runners joined, waiting for the group);
* recovering (one rank Failed, the others still Ready: the planner must stop them);
* backing off (every runner reaped after a failure; deadline in the future);
* pending (nothing created yet; its download on node-0 ongoing).

Downloads are completed on every node except for the pending instances. The view is built once
with `fsm.ClusterView.build`; `plan(view, "node-0", now)` is timed alone (best and median of
repeated batches). Goal: linear growth, ≤ 50 ms per call at 1,000 instances.

Prints a table and writes bench/results/plan_scaling.json. Run: ``.venv/bin/python bench/plan_scaling.py [--smoke]``.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

from _common import parse_args, verdict, write_result  # type: ignore[import-not-found]

import fsm
from fsm import DownloadState, InstanceState, RunnerPhase, RunnerState

NODES = ("node-0", "node-1", "node-2", "node-3")
RANKS = len(NODES)
NOW = 1_000.0
KINDS = ("ready", "loading", "connecting", "recovering", "backing_off", "pending")


def _runner(iid: str, rank: int, gen: int, state: RunnerState, phase: RunnerPhase | None, **kw) -> fsm.RunnerStatus:
    return fsm.RunnerStatus(f"{iid}/{rank}", iid, NODES[rank], rank, gen, state, phase, **kw)


def build_view(n: int) -> tuple[fsm.ClusterView, dict[str, int]]:
    instances, runners, downloads, requests = [], [], [], []
    counts = dict.fromkeys(KINDS, 0)
    for i in range(n):
        iid, model = f"inst-{i:04d}", f"org/model-{i % 37}"
        kind = KINDS[i % len(KINDS)]
        counts[kind] += 1
        slots = [fsm.Slot(rank, NODES[rank], f"{iid}/{rank}") for rank in range(RANKS)]
        gen = 1 + i % 3
        if kind == "ready":
            retry = fsm.RetryStatus(InstanceState.READY, generation=gen, attempts=gen - 1)
            for rank in range(RANKS):
                busy = rank == 0 and i % 2 == 0
                phase = RunnerPhase.BUSY if busy else RunnerPhase.AVAILABLE
                runners.append(_runner(iid, rank, gen, RunnerState.READY, phase, in_flight=int(busy)))
            if i % 3 == 0:
                requests.append(fsm.PendingRequest(f"req-{i}", iid))
        elif kind == "loading":
            retry = fsm.RetryStatus(InstanceState.STARTING, generation=gen, attempts=gen - 1)
            for rank in range(RANKS):
                loaded = (i + rank) % 24
                runners.append(
                    _runner(
                        iid, rank, gen, RunnerState.LOADING, RunnerPhase.WEIGHTS, layers_loaded=loaded, layers_total=24
                    )
                )
        elif kind == "connecting":
            retry = fsm.RetryStatus(InstanceState.STARTING, generation=gen, attempts=gen - 1)
            for rank in range(RANKS):
                phase = RunnerPhase.JOINED if rank % 2 == 0 else RunnerPhase.JOINING
                runners.append(_runner(iid, rank, gen, RunnerState.CONNECTING, phase))
        elif kind == "recovering":
            retry = fsm.RetryStatus(InstanceState.RECOVERING, generation=gen, attempts=gen)
            crash = fsm.Failure.exited(1, "CUDA error: out of memory")
            for rank in range(RANKS):
                if rank == 1:
                    runners.append(_runner(iid, rank, gen, RunnerState.FAILED, None, failure=crash))
                else:
                    runners.append(_runner(iid, rank, gen, RunnerState.READY, RunnerPhase.AVAILABLE))
        elif kind == "backing_off":
            deadline = NOW + 5.0 if i % 2 == 0 else NOW - 0.5  # half of them due now: a new generation starts
            retry = fsm.RetryStatus(InstanceState.BACKING_OFF, generation=gen, attempts=gen, deadline=deadline)
            crash = fsm.Failure.signalled(9)
            for rank in range(RANKS):
                failure = crash if rank == 2 else None
                runners.append(
                    _runner(
                        iid, rank, gen, RunnerState.SHUTDOWN, RunnerPhase.STOPPED, stop_requested=True, failure=failure
                    )
                )
        else:
            retry = fsm.RetryStatus(InstanceState.PENDING)
            downloads.append(fsm.DownloadStatus("node-0", model, DownloadState.ONGOING))
        instances.append(fsm.InstanceView(iid, model, slots, retry))
    done = {(d.node_id, d.model_id) for d in downloads}
    for inst in instances:
        for node in NODES:
            if (node, inst.model_id) not in done:
                downloads.append(fsm.DownloadStatus(node, inst.model_id, DownloadState.COMPLETED))
                done.add((node, inst.model_id))
    return fsm.ClusterView.build(instances, runners, downloads, requests), counts


def time_plan(view: fsm.ClusterView, budget_s: float) -> tuple[list[float], int]:
    """Seconds per call, one sample per batch; batches sized to ~20 ms, run for ``budget_s``."""
    t0 = time.perf_counter()
    actions = fsm.plan(view, "node-0", NOW)
    first = time.perf_counter() - t0
    batch = max(1, int(0.02 / max(first, 1e-6)))
    samples: list[float] = []
    end = time.perf_counter() + budget_s
    while time.perf_counter() < end or len(samples) < 5:
        t0 = time.perf_counter()
        for _ in range(batch):
            fsm.plan(view, "node-0", NOW)
        samples.append((time.perf_counter() - t0) / batch)
    return samples, len(actions)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--budget", type=float, default=3.0, help="seconds of timing per size (default 3)")
    args = parse_args(parser, smoke={"sizes": [10, 100], "budget": 0.05})

    rows = []
    for n in args.sizes:
        view, counts = build_view(n)
        samples, n_actions = time_plan(view, args.budget)
        best, median = min(samples), statistics.median(samples)
        rows.append(
            {
                "instances": n,
                "runners": len(view.runners),
                "states": counts,
                "actions": n_actions,
                "best_ms": best * 1e3,
                "median_ms": median * 1e3,
                "median_us_per_instance": median * 1e6 / n,
                "samples": len(samples),
            }
        )

    print(f"{'instances':>9} {'runners':>8} {'actions':>8} {'best ms':>9} {'median ms':>10} {'µs/instance':>12} growth")
    for prev, row in zip([None, *rows], rows, strict=False):
        growth = ""
        if prev is not None:
            size = row["instances"] / prev["instances"]
            row["growth_vs_previous"] = row["median_ms"] / prev["median_ms"]
            growth = f"×{row['growth_vs_previous']:.1f} for ×{size:g} instances"
        print(
            f"{row['instances']:>9} {row['runners']:>8} {row['actions']:>8} {row['best_ms']:>9.3f} "
            f"{row['median_ms']:>10.3f} {row['median_us_per_instance']:>12.2f} {growth}"
        )
    largest = rows[-1]
    judged = verdict(args, largest["median_ms"] <= 50)
    print(f"\ngoal ≤ 50 ms at {largest['instances']} instances: {largest['median_ms']:.2f} ms, {judged}")

    doc = {
        "benchmark": "plan_scaling",
        "python": sys.version.split()[0],
        "machine": f"{platform.system()} {platform.machine()}",
        "node": "node-0",
        "ranks_per_instance": RANKS,
        "rows": rows,
    }
    write_result("plan_scaling", doc, args)


if __name__ == "__main__":
    main()
