"""Models that come and go as they are used (issue #29), seen from outside a real `exod serve`: its runner
processes in the process table, its HTTP answers in the OpenAI and Ollama dialects, its CLI and metrics.

An idle instance is parked (its processes gone) after its keep-alive, and a request brings it back; Ollama's
``keep_alive`` 0 unloads; a model not placed is placed on demand; with room for one runner, using two models
in turn evicts the least recently used one, and at no moment do two runners run; what cannot be made room
for is refused as before (409), and a request for it waits, then gets 503 with Retry-After.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from daemon_harness import assert_log_conforms, exod, runner_pids, start_daemon
from exod.host.tiny_model import make_tiny_model

pytestmark = pytest.mark.usefixtures("no_runner_left_behind")

MODEL = "exod/tiny-qwen2"
OTHER = "exod/tiny-other"
LOAD_S = 60.0  # a tiny model's cold start on a busy 2-core machine is a few seconds: a generous bound
BASE = """
[daemon]
port = 0
offline = true

[retry]
initial = 0.2
cap = 1.0
"""


@contextmanager
def daemon(tmp: Path, config: str, *extra: str) -> Iterator[tuple[str, dict[str, str]]]:
    """`exod serve` with ``config`` and both tiny models in its cache (none placed unless the config says):
    yields its URL and the environment the CLI needs; SIGTERM must end it cleanly."""
    hf = tmp / "hf"
    for seed, model in enumerate((MODEL, OTHER)):
        make_tiny_model(model, layers=2, hf_home=hf, seed=seed)
    (tmp / "exod.toml").write_text(BASE + config)
    env = {**os.environ, "HF_HOME": str(hf), "HF_HUB_OFFLINE": "1"}
    process, url = start_daemon(tmp, env, *extra)
    try:
        yield url, env
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0, (tmp / "serve.log").read_text()


def until(probe: Callable[[], Any], ok: Callable[[Any], bool] = bool, timeout: float = LOAD_S) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if ok(value):
            return value
        assert time.monotonic() < deadline, f"timed out; last: {value}"
        time.sleep(0.05)


def instances(url: str) -> list[dict[str, Any]]:
    return httpx.get(f"{url}/instances", timeout=10).json()["instances"]


def of(url: str, model: str) -> dict[str, Any]:
    return next(i for i in instances(url) if i["model_id"] == model and i["state"] != "deleted")


def chat(url: str, model: str, **extra: Any) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **extra}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=2 * LOAD_S)


def metric(url: str, name: str) -> float:
    """The value of one series of /metrics (0 if absent)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return 0.0 if found is None else float(found.group(1))


class MostRunners:
    """Polls the process table every few ms while it runs: the most runner processes alive at one moment."""

    def __init__(self) -> None:
        self.most = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.most = max(self.most, len(runner_pids()))
            time.sleep(0.01)

    def __enter__(self) -> MostRunners:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()


def test_an_idle_instance_is_parked_and_a_request_brings_it_back(tmp_path):
    config = f'[[place]]\nmodel = "{MODEL}"\nranks = 1\nkeep_alive = "1s"\n'
    with daemon(tmp_path, config) as (url, env):
        first = until(lambda: of(url, MODEL), lambda i: i["state"] == "ready")
        assert first["keep_alive"] == 1.0
        until(runner_pids, lambda pids: pids == [])  # unused for its keep-alive: its process is gone
        parked = of(url, MODEL)
        assert (parked["state"], parked["residency"], parked["attempts"], parked["park_at"]) == (
            "parked",
            "parked",
            0,
            None,
        )
        assert httpx.get(f"{url}/api/ps", timeout=10).json()["models"] == []
        assert "parked" in exod("status", "--url", url, env=env).stdout

        served = chat(url, MODEL)  # waits while it comes back: never refused
        assert served.status_code == 200, served.text
        assert served.json()["usage"]["completion_tokens"] >= 1
        back = of(url, MODEL)
        assert (back["generation"], back["attempts"], back["uncharged"]) == (2, 0, 0)  # no retry spent
        assert metric(url, 'exod_parks_total{reason="idle"}') >= 1
        assert metric(url, "exod_unparks_total") >= 1
        assert metric(url, 'exod_cold_start_seconds_count{model="exod/tiny-qwen2"}') == 1
        until(runner_pids, lambda pids: pids == [])  # and idle again, parked again


def test_a_parked_instance_stays_parked_across_a_restart(tmp_path):
    config = f'[[place]]\nmodel = "{MODEL}"\nranks = 1\n'
    with daemon(tmp_path, config) as (url, env):
        iid = until(lambda: of(url, MODEL), lambda i: i["state"] == "ready")["instance_id"]
        said = exod("park", iid, "--url", url, env=env)
        assert said.stdout.strip() in (f"{iid} parking", f"{iid} parked"), said
        until(runner_pids, lambda pids: pids == [])
        assert exod("park", iid, "--url", url, env=env).stdout.strip() == f"{iid} parked"  # again: nothing to do
    with daemon(tmp_path, config) as (url, env):  # the same state dir: it is restored
        assert (of(url, MODEL)["instance_id"], of(url, MODEL)["state"]) == (iid, "parked")
        assert runner_pids() == []
        said = exod("unpark", iid, "--url", url, env=env)
        assert said.stdout.strip() == f"{iid} unparking", said
        back = until(lambda: of(url, MODEL), lambda i: i["state"] == "ready")
        assert (back["residency"], back["attempts"]) == ("loaded", 0)
        assert "decodes 64 at once: kv_cache_mib 2048 holds" in exod("status", "--url", url, env=env).stdout
        missing = exod("park", "nope-000000", "--url", url, env=env, check=False)
        assert missing.returncode != 0 and "no instance 'nope-000000'" in missing.stderr


def test_ollama_keep_alive_zero_unloads_and_a_load_request_loads_again(tmp_path):
    config = f'[[place]]\nmodel = "{MODEL}"\nranks = 1\n'
    with daemon(tmp_path, config) as (url, _env):
        until(lambda: of(url, MODEL), lambda i: i["state"] == "ready")
        [listed] = httpx.get(f"{url}/api/ps", timeout=10).json()["models"]
        assert (listed["model"], listed["expires_at"]) == (MODEL, "0001-01-01T00:00:00Z")  # kept loaded
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": False}
        answered = httpx.post(f"{url}/api/chat", json=body | {"keep_alive": 0, "options": {"num_predict": 3}})
        assert answered.status_code == 200 and answered.json()["done"], answered.text
        until(runner_pids, lambda pids: pids == [])  # unloaded once that request ended
        assert httpx.get(f"{url}/api/ps", timeout=10).json()["models"] == []

        load = httpx.post(f"{url}/api/generate", json={"model": MODEL, "keep_alive": "5m"}, timeout=30)
        assert load.json()["done_reason"] == "load"
        until(lambda: of(url, MODEL), lambda i: i["state"] == "ready")
        [listed] = httpx.get(f"{url}/api/ps", timeout=10).json()["models"]
        expires = time.mktime(time.strptime(listed["expires_at"][:19], "%Y-%m-%dT%H:%M:%S")) - time.timezone
        assert 200 < expires - time.time() <= 300  # five minutes from the load
        unload = httpx.post(f"{url}/api/generate", json={"model": MODEL, "keep_alive": 0}, timeout=30)
        assert unload.json()["done_reason"] == "unload"
        until(runner_pids, lambda pids: pids == [])
        bad = httpx.post(f"{url}/api/chat", json=body | {"keep_alive": "soon"}, timeout=30)
        assert bad.status_code == 400 and "keep_alive" in bad.json()["error"]


def test_on_demand_two_models_take_turns_in_room_for_one_and_never_run_together(tmp_path):
    config = '[models]\non_demand = true\nkeep_alive = "10m"\n\n[limits]\nrunners_per_node = 1\nqueue_timeout = 3.0\n'
    with daemon(tmp_path, config) as (url, _env), MostRunners() as seen:
        assert instances(url) == []
        for model in (MODEL, OTHER, MODEL):  # placed, placed (evicting the first), unparked (evicting the second)
            served = chat(url, model)
            assert served.status_code == 200, served.text
        assert seen.most == 1, "two runners ran at once with room for one"
        mine, other = of(url, MODEL), of(url, OTHER)
        assert (mine["state"], mine["generation"], mine["attempts"]) == ("ready", 2, 0)
        assert (other["state"], other["residency"], other["ranks"]) == ("parked", "parked", 1)
        assert metric(url, 'exod_parks_total{reason="evicted"}') == 2
        # a client's made-up name, and a model that is not to be had, are not placed
        assert chat(url, "gpt-3.5-turbo").status_code == 404
        assert chat(url, "org/not-in-the-cache").status_code == 404

        # an instance kept forever is never evicted: what needs its room is refused (409), and a request for
        # a parked instance that cannot come back waits its queue timeout, then 503 with Retry-After
        httpx.delete(f"{url}/instances/{mine['instance_id']}", timeout=10)
        until(runner_pids, lambda pids: pids == [])
        kept = httpx.post(f"{url}/instances", json={"model": MODEL, "keep_alive": -1}, timeout=30)
        assert kept.status_code == 201, kept.text
        until(lambda: of(url, MODEL), lambda i: i["state"] == "ready")
        refused = httpx.post(f"{url}/instances", json={"model": MODEL}, timeout=30)
        assert refused.status_code == 409 and "runners_per_node" in refused.json()["error"]["message"]
        waited = chat(url, OTHER)
        assert waited.status_code == 503 and waited.headers["retry-after"], waited.text
        assert of(url, OTHER)["state"] == "parked" and of(url, MODEL)["state"] == "ready"
        assert seen.most == 1
    # the order behind it, from the daemon's transition log: no runner was created while another parked
    assert created_while_parking(tmp_path / "state" / "state.db") == []
    assert_log_conforms(tmp_path / "state" / "state.db")  # parks, evictions and unparks replay on the machines


def created_while_parking(db: Path) -> list[str]:
    """Runner creations logged while some instance was still Parking (its processes not yet all reaped)."""
    from exod.state.sqlite import Store

    store = Store.open(db)
    try:
        entries = [entry for _, entry in store.transitions()]
    finally:
        store.close()
    leaf: dict[str, str] = {}
    found = []
    for e in entries:
        if e.machine == "instance":
            leaf[e.key] = e.target
        elif e.machine == "runner" and e.event == "create" and "parking" in leaf.values():
            found.append(f"{e.key} created while {[k for k, v in leaf.items() if v == 'parking']} parked")
    assert any(e.event == "park" for e in entries), "nothing was parked: the check proves nothing"
    return found
