"""A node's death, timed: how soon the controller knows, and how soon the instance serves again.

    python bench/host_death.py [--repeat N] [--smoke]

Each repetition: a fresh local cluster (`exod.cluster.devcluster`: an etcd and three nodes on 127.0.0.1–3, lease
TTL 5 s) serves the tiny model on 2 ranks; its cold start (place → Ready) is timed, the baseline of this
run. Then the daemon of the node that holds a rank and is not the controller is SIGKILLed (its runner
follows it by its hang-up watchdog). From the kill:

* detection: the controller's status shows the instance's generation failed (the node's report stream
  broke; goal ≤ TTL + 0.5 s: a lease-based detector could do no better than the TTL);
* the lease: the dead node is gone from ``/nodes`` (its lease expired, its runner keys with it);
* recovery: the instance is Ready again, placed on the nodes that are left. The dead node's runner counts
  as exited, and its node as gone for placement, only once the lease expired (fencing, DESIGN §5); the
  backoff starts once the generation is torn down; then a cold start. So it is measured against
  ``lease gone + backoff + the cold start`` of this run.
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
from _common import machine_info, parse_args, table, verdict, write_result  # type: ignore[import-not-found]

import fsm
from exod.cluster.devcluster import local_cluster, place
from exod.host.tiny_model import make_tiny_model

MODEL = "exod/tiny-qwen2"
TTL = 5
BACKOFF = fsm.RetryPolicy().backoff.initial  # the first delay, which a host's failure waits out too
RECOVERY_LIMIT_S = 120  # a run that does not recover by then is broken, not slow


def one_death() -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="exod-bench-") as scratch:
        root = Path(scratch)
        make_tiny_model(MODEL, layers=2, hf_home=root / "hf")
        daemons: list[subprocess.Popen[bytes]] = []
        with local_cluster(root, 3, root / "hf", announce=lambda line: None, lease_ttl=TTL, daemons=daemons) as urls:
            view = httpx.get(f"{urls[0]}/nodes", timeout=10).json()
            controller = next(n for n in view["nodes"] if n["controller"])
            url = controller["api_url"]
            placed_at = time.monotonic()
            status = place(url, MODEL, 2)
            cold_start = time.monotonic() - placed_at
            iid, generation = status["instance_id"], status["generation"]
            victim = next(r["node"] for r in status["runners"] if r["node"] != controller["node_id"])
            process = daemons[int(victim.removeprefix("node-")) - 1]
            killed_at = time.monotonic()
            process.send_signal(signal.SIGKILL)
            process.wait()
            detected = expired = None
            while time.monotonic() - killed_at < RECOVERY_LIMIT_S:
                status = httpx.get(f"{url}/instances/{iid}", timeout=10).json()
                elapsed = time.monotonic() - killed_at
                if detected is None and status["state"] != "ready":
                    detected = elapsed
                if expired is None and victim not in [n["node_id"] for n in httpx.get(f"{url}/nodes").json()["nodes"]]:
                    expired = elapsed
                if status["state"] == "ready" and status["generation"] > generation:
                    detected = elapsed if detected is None else detected
                    expired = elapsed if expired is None else expired
                    expected = max(detected, expired) + BACKOFF + cold_start
                    return {
                        "cold_start_s": cold_start,
                        "detected_s": detected,
                        "expired_s": expired,
                        "recovered_s": elapsed,
                        "recovery_ratio": elapsed / expected,
                    }
                time.sleep(0.01)
            raise RuntimeError(f"{iid} not Ready again {RECOVERY_LIMIT_S} s after {victim} was killed: {status}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="fresh clusters, one death each (default 3)")
    args = parse_args(parser, smoke={"repeat": 1})
    runs = [one_death() for _ in range(args.repeat)]
    med = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
    print(
        table(
            [
                ("from the SIGKILL", "median", "against"),
                ("detection", f"{med['detected_s']:.3f} s", f"{med['detected_s'] / TTL:.3f}× the lease TTL, {TTL} s"),
                ("lease gone", f"{med['expired_s']:.3f} s", f"{med['expired_s'] / TTL:.2f}× the TTL"),
                (
                    "recovery",
                    f"{med['recovered_s']:.3f} s",
                    f"{med['recovery_ratio']:.2f}× lease gone + {BACKOFF:g} s backoff + cold start "
                    f"({med['cold_start_s']:.2f} s)",
                ),
            ]
        )
    )
    result = {
        "machine": machine_info(),
        "ttl_s": TTL,
        "backoff_s": BACKOFF,
        "runs": runs,
        "detection_s": med["detected_s"],
        "expired_s": med["expired_s"],
        "cold_start_s": med["cold_start_s"],
        "recovery_s": med["recovered_s"],
        "recovery_ratio": med["recovery_ratio"],
    }
    print(f"detection ≤ TTL + 0.5 s: {verdict(args, med['detected_s'] <= TTL + 0.5)}")
    write_result("host_death", result, args)


if __name__ == "__main__":
    main()
