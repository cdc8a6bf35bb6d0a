"""Failure detection: SIGKILL a Ready runner, time until the controller records it as Failed.

    python bench/failure_detection.py [--repeat N]

For each repetition: wait (no polling: woken by the controller's own runner events) until the 1-rank
instance of the tiny model is Ready, take ``time.monotonic()``, SIGKILL the runner, and take the timestamp
at which the controller has applied the first ``Exited``/``Fail`` event of that runner incarnation to the
machines and committed it to the store. Goal: median and p99 ≤ 50 ms.

Baseline in the same run: a bare ``python -c "import time; time.sleep(60)"`` killed the same way, timed to
``Popen.wait()`` returning (blocking ``waitpid``), and — for reference — to trio's pidfd-backed
``Process.wait()`` (the mechanism the supervisor uses).
"""

from __future__ import annotations

import argparse
import os
import signal
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
    reaped,
    run_controller,
    summary,
    table,
    write_result,
)

from exod.host.tiny_model import make_tiny_model

MODEL = "exod/tiny-qwen2"
GOAL_MS = 50.0
SLEEPER = [sys.executable, "-c", "import sys, time; print('up', flush=True); time.sleep(60)"]
# the same sleep in a process shaped like a runner (mlx_lm imported, the model loaded, warmed up): separates
# what the kernel needs to tear such a process down from what exod adds on top
MLX_SLEEPER = """
import sys, time, mlx_lm
model, tokenizer = mlx_lm.load(sys.argv[1])
for _ in mlx_lm.stream_generate(model, tokenizer, [1, 2, 3], max_tokens=4):
    pass
print('up', flush=True)
time.sleep(60)
"""


async def measure_exod(controller: TimedController, repeat: int) -> list[dict]:
    iid = await controller.place(MODEL, 1)
    runner_id = f"{iid}/0"
    samples = []
    for _ in range(repeat):
        await controller.until(lambda: controller.instance_state(iid) == "ready")
        machine = controller.cluster.runner(runner_id)
        incarnation = machine.incarnation
        key = (runner_id, incarnation)
        pid = controller.runner_pid(*key)
        assert pid is not None
        await trio.sleep(0.05)  # let the ready runner and the controller settle (idle, waiting)
        t_kill = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        t_received, t_recorded, state, failure = await controller.until(lambda k=key: controller.first_exit.get(k))
        samples.append(
            {
                "incarnation": incarnation,
                "pid": pid,
                "on_exit_ms": (controller.exit_reported[key] - t_kill) * 1000,
                "received_ms": (t_received - t_kill) * 1000,
                "recorded_ms": (t_recorded - t_kill) * 1000,
                "recorded_state": state,
                "recorded_failure": failure,
            }
        )
    return samples


def measure_popen(repeat: int, argv: list[str]) -> list[float]:
    samples = []
    for _ in range(repeat):
        with reaped(subprocess.Popen(argv, stdout=subprocess.PIPE, start_new_session=True)) as proc:
            assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
            time.sleep(0.05)
            t_kill = time.monotonic()
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            samples.append((time.monotonic() - t_kill) * 1000)
    return samples


async def measure_trio_pidfd(repeat: int) -> list[float]:
    samples = []
    for _ in range(repeat):
        proc = await trio.lowlevel.open_process(SLEEPER, stdout=subprocess.PIPE, start_new_session=True)
        try:
            assert proc.stdout is not None
            await proc.stdout.receive_some(3)
            await trio.sleep(0.05)
            t_kill = time.monotonic()
            os.kill(proc.pid, signal.SIGKILL)
            await proc.wait()
            samples.append((time.monotonic() - t_kill) * 1000)
        finally:
            with trio.CancelScope(shield=True):
                if proc.returncode is None:
                    proc.kill()
                await proc.wait()
                assert proc.stdout is not None
                await proc.stdout.aclose()
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=20, help="kills per measurement (default 20)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="exod-bench-") as tmp:
        hf_home = Path(tmp) / "hf"
        make_tiny_model(MODEL, arch="qwen2", layers=2, hf_home=hf_home)
        config = bench_config(Path(tmp) / "state", hf_home)
        exod = trio.run(run_controller, config, lambda c: measure_exod(c, args.repeat))
        snapshot = next((hf_home / "hub" / "models--exod--tiny-qwen2" / "snapshots").iterdir())
        mlx_popen = measure_popen(args.repeat, [sys.executable, "-c", MLX_SLEEPER, str(snapshot)])
    popen = measure_popen(args.repeat, SLEEPER)
    pidfd = trio.run(measure_trio_pidfd, args.repeat)

    recorded = summary([s["recorded_ms"] for s in exod])
    received = summary([s["received_ms"] for s in exod])
    on_exit = summary([s["on_exit_ms"] for s in exod])
    baseline = summary(popen)
    trio_wait = summary(pidfd)
    mlx_wait = summary(mlx_popen)
    ratio = recorded["median_ms"] / baseline["median_ms"]
    result = {
        "benchmark": "failure_detection",
        "goal_ms": GOAL_MS,
        "repeat": args.repeat,
        "exod_recorded_failed": recorded,
        "exod_event_received": received,
        "exod_supervisor_on_exit": on_exit,
        "baseline_popen_wait": baseline,
        "reference_trio_pidfd_wait": trio_wait,
        "reference_popen_wait_mlx_process": mlx_wait,
        "ratio_median_exod_over_baseline": round(ratio, 2),
        "ratio_p99_exod_over_baseline": round(recorded["p99_ms"] / baseline["p99_ms"], 2),
        "meets_goal": recorded["median_ms"] <= GOAL_MS and recorded["p99_ms"] <= GOAL_MS,
        "recorded_states": sorted({s["recorded_state"] for s in exod}),
        "recorded_failures": sorted({str(s["recorded_failure"]) for s in exod}),
        "samples": exod,
        "baseline_samples_ms": popen,
        "machine": machine_info(),
    }
    path = write_result("failure_detection", result)

    def row(name: str, s: dict) -> tuple[str, ...]:
        return (name, f"{s['median_ms']:.2f}", f"{s['p99_ms']:.2f}", f"{s['max_ms']:.2f}")

    print(
        table(
            [
                (f"kill → …  (n={args.repeat})", "median ms", "p99 ms", "max ms"),
                row("exod: runner recorded Failed", recorded),
                row("exod: supervisor calls on_exit", on_exit),
                row("exod: Exited event reaches controller", received),
                row("baseline: Popen.wait() returns", baseline),
                row("reference: trio Process.wait()", trio_wait),
                row("reference: Popen.wait(), mlx_lm process", mlx_wait),
            ]
        )
    )
    verdict = "meets" if result["meets_goal"] else "MISSES"
    print(f"exod/baseline (median): {ratio:.2f}×   goal ≤ {GOAL_MS:.0f} ms: {verdict}")
    print(f"recorded states: {result['recorded_states']}")
    print(f"recorded failures: {result['recorded_failures']}")
    print(f"→ {path}")


if __name__ == "__main__":
    main()
