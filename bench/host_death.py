"""A node's death, timed: how soon the controller knows, and how soon the instance serves again.

    python bench/host_death.py [--repeat N]

Each repetition: a fresh local cluster (`exod.devcluster`: an etcd and three nodes on 127.0.0.1–3, lease
TTL 5 s) serves the tiny model on 2 ranks; the daemon of the node that holds a rank and is not the
controller is SIGKILLed (its runner follows it by its hang-up watchdog). From the kill:

* detection: the controller's status shows the instance's generation failed (the node's report stream
  broke; goal ≤ TTL + 0.5 s: a lease-based detector could do no better than the TTL);
* recovery: the instance is Ready again, placed on the nodes that are left. A node counts as dead for
  placement only once its lease expired, so recovery waits for the TTL, the backoff and a cold start.
"""

from __future__ import annotations

import argparse
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
from _common import machine_info, table, write_result  # type: ignore[import-not-found]

from exod.devcluster import local_cluster, place
from exod.tiny_model import make_tiny_model

MODEL = "exod/tiny-qwen2"
TTL = 5


def one_death() -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="exod-bench-") as scratch:
        root = Path(scratch)
        make_tiny_model(MODEL, layers=2, hf_home=root / "hf")
        daemons: list[subprocess.Popen[bytes]] = []
        with local_cluster(root, 3, root / "hf", announce=lambda line: None, lease_ttl=TTL, daemons=daemons) as urls:
            view = httpx.get(f"{urls[0]}/nodes", timeout=10).json()
            controller = next(n for n in view["nodes"] if n["controller"])
            url = controller["api_url"]
            status = place(url, MODEL, 2)
            iid, generation = status["instance_id"], status["generation"]
            victim = next(r["node"] for r in status["runners"] if r["node"] != controller["node_id"])
            process = daemons[int(victim.removeprefix("node-")) - 1]
            killed_at = time.monotonic()
            process.send_signal(signal.SIGKILL)
            process.wait()
            detected = None
            while True:
                status = httpx.get(f"{url}/instances/{iid}", timeout=10).json()
                elapsed = time.monotonic() - killed_at
                if detected is None and status["state"] != "ready":
                    detected = elapsed
                if status["state"] == "ready" and status["generation"] > generation:
                    return {"detected_s": detected if detected is not None else elapsed, "recovered_s": elapsed}
                time.sleep(0.01)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    runs = [one_death() for _ in range(args.repeat)]
    detection = statistics.median(r["detected_s"] for r in runs)
    recovery = statistics.median(r["recovered_s"] for r in runs)
    print(
        table(
            [
                ("from the SIGKILL", "median s", "against"),
                ("detection", f"{detection:.3f}", f"the lease TTL, {TTL} s (goal ≤ {TTL + 0.5} s)"),
                ("recovery", f"{recovery:.3f}", f"the TTL ({TTL} s) + the backoff + a cold start"),
            ]
        )
    )
    result = {"machine": machine_info(), "ttl_s": TTL, "runs": runs, "detection_s": detection, "recovery_s": recovery}
    print(f"written to {write_result('host_death', result)}")


if __name__ == "__main__":
    main()
