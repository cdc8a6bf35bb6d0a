"""DNS rebinding (issue #45), against a real `exod serve`: a request whose ``Host`` names something this daemon
is not reachable by is refused (421) before any route runs, so a web page that rebinds its own name to
127.0.0.1 can neither place, delete nor chat; the names it is reachable by, and those configured in
``[api] allowed_hosts``, are answered."""

from __future__ import annotations

import os
import signal
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from reliability_report import attack

from daemon_harness import start_daemon, wait_instance
from exod.host.tiny_model import make_tiny_model

pytestmark = pytest.mark.usefixtures("no_runner_left_behind")

MODEL = "exod/tiny-qwen2"
CONFIG = """
[daemon]
host = "127.0.0.1"
port = 0
offline = true
"""
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@contextmanager
def daemon(tmp: Path, config: str = CONFIG) -> Iterator[str]:
    """`exod serve` with ``config`` and the tiny model in its cache (nothing placed): its URL; SIGTERM ends it."""
    hf = tmp / "hf"
    make_tiny_model(MODEL, layers=2, hf_home=hf)
    (tmp / "exod.toml").write_text(config)
    process, url = start_daemon(tmp, {**os.environ, "HF_HOME": str(hf), "HF_HUB_OFFLINE": "1"}, "--no-place")
    try:
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0


def transitions(tmp: Path) -> int:
    with sqlite3.connect(tmp / "state" / "state.db") as db:
        return db.execute("SELECT count(*) FROM transitions").fetchone()[0]


def generated(url: str) -> float:
    """Completion tokens the daemon has generated since it started (its /metrics)."""
    lines = httpx.get(f"{url}/metrics", timeout=30).text.splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith("exod_tokens_generated_total"))


def test_a_rebinding_page_can_neither_place_delete_nor_chat_and_the_daemons_own_names_are_answered(tmp_path):
    with daemon(tmp_path) as url:
        port = urlsplit(url).port
        placed = httpx.post(f"{url}/instances", json={"model": MODEL, "ranks": 1}, timeout=30)
        assert placed.status_code == 201, placed.text
        iid = placed.json()["instance_id"]
        wait_instance(url, lambda i: i["state"] == "ready")
        before = transitions(tmp_path)

        # what a page of attacker.example sends once its name resolves to 127.0.0.1: the connection is ours,
        # the Host is its own
        rebound = {"Host": f"attacker.example:{port}", "Origin": f"http://attacker.example:{port}"}
        answers = {
            "place": httpx.post(f"{url}/instances", json={"model": MODEL, "ranks": 1}, headers=rebound, timeout=30),
            "chat": httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers=rebound, timeout=30),
            "ollama chat": httpx.post(f"{url}/api/chat", json=CHAT | {"stream": False}, headers=rebound, timeout=30),
            "delete": httpx.delete(f"{url}/instances/{iid}", headers=rebound, timeout=30),
            "list": httpx.get(f"{url}/instances", headers=rebound, timeout=30),
            "head": httpx.head(f"{url}/instances", headers=rebound, timeout=30),
            "health": httpx.get(f"{url}/health", headers=rebound, timeout=30),
            "dashboard": httpx.get(f"{url}/", headers=rebound, timeout=30),
            "preflight": httpx.options(
                f"{url}/instances", headers=rebound | {"Access-Control-Request-Method": "POST"}, timeout=30
            ),
            "rebound without a port": httpx.post(
                f"{url}/instances", json={"model": MODEL}, headers={"Host": "attacker.example"}, timeout=30
            ),
            "a loopback-looking name": httpx.get(f"{url}/instances", headers={"Host": "127.0.0.1.nip.io"}, timeout=30),
        }
        with httpx.Client(http1=False, http2=True, timeout=30) as h2:  # the name as HTTP/2's :authority
            answers["HTTP/2 place"] = h2.post(f"{url}/instances", json={"model": MODEL}, headers=rebound)
            assert answers["HTTP/2 place"].http_version == "HTTP/2"
            good_h2 = h2.get(f"{url}/instances")
        assert {k: r.status_code for k, r in answers.items()} == dict.fromkeys(answers, 421)
        said = answers["place"].json()["error"]
        assert said["code"] == "misdirected_request" and "'attacker.example'" in said["message"]
        assert "[api] allowed_hosts" in said["message"] and "DNS rebinding" in said["message"]
        assert "[api] allowed_hosts" in answers["ollama chat"].json()["error"]  # in each dialect's own shape
        assert answers["place"].headers["connection"] == "close"  # its body unread: HTTP/1.1's connection ends

        # nothing placed, nothing deleted, nothing generated: the state as a good Host sees it
        after = httpx.get(f"{url}/instances", timeout=30).json()["instances"]
        assert [(i["instance_id"], i["state"]) for i in after] == [(iid, "ready")]
        added = transitions(tmp_path) - before
        assert added == 0 and generated(url) == 0

        # the names it is reachable by: its address (with or without the port), localhost, any address written out
        good = {
            "its url": httpx.get(f"{url}/instances", timeout=30),
            "localhost": httpx.get(f"{url}/instances", headers={"Host": f"localhost:{port}"}, timeout=30),
            "LOCALHOST.": httpx.get(f"{url}/instances", headers={"Host": "LOCALHOST."}, timeout=30),
            "no port": httpx.get(f"{url}/instances", headers={"Host": "127.0.0.1"}, timeout=30),
            "[::1]": httpx.get(f"{url}/instances", headers={"Host": f"[::1]:{port}"}, timeout=30),
            "another port (forwarded)": httpx.get(f"{url}/instances", headers={"Host": "127.0.0.1:9"}, timeout=30),
            "dashboard": httpx.get(f"{url}/", headers={"Host": f"localhost:{port}"}, timeout=30),
        }
        assert {k: r.status_code for k, r in good.items()} == dict.fromkeys(good, 200)
        assert good_h2.status_code == 200 and good_h2.http_version == "HTTP/2"
        chat = httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers={"Host": f"localhost:{port}"}, timeout=60)
        assert chat.status_code == 200, chat.text
        assert generated(url) > 0  # what a chat that ran leaves in /metrics, and the refused ones did not
        deleted = httpx.delete(f"{url}/instances/{iid}", headers={"Host": f"localhost:{port}"}, timeout=30)
        assert deleted.status_code == 200, deleted.text
    attack(
        "DNS rebinding",
        "Host attacker.example:PORT (a page's name rebound to 127.0.0.1): POST /instances, chat (OpenAI and "
        f"Ollama), DELETE, GET, HEAD, /health, the dashboard, a CORS preflight and HTTP/2 all 421 before any route "
        f"({said['message'][:60]}…); {len(after)} instance, still ready, {added} "
        "transitions and 0 tokens generated by them; 127.0.0.1, localhost and [::1] answered (200), the "
        "chat and the delete too",
    )


def test_names_configured_in_allowed_hosts_are_answered_and_others_still_refused(tmp_path):
    """``[api] allowed_hosts`` as the file gives it, on a real `exod serve`: its names answered (any case, with or
    without a port or a trailing dot), others refused."""
    config = CONFIG + '\n[api]\nallowed_hosts = ["exod.example.lan", "Gpu-Box"]\n'
    hosts = ("exod.example.lan:8420", "gpu-box", "GPU-BOX.", "attacker.example", "evil.exod.example.lan")
    with daemon(tmp_path, config) as url:
        codes = {host: httpx.get(f"{url}/instances", headers={"Host": host}, timeout=30).status_code for host in hosts}
    assert codes == {
        "exod.example.lan:8420": 200,
        "gpu-box": 200,
        "GPU-BOX.": 200,
        "attacker.example": 421,
        "evil.exod.example.lan": 421,  # a name of its own each: no wildcard below a configured name
    }
