"""Cold start: place → Ready through the Controller, against the same work done by a plain mlx_lm script.

    python bench/cold_start.py [--repeat N] [--smoke]

exod: a fresh Controller (fresh state dir; the daemon is up before the clock starts) places a 1-rank
instance of a tiny qwen2 (8 layers, hidden 256); timed from ``place()`` to the instance's transition to
Ready, at the time the controller's transition log gives it (the waiter is woken by the log, no polling).
Baseline: spawn ``python -c`` that imports mlx_lm, loads the same snapshot with ``mlx_lm.load`` and generates
4 greedy tokens (the runner's warm-up), timed from spawn to reading its ``done`` line. Runs are interleaved.
Goal: median exod/baseline ≤ 1.15.

Where exod's time goes is broken down from the controller's transition log (each machine's transitions, with
their times) and from the listener the controller's ``spawn`` gives each supervisor (the spawn, and the
runner's reports as they arrive); ``time.monotonic`` is one clock for every process on Linux, so the
baseline's in-process timestamps line up too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio
from _common import (  # type: ignore[import-not-found]
    TimedController,
    bench_config,
    machine_info,
    parse_args,
    reaped,
    run_controller,
    summary,
    table,
    verdict,
    write_result,
)

import fsm
from exod.host.models import resolve_model
from exod.host.tiny_model import make_tiny_model
from exod.runner import protocol as p

MODEL = "exod/tiny-bench"
GOAL_RATIO = 1.15
BASELINE = """
import time, json, sys
t0 = time.monotonic()
import mlx_lm
t1 = time.monotonic()
model, tokenizer = mlx_lm.load(sys.argv[1])
t2 = time.monotonic()
prompt = tokenizer.encode("warm up", add_special_tokens=False) or [0]
for _ in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=4):
    pass
t3 = time.monotonic()
print("done " + json.dumps([t0, t1, t2, t3]), flush=True)
"""


# the marks read from the transition log: (machine, event) → name
LOGGED = {
    ("instance", "place"): "placed",
    ("download", "begin"): "start_download",
    ("download", "complete"): "download_done",
    ("runner", "create"): "create_runner",
    ("runner", "connect"): "connect_sent",
    ("runner", "connected"): "connected",
    ("runner", "load"): "load_sent",
    ("runner", "weights_loaded"): "loaded",
    ("runner", "warm_up"): "warm_up_sent",
    ("runner", "warmed"): "warmed",
}


async def exod_once(controller: TimedController) -> dict[str, float]:
    after = await controller.last_seq()
    t_place = time.monotonic()
    iid = await controller.place(MODEL, 1)
    ready, _ = await controller.logged(after, lambda e: e.key == iid and e.target == fsm.InstanceState.READY.value)
    rid = f"{iid}/0"
    marks: dict[str, float] = {"ready": controller.monotonic(ready.time)}
    for t, entry in await controller.log_times(after):
        name = LOGGED.get((entry.machine, entry.event))
        ours = entry.key in (iid, rid) or (entry.machine == "download" and entry.key.endswith(f":{MODEL}"))
        if name is not None and ours and name not in marks:
            marks[name] = t

    def status(phase: p.Phase) -> float | None:  # None: the runner did not say it
        times = (t for t, r, m in controller.reports if r == rid and isinstance(m, p.Status) and m.phase is phase)
        return next(times, None)

    progress = [t for t, r, m in controller.reports if r == rid and isinstance(m, p.Progress)]
    spawned = [t for (r, _), (t, _) in controller.spawned.items() if r == rid]
    missing = {"placed", "create_runner", "load_sent", "loaded", "warm_up_sent", "warmed"} - marks.keys()
    if missing or not spawned or not progress:
        seen = "spawn" if spawned else "no spawn"
        raise RuntimeError(f"cold start of {rid} observed without {sorted(missing)}; {seen}, {len(progress)} layers")
    marks |= {
        "spawned": spawned[0],
        "weights_started": status(p.Phase.WEIGHTS),
        "first_layer": progress[0],
        "last_layer": progress[-1],
        "warming_up": status(p.Phase.WARMING_UP),
    }
    await controller.delete(iid)  # stop it, and wait until it is reaped, so it does not load the next run
    await controller.until(lambda: not controller.alive, timeout=30)
    return {name: (t - t_place) * 1000 for name, t in marks.items() if t is not None}


def baseline_once(snapshot: Path) -> dict[str, float]:
    t_spawn = time.monotonic()
    argv = [sys.executable, "-c", BASELINE, str(snapshot)]
    with reaped(subprocess.Popen(argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)) as proc:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        t_done = time.monotonic()
        if not line.startswith("done "):
            raise RuntimeError(f"baseline did not finish: {line!r}")
    t0, t1, t2, t3 = json.loads(line[5:])
    return {
        "interpreter_up": (t0 - t_spawn) * 1000,
        "mlx_lm_imported": (t1 - t_spawn) * 1000,
        "loaded": (t2 - t_spawn) * 1000,
        "warmed": (t3 - t_spawn) * 1000,
        "ready": (t_done - t_spawn) * 1000,
    }


def medians(runs: list[dict[str, float]]) -> dict[str, float]:
    names = sorted({name for run in runs for name in run}, key=lambda n: statistics.median(r.get(n, 0) for r in runs))
    return {name: round(statistics.median(run[name] for run in runs if name in run), 1) for name in names}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5, help="runs of each, interleaved (default 5)")
    args = parse_args(parser, smoke={"repeat": 1})

    exod_runs: list[dict[str, float]] = []
    base_runs: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="exod-bench-") as tmp:
        hf_home = Path(tmp) / "hf"
        make_tiny_model(
            MODEL, arch="qwen2", layers=8, hidden=256, heads=4, kv_heads=2, intermediate=512, hf_home=hf_home
        )
        snapshot = resolve_model(MODEL, hf_home=hf_home, offline=True)
        baseline_once(snapshot)  # one untimed run of each: page cache, .pyc files
        for i in range(args.repeat + 1):
            config = bench_config(Path(tmp) / f"state{i}", hf_home)
            run = trio.run(run_controller, config, exod_once)
            if i > 0:
                exod_runs.append(run)
                base_runs.append(baseline_once(snapshot))

    exod_ms = summary([r["ready"] for r in exod_runs])
    base_ms = summary([r["ready"] for r in base_runs])
    ratio = exod_ms["median_ms"] / base_ms["median_ms"]
    exod_marks, base_marks = medians(exod_runs), medians(base_runs)
    result = {
        "benchmark": "cold_start",
        "model": {"arch": "qwen2", "layers": 8, "hidden": 256, "intermediate": 512, "ranks": 1},
        "goal_ratio": GOAL_RATIO,
        "repeat": args.repeat,
        "exod_place_to_ready": exod_ms,
        "baseline_spawn_to_done": base_ms,
        "ratio_median_exod_over_baseline": round(ratio, 3),
        "meets_goal": ratio <= GOAL_RATIO,
        "exod_median_marks_ms_since_place": exod_marks,
        "baseline_median_marks_ms_since_spawn": base_marks,
        "exod_runs": exod_runs,
        "baseline_runs": base_runs,
        "machine": machine_info(),
    }

    print(
        table(
            [
                (f"→ Ready (n={args.repeat}, interleaved)", "median ms", "p99 ms", "min ms"),
                ("exod: place → instance Ready", *(f"{exod_ms[k]:.1f}" for k in ("median_ms", "p99_ms", "min_ms"))),
                ("baseline: spawn → done", *(f"{base_ms[k]:.1f}" for k in ("median_ms", "p99_ms", "min_ms"))),
            ]
        )
    )
    print(f"exod/baseline (median): {ratio:.3f}   goal ≤ {GOAL_RATIO}: {verdict(args, result['meets_goal'])}")
    print("exod medians, ms since place():", ", ".join(f"{k} {v}" for k, v in exod_marks.items()))
    print("baseline medians, ms since spawn:", ", ".join(f"{k} {v}" for k, v in base_marks.items()))
    write_result("cold_start", result, args)


if __name__ == "__main__":
    main()
