"""The driver's overhead: `fsm.Driver.reconcile` against the same loop written by hand on `Cluster.execute`.

Both bring ``--instances`` instances of 2 ranks each (on 2 nodes) from placement to Ready, with the same
world answering every report at once, then fail rank 1 of each and bring the next generation up. The hand
loop is what exod's controller ran before it used the driver: a tick per instance, then rounds of plan on
every node → execute → the handler, until the plan is empty. Time is per action taken; the goal is the
driver ≤ 1.2× the hand loop's. The two alternate (in turn first), ``--repeats`` times each, each after a
garbage collection, and the medians are compared.

Run: ``.venv/bin/python bench/driver.py [--smoke]``; writes bench/results/driver.json.
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import sys
import time
from collections.abc import Callable

from _common import parse_args, verdict, write_result  # type: ignore[import-not-found]

import fsm
from fsm import instance as inst
from fsm import runner as rn

GOAL = 1.2
NODES = ("a", "b")
POLICY = fsm.RetryPolicy(backoff=fsm.Backoff(0.5, 1.0, 0.5), max_failures=1_000)


class World:
    """Answers everything at once: the same work for both contestants."""

    def __init__(self) -> None:
        self.reports: list[Callable[[], object]] = []
        self.cluster: fsm.Cluster
        self.now = 0.0

    def create_runner(self, a: fsm.CreateRunner) -> str:
        return f"{a.node_id}:{a.rank}"

    def start_download(self, a: fsm.StartDownload) -> None:
        self.reports.append(lambda: self.cluster.download_event(a.node_id, fsm.download.Complete(a.model_id, self.now)))

    def connect_runner(self, a: fsm.ConnectRunner) -> None:
        self.reports.append(lambda: self.cluster.runner_event(rn.Connected(a.runner_id, a.incarnation), self.now))

    def load_model(self, a: fsm.LoadModel) -> None:
        self.reports.append(lambda: self.cluster.runner_event(rn.WeightsLoaded(a.runner_id, a.incarnation), self.now))

    def warm_up(self, a: fsm.WarmUp) -> None:
        self.reports.append(lambda: self.cluster.runner_event(rn.Warmed(a.runner_id, a.incarnation), self.now))

    def stop_runner(self, a: fsm.StopRunner) -> None:
        self.reports.append(
            lambda: self.cluster.runner_event(rn.Exited(a.runner_id, a.incarnation, exit_code=0), self.now)
        )

    def forward_request(self, a: fsm.ForwardRequest) -> None:
        raise AssertionError("no requests here")

    cancel_request = forward_request


HANDLERS = {
    fsm.CreateRunner: "create_runner",
    fsm.StartDownload: "start_download",
    fsm.ConnectRunner: "connect_runner",
    fsm.LoadModel: "load_model",
    fsm.WarmUp: "warm_up",
    fsm.StopRunner: "stop_runner",
}


def by_hand(cluster: fsm.Cluster, world: World) -> int:
    """The loop as written before the driver (exod's controller): returns the actions taken."""
    now, taken = world.now, 0
    for iid in list(cluster.instances):
        cluster.instance_event(inst.Tick(iid, now))
    while True:
        view = cluster.view()
        actions = [a for node in NODES for a in fsm.plan(view, node, now)]
        if not actions:
            return taken
        for action in actions:
            try:
                if not cluster.execute(action, now).accepted:
                    continue
            except fsm.FsmError:
                continue
            taken += 1
            if (name := HANDLERS.get(type(action))) is not None:
                endpoint = getattr(world, name)(action)
                if isinstance(endpoint, str):
                    cluster.publish(action.runner_id, action.incarnation, endpoint)


def with_driver(cluster: fsm.Cluster, world: World) -> int:
    return len(fsm.Driver(cluster, world, lambda: world.now, nodes=NODES).reconcile().taken)


def run(loop: Callable[[fsm.Cluster, World], int], instances: int) -> tuple[int, float]:
    """Bring every instance up, fail each once, bring them up again: (actions, seconds in the loop)."""
    cluster, world = fsm.Cluster(), World()
    world.cluster = cluster
    for i in range(instances):
        cluster.place(f"i{i}", "org/m", [fsm.Slot(r, NODES[r], f"i{i}/{r}") for r in range(2)], policy=POLICY)
    actions, seconds = 0, 0.0

    def settle() -> None:
        nonlocal actions, seconds
        while True:
            t0 = time.perf_counter()
            actions += loop(cluster, world)
            seconds += time.perf_counter() - t0
            if not world.reports:
                return
            reports, world.reports = world.reports, []
            for report in reports:
                report()

    settle()
    for i in range(instances):
        gen = cluster.instance(f"i{i}").generation
        cluster.runner_event(rn.Exited(f"i{i}/1", gen, exit_code=-9), world.now)
    settle()  # the survivors are stopped; every instance backs off
    world.now += POLICY.backoff.cap
    settle()
    assert all(cluster.instance(f"i{i}").generation == 2 for i in range(instances))
    assert all(m.machine.instance_state is fsm.InstanceState.READY for m in cluster.instances.values())
    return actions, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instances", type=int, default=20, help="instances of 2 ranks (default 20)")
    parser.add_argument("--repeats", type=int, default=7, help="runs of each contestant, alternating (default 7)")
    args = parse_args(parser, smoke={"instances": 2, "repeats": 1})

    per_action: dict[str, list[float]] = {"by hand": [], "driver": []}
    counts: dict[str, int] = {}
    contestants = [("by hand", by_hand), ("driver", with_driver)]
    for repeat in range(args.repeats):
        for name, loop in contestants if repeat % 2 == 0 else contestants[::-1]:  # neither always goes second
            gc.collect()  # the other's garbage is not collected on this one's time
            actions, seconds = run(loop, args.instances)
            counts[name] = actions
            per_action[name].append(seconds / actions)
    assert counts["by hand"] == counts["driver"], counts  # the same work, or the comparison means nothing
    hand, driver = (statistics.median(per_action[n]) for n in ("by hand", "driver"))
    ratio = driver / hand
    print(f"{args.instances} instances of 2 ranks, {counts['driver']} actions per run, {args.repeats} runs each")
    print(f"{'loop':<10} {'µs per action (median)':>24}")
    print(f"{'by hand':<10} {1e6 * hand:>24.1f}\n{'driver':<10} {1e6 * driver:>24.1f}")
    print(f"driver / by hand: {ratio:.2f}× (goal ≤ {GOAL}×): {verdict(args, ratio <= GOAL)}")
    write_result(
        "driver",
        {
            "benchmark": "driver",
            "python": sys.version.split()[0],
            "machine": f"{platform.system()} {platform.machine()}",
            "instances": args.instances,
            "repeats": args.repeats,
            "actions_per_run": counts["driver"],
            "us_per_action": {"by_hand": 1e6 * hand, "driver": 1e6 * driver},
            "ratio": ratio,
            "goal": GOAL,
        },
        args,
    )


if __name__ == "__main__":
    main()
