"""Residency (#29): a request to a parked instance, and three models taking turns in room for two.

    python bench/residency.py [--repeat N] [--rounds R] [--smoke]

Both parts run real runner processes on generated tiny qwen2 models (8 layers, hidden 256, intermediate 512,
`exod.host.tiny_model.make_tiny_model`), through a `_common.TimedController` configured as a user gets it
(`DaemonConfig`'s defaults: retry policy, timeouts, queue timeout 30 s, the host's memory and the limits it
gives) except ``offline = true`` (nothing is downloaded: the models are generated into a temp HF home) and
what each scenario needs, named below.

1. **Time to first token of a request to a parked instance.** One Controller for the whole part. An instance
   of the model is placed, becomes Ready and is parked (``Controller.park``) until its runner is reaped;
   then, clock started, ``requests.serving(model)`` (it answers the parked instance) and ``requests.submit``
   of a one-message chat request (4 greedy tokens), stopped when ``RequestStream.started`` returns its first
   token. After the request the instance is parked again (untimed) for the next run. Against, in the same
   run, interleaved (the order rotates each round; one untimed round first):

   * **fresh**: the cold start of a new placement in the same Controller: ``place()`` then the same request
     submitted at once, timed from ``place()`` to its first token; the instance is deleted and its runner
     reaped before the next run. Goal: median parked/fresh ≤ 1.05.
   * **raw**: spawn ``python -c`` that imports mlx_lm, ``mlx_lm.load``s the same snapshot and streams the
     same chat prompt (the model's chat template), timed from spawn to reading its first-token line.
     Goal: median parked/raw ≤ 1.15.

   Where each run's time goes is read from the transition log (each machine's transitions, with their
   times) and from what the runner's supervisor reported (spawn, phases, layers, first token). Each exod run
   also times, untimed by the goals, a second request (another prompt) on the instance once it is warm: what
   a first request pays beyond it is the runner's first use of the chat template and of a chat prompt.

2. **Three models round-robin with memory for two.** Three models of the same shape (different names and
   seeds) in a fresh Controller with ``[models] on_demand = true, keep_alive = 600`` (a request for a model
   not placed places it, on 1 rank; a finite keep-alive is what makes an idle instance evictable) and
   ``[limits] runners_per_node = 2`` (``fsm.Limits(runners_per_node=2, ranks_per_instance=2,
   instances_per_model=8)``, the default 512 MiB runner floor). The room is limited by the runner count, not
   by ``memory_bytes``: it is the setting a user writes in the config file (the host's memory is read, not
   configured), and on this host's memory the tiny models would fit by the dozen; for admission either is a
   room that holds two instances and not three. ``--rounds`` rounds of one chat request per model in turn
   (A, B, C, A, B, C, ...), one at a time, through ``requests.serving`` + ``submit``, each read to its end.
   Counted: served, failed with ``QueueTimeout`` (HTTP 503) or anything else, the evictions
   (``residency_counts[("park", "evicted")]``), the unparks, the placements; latency to the first token and
   to the last (p50/p99). A thread polls the process table every 10 ms (psutil: this process's descendants
   whose command line holds ``exod.runner``, zombies and the runners' own watchdog children excluded) and
   keeps the most runner processes seen alive at once; the supervisors' spawn and exit reports give the same
   count from inside. The poll must be that fine: a runner started before the evicted one is gone overlaps
   it only for the ~10 ms the evicted one takes to exit (seen when the plan's guard against it was removed).
   Goal: every request served within the queue timeout (no 503), and never more than 2 runner processes
   alive; the median latency is also given against part 1's fresh cold start. A smoke run judges no goal
   but fails if it sees a third runner or a request not served (a safety claim: broken, not slow).

Every runner is stopped and reaped on return, error, Ctrl-C or SIGTERM (`_common.run_controller`), the raw
script killed and reaped (`_common.reaped`).
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import attrs
import psutil
import trio
from _common import (  # type: ignore[import-not-found]
    TimedController,
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
from exod.config import DaemonConfig, Models
from exod.host.models import resolve_model
from exod.host.tiny_model import make_tiny_model
from exod.placer import InstanceBusy
from exod.requests import QueueTimeout
from exod.runner import protocol as p

MODEL = "exod/tiny-bench"
ROUND_ROBIN = ("exod/tiny-rr-a", "exod/tiny-rr-b", "exod/tiny-rr-c")
SHAPE = {"arch": "qwen2", "layers": 8, "hidden": 256, "heads": 4, "kv_heads": 2, "intermediate": 512}
MESSAGES = [{"role": "user", "content": "hi"}]
SECOND = [{"role": "user", "content": "ho"}]
SECOND_KEY = "second_request_first_token"  # in a run's marks: not since its clock, ms from its own submit
MAX_TOKENS = 4
GOAL_PARKED_OVER_FRESH = 1.05
GOAL_PARKED_OVER_RAW = 1.15
ROOM = 2  # instances (1 rank each) the round-robin's room holds
RR_LIMITS = fsm.Limits(runners_per_node=ROOM, ranks_per_instance=2, instances_per_model=8)
RR_MODELS = Models(on_demand=True, default_ranks=1, keep_alive=600.0)
POLL_S = 0.010

RAW = """
import time, json, sys
t0 = time.monotonic()
import mlx_lm
t1 = time.monotonic()
model, tokenizer = mlx_lm.load(sys.argv[1])
t2 = time.monotonic()
prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
for _ in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=4):
    t3 = time.monotonic()
    break
print("first " + json.dumps([t0, t1, t2, t3]), flush=True)
"""


def user_config(state_dir: Path, hf_home: Path, **changes: Any) -> DaemonConfig:
    """What a user gets, offline (nothing is downloaded), with the scenario's ``changes``."""
    return attrs.evolve(DaemonConfig(state_dir=state_dir, hf_home=hf_home, offline=True), **changes)


# -- observing one instance ---------------------------------------------------------------------------


def runner_alive(controller: TimedController, instance_id: str) -> bool:
    return any(runner_id.startswith(f"{instance_id}/") for runner_id, _ in controller.alive)


async def wait_state(controller: TimedController, instance_id: str, state: fsm.InstanceState) -> None:
    await controller.until(lambda: controller.instance(instance_id).instance_state is state, timeout=60)


async def park_and_wait(controller: TimedController, instance_id: str) -> float:
    """Park the instance (again while its last request is still being finished: `InstanceBusy`) and wait until it
    is Parked with its runner reaped; ms from the park to then."""
    t0 = time.monotonic()
    with trio.fail_after(30):
        while True:
            try:
                await controller.park(instance_id)
                break
            except InstanceBusy:
                await trio.sleep(0.005)
    await controller.until(
        lambda: (
            controller.instance(instance_id).instance_state is fsm.InstanceState.PARKED
            and not runner_alive(controller, instance_id)
        ),
        timeout=30,
    )
    return (time.monotonic() - t0) * 1000


async def request(
    controller: TimedController, instance_id: str, messages: list[dict[str, str]] = MESSAGES
) -> tuple[float, float, int]:
    """Submit the chat request, read it to its end: (first token, last item) times, and tokens said."""
    stream = controller.requests.submit(instance_id, messages, max_tokens=MAX_TOKENS)
    try:
        await stream.started()
        t_first = time.monotonic()
        said = 1
        async for _ in stream:
            said += 1
        return t_first, time.monotonic(), said
    finally:
        stream.close()


async def second_request(controller: TimedController, instance_id: str) -> float:
    """A second request (another prompt of the same length: not the prompt cache's) on the now warm instance:
    ms from submit to its first token. What the first request of a generation pays beyond it is the runner's
    first render of the chat template and first prefill of a chat prompt, which its warm-up does not do."""
    t0 = time.monotonic()
    t_first, _, _ = await request(controller, instance_id, SECOND)
    return (t_first - t0) * 1000


async def timeline(controller: TimedController, after: int, instance_id: str, t0: float) -> dict[str, float]:
    """ms since ``t0`` of the first of each transition of the instance, its rank 0 and its model's download
    (logged after ``after``), and of what the runner's supervisor said: spawn, phases, layers, first token."""
    rid, model_id = f"{instance_id}/0", controller.cluster.instances[instance_id].model_id
    marks: dict[str, float] = {}
    for t, entry in await controller.log_times(after):
        ours = entry.key in (instance_id, rid) or (entry.machine == "download" and entry.key.endswith(f":{model_id}"))
        name = f"{entry.machine}.{entry.event}" + (f"→{entry.target}" if entry.machine == "instance" else "")
        if ours and t >= t0 and name not in marks:
            marks[name] = t
    for (runner_id, _), (t, _) in controller.spawned.items():
        if runner_id == rid and t >= t0:
            marks.setdefault("spawned", t)
    for t, runner_id, report in controller.reports:
        if runner_id != rid or t < t0:
            continue
        if isinstance(report, p.Status):
            marks.setdefault(f"said {report.phase.value}", t)
        elif isinstance(report, p.Progress):
            marks.setdefault("first layer", t)
            marks["last layer"] = t
        elif isinstance(report, p.Token):
            marks.setdefault("first token reported", t)
    return {name: (t - t0) * 1000 for name, t in marks.items()}


# -- part 1: time to first token ----------------------------------------------------------------------


async def parked_once(controller: TimedController, instance_id: str, parks: list[float]) -> dict[str, float]:
    if runner_alive(controller, instance_id) or controller.residency(instance_id) is not fsm.Residency.PARKED:
        raise RuntimeError(f"{instance_id} should be parked, with no runner, before the timed request")
    after = await controller.last_seq()
    t0 = time.monotonic()
    served = await controller.requests.serving(MODEL)
    if served != instance_id:
        raise RuntimeError(f"serving({MODEL}) answered {served}, not the parked {instance_id}")
    t_first, t_end, _ = await request(controller, served)
    run = await timeline(controller, after, instance_id, t0)
    run |= {"first_token": (t_first - t0) * 1000, "last_token": (t_end - t0) * 1000}
    run[SECOND_KEY] = await second_request(controller, instance_id)
    parks.append(await park_and_wait(controller, instance_id))  # untimed: parked again for the next run
    return run


async def fresh_once(controller: TimedController) -> dict[str, float]:
    after = await controller.last_seq()
    t0 = time.monotonic()
    instance_id = await controller.place(MODEL, 1)
    t_first, t_end, _ = await request(controller, instance_id)
    run = await timeline(controller, after, instance_id, t0)
    run |= {"first_token": (t_first - t0) * 1000, "last_token": (t_end - t0) * 1000}
    run[SECOND_KEY] = await second_request(controller, instance_id)
    await controller.delete(instance_id)  # stop it, and wait until it is reaped, so it does not load the next run
    await controller.until(lambda: not controller.alive, timeout=30)
    return run


def raw_once(snapshot: Path) -> dict[str, float]:
    t_spawn = time.monotonic()
    argv = [sys.executable, "-c", RAW, str(snapshot)]
    with reaped(subprocess.Popen(argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)) as proc:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        t_read = time.monotonic()
        if not line.startswith("first "):
            raise RuntimeError(f"the raw script did not say its first token: {line!r}")
    t0, t1, t2, t3 = json.loads(line[6:])
    return {
        "interpreter_up": (t0 - t_spawn) * 1000,
        "mlx_lm_imported": (t1 - t_spawn) * 1000,
        "loaded": (t2 - t_spawn) * 1000,
        "first_token_in_script": (t3 - t_spawn) * 1000,
        "first_token": (t_read - t_spawn) * 1000,
    }


Runs = dict[str, list[dict[str, float]]]


async def first_token_runs(controller: TimedController, snapshot: Path, repeat: int) -> tuple[Runs, list[float]]:
    """The interleaved runs of each kind, and how long each park took (ms, from ``park()`` until Parked with the
    runner reaped)."""
    instance_id = await controller.place(MODEL, 1)
    await wait_state(controller, instance_id, fsm.InstanceState.READY)
    parks = [await park_and_wait(controller, instance_id)]
    runs: Runs = {"parked": [], "fresh": [], "raw": []}
    kinds = list(runs)
    for i in range(repeat + 1):  # round 0: untimed (page cache, .pyc files, the first of everything)
        for kind in kinds[i % 3 :] + kinds[: i % 3]:
            if kind == "parked":
                run = await parked_once(controller, instance_id, parks)
            elif kind == "fresh":
                run = await fresh_once(controller)
            else:
                run = await trio.to_thread.run_sync(raw_once, snapshot)
            if i > 0:
                runs[kind].append(run)
    return runs, parks


# -- part 2: three models, room for two -------------------------------------------------------------------


class RunnerPoll:
    """Counts, from outside the controller, the runner processes alive in this process's tree every
    ``POLL_S``: command line with ``exod.runner``, not a zombie, not a runner's own watchdog (a child of one)."""

    def __init__(self) -> None:
        self.most = 0
        self.samples = 0
        self.seen: set[int] = set()
        self.changes: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="runner-poll", daemon=True)

    def __enter__(self) -> RunnerPoll:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def count(self) -> set[int]:
        runners: dict[int, int] = {}
        for child in psutil.Process().children(recursive=True):
            try:
                if child.status() != psutil.STATUS_ZOMBIE and "exod.runner" in child.cmdline():
                    runners[child.pid] = child.ppid()
            except psutil.Error:  # gone meanwhile
                continue
        return {pid for pid, parent in runners.items() if parent not in runners}

    def _run(self) -> None:
        last = -1
        while not self._stop.is_set():
            alive = self.count()
            self.samples += 1
            self.seen |= alive
            self.most = max(self.most, len(alive))
            if len(alive) != last:
                self.changes.append((time.monotonic(), len(alive)))
                last = len(alive)
            self._stop.wait(POLL_S)


def most_at_once(intervals: list[tuple[float, float]]) -> int:
    """The most of the (start, end) intervals that overlap at one moment."""
    edges = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    most = now = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    return most


async def round_robin(controller: TimedController, rounds: int) -> dict[str, Any]:
    requests: list[dict[str, Any]] = []
    with RunnerPoll() as poll:
        for r in range(rounds):
            for model_id in ROUND_ROBIN:
                after = await controller.last_seq()
                t0 = time.monotonic()
                entry: dict[str, Any] = {"round": r, "model": model_id}
                try:
                    instance_id = await controller.requests.serving(model_id)
                    entry |= {"instance": instance_id, "residency": controller.residency(instance_id).value}
                    t_first, t_end, said = await request(controller, instance_id)
                    entry |= {"outcome": "served", "tokens": said}
                    entry |= {"first_token_ms": (t_first - t0) * 1000, "last_token_ms": (t_end - t0) * 1000}
                    entry["marks_ms"] = await timeline(controller, after, instance_id, t0)
                except QueueTimeout as exc:
                    entry |= {"outcome": "QueueTimeout", "error": str(exc), "after_ms": (time.monotonic() - t0) * 1000}
                except Exception as exc:  # counted and shown: the benchmark reports what failed, and goes on
                    entry |= {"outcome": type(exc).__name__, "error": str(exc)}
                requests.append(entry)
    end = time.monotonic()
    spawned = {key: t for key, (t, _) in controller.spawned.items()}
    intervals = [(t, controller.exit_reported.get(key, end)) for key, t in spawned.items()]
    pids = {pid for _, pid in controller.spawned.values()}
    if not poll.seen or not poll.seen <= pids:
        raise RuntimeError(f"the poll saw runner pids {sorted(poll.seen)}, the controller spawned {sorted(pids)}")

    # how long an evicted instance's runner took to go: from its park (the log) to its exit report
    stops = []
    for t, entry in await controller.log_times():
        if entry.machine == "instance" and entry.event == "park":
            exits = [
                x for (rid, _), x in controller.exit_reported.items() if rid.startswith(f"{entry.key}/") and x >= t
            ]
            if exits:
                stops.append((min(exits) - t) * 1000)
    counts = controller.residency_counts
    outcomes = collections.Counter(r["outcome"] for r in requests)
    served = [r for r in requests if r["outcome"] == "served"]
    return {
        "requests": requests,
        "outcomes": dict(outcomes),
        "served": outcomes["served"],
        "queue_timeouts": outcomes["QueueTimeout"],
        "other_failures": len(requests) - outcomes["served"] - outcomes["QueueTimeout"],
        "placements": len({r["instance"] for r in requests if "instance" in r}),
        "evictions": counts[("park", "evicted")],
        "parks": {cause: n for (event, cause), n in counts.items() if event == "park"},
        "unparks": sum(n for (event, _), n in counts.items() if event == "unpark"),
        "first_token": summary([r["first_token_ms"] for r in served]) if served else None,
        "last_token": summary([r["last_token_ms"] for r in served]) if served else None,
        "park_to_reaped": summary(stops) if stops else None,
        "median_marks_ms": medians([r["marks_ms"] for r in served]) if served else {},
        "most_runners_polled": poll.most,
        "polls": poll.samples,
        "most_runners_supervised": most_at_once(intervals),
        "runner_processes": len(spawned),
    }


# -- the run ------------------------------------------------------------------------------------------------


def medians(runs: list[dict[str, float]]) -> dict[str, float]:
    """Each mark's median over the runs that have it (a transition logged after the request ended may not be
    durable yet when it is read), in the order of those medians."""
    names = {name for run in runs for name in run}
    found = {name: round(statistics.median(run[name] for run in runs if name in run), 1) for name in names}
    return dict(sorted(found.items(), key=lambda item: item[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5, help="runs of each first-token case, interleaved (default 5)")
    parser.add_argument("--rounds", type=int, default=10, help="round-robin rounds, one request per model (default 10)")
    args = parse_args(parser, smoke={"repeat": 1, "rounds": 2})  # round 2: the first unparks

    with tempfile.TemporaryDirectory(prefix="exod-bench-") as tmp:
        hf_home = Path(tmp) / "hf"
        make_tiny_model(MODEL, **SHAPE, hf_home=hf_home)
        for seed, model_id in enumerate(ROUND_ROBIN, start=1):
            make_tiny_model(model_id, **SHAPE, seed=seed, hf_home=hf_home)
        snapshot = resolve_model(MODEL, hf_home=hf_home, offline=True)

        async def part1(controller: TimedController) -> tuple[Runs, list[float]]:
            return await first_token_runs(controller, snapshot, args.repeat)

        async def part2(controller: TimedController) -> dict[str, Any]:
            return await round_robin(controller, args.rounds)

        runs, parks = trio.run(run_controller, user_config(Path(tmp) / "state-ttft", hf_home), part1)
        rr_config = user_config(Path(tmp) / "state-rr", hf_home, limits=RR_LIMITS, models=RR_MODELS)
        rr = trio.run(run_controller, rr_config, part2)

    ttft = {kind: summary([r["first_token"] for r in kind_runs]) for kind, kind_runs in runs.items()}
    over_fresh = ttft["parked"]["median_ms"] / ttft["fresh"]["median_ms"]
    over_raw = ttft["parked"]["median_ms"] / ttft["raw"]["median_ms"]
    n_requests = args.rounds * len(ROUND_ROBIN)
    rr_met = rr["served"] == n_requests and rr["most_runners_polled"] <= ROOM and rr["most_runners_supervised"] <= ROOM
    result = {
        "benchmark": "residency",
        "model": {**SHAPE, "vocab": 512, "ranks": 1},
        "config": "DaemonConfig defaults, offline; round robin: [models] on_demand, keep_alive 600 s, "
        f"[limits] runners_per_node {ROOM}",
        "repeat": args.repeat,
        "first_token": {
            "goal_parked_over_fresh": GOAL_PARKED_OVER_FRESH,
            "goal_parked_over_raw": GOAL_PARKED_OVER_RAW,
            **{f"{kind}_ms": s for kind, s in ttft.items()},
            "ratio_median_parked_over_fresh": round(over_fresh, 3),
            "ratio_median_parked_over_raw": round(over_raw, 3),
            "meets_goal_fresh": over_fresh <= GOAL_PARKED_OVER_FRESH,
            "meets_goal_raw": over_raw <= GOAL_PARKED_OVER_RAW,
            "park_to_parked_ms": summary(parks),
            "median_marks_ms": {kind: medians(kind_runs) for kind, kind_runs in runs.items()},
            "runs": runs,
        },
        "round_robin": {
            "rounds": args.rounds,
            "room_instances": ROOM,
            "queue_timeout_s": rr_config.queue_timeout,
            "goal": "every request served (no 503), never more than 2 runner processes alive",
            "meets_goal": rr_met,
            **rr,
        },
        "machine": machine_info(),
    }

    def row(label: str, s: dict[str, float]) -> tuple[str, ...]:
        return (label, *(f"{s[k]:.1f}" for k in ("median_ms", "p99_ms", "min_ms")))

    print(
        table(
            [
                (f"→ first token (n={args.repeat}, interleaved)", "median ms", "p99 ms", "min ms"),
                row("exod: request to a parked instance", ttft["parked"]),
                row("exod: fresh place() + request", ttft["fresh"]),
                row("raw: spawn, mlx_lm.load, generate", ttft["raw"]),
            ]
        )
    )
    print(
        f"parked/fresh: {over_fresh:.3f} (goal ≤ {GOAL_PARKED_OVER_FRESH}: "
        f"{verdict(args, result['first_token']['meets_goal_fresh'])});  parked/raw: {over_raw:.3f} "
        f"(goal ≤ {GOAL_PARKED_OVER_RAW}: {verdict(args, result['first_token']['meets_goal_raw'])})"
    )
    for kind, marks in result["first_token"]["median_marks_ms"].items():
        line = ", ".join(f"{k} {v}" for k, v in marks.items() if k != SECOND_KEY)
        print(f"{kind} medians, ms since the clock started: {line}")
    second = {kind: medians(runs[kind])[SECOND_KEY] for kind in ("parked", "fresh")}
    print(f"a second request on the warm instance, submit → first token (median ms): {second}")
    print(f"park() → Parked, runner reaped: median {statistics.median(parks):.1f} ms (n={len(parks)}, untimed parks)")
    print()
    outcomes = ", ".join(f"{k} {v}" for k, v in rr["outcomes"].items())
    rows = [
        (f"round robin: {args.rounds} rounds × {len(ROUND_ROBIN)} models, room for {ROOM}", "value"),
        (
            "requests: served / 503 / other failures",
            f"{rr['served']} / {rr['queue_timeouts']} / {rr['other_failures']}",
        ),
        ("placements / evictions / unparks", f"{rr['placements']} / {rr['evictions']} / {rr['unparks']}"),
        (
            "most runner processes alive: polled / supervised",
            f"{rr['most_runners_polled']} / {rr['most_runners_supervised']}",
        ),
    ]
    for label, key in (
        ("first token", "first_token"),
        ("last token", "last_token"),
        ("evicted runner reaped", "park_to_reaped"),
    ):
        if rr[key] is not None:
            rows.append((f"{label}: p50 / p99 ms", f"{rr[key]['median_ms']:.1f} / {rr[key]['p99_ms']:.1f}"))
    print(table(rows))
    print(f"outcomes: {outcomes}; {rr['polls']} polls of the process table")
    if rr["first_token"] is not None:
        ratio = rr["first_token"]["median_ms"] / ttft["fresh"]["median_ms"]
        result["round_robin"]["first_token_over_fresh_cold_start"] = round(ratio, 3)
        print(f"round-robin first token / part 1's fresh cold start (medians): {ratio:.3f}")
        line = ", ".join(f"{k} {v}" for k, v in rr["median_marks_ms"].items())
        print(f"round-robin medians, ms since the request: {line}")
    print(f"every request served, ≤ {ROOM} runners at once: {verdict(args, rr_met)}")
    write_result("residency", result, args)
    if args.smoke and not rr_met:  # a safety claim (never more runners than the room), and no request lost
        raise SystemExit(f"the smoke run saw more than {ROOM} runners at once, or a request not served")


if __name__ == "__main__":
    main()
