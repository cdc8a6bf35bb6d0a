"""Every duration has a ceiling (issue #45): in the configuration file and per request, a value past it is refused
with the ceiling named, and a duration with a unit written twice (``"5m5m"``) is malformed; Ollama's
``/api/ps`` never answers 500, whatever keep-alive is stored. The ceilings: `exod.config` (README,
"Durations")."""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

import attrs
import httpx
import pytest
from reliability_report import attack

from daemon_harness import start_daemon, wait_instance
from exod.config import ConfigError, keep_alive, load
from exod.host.supervisor import Timeouts
from exod.host.tiny_model import make_tiny_model

DAY = "must be at most 1 day (86400 s)"
WEEK = "must be at most 7 days (604800 s)"
TEN_YEARS = 315_360_000  # seconds

# every duration of the file: (section, key) -> (its ceiling, in the key's unit; what the error says)
DURATIONS: dict[tuple[str, str], tuple[float, str]] = {
    **{("timeouts", f.name): (86400, DAY) for f in attrs.fields(Timeouts)},
    ("retry", "initial"): (86400, DAY),
    ("retry", "cap"): (86400, DAY),
    ("retry", "reset_after"): (604800, WEEK),
    **{
        ("limits", key): (86400, DAY)
        for key in ("queue_timeout", "read_timeout", "send_timeout", "keep_alive_timeout", "drain_timeout")
    },
    ("retention", "max_log_age_days"): (3650, "must be at most 10 years (3650 days)"),
    ("cluster", "forward_idle"): (86400, DAY),
}
CLUSTER = 'url = "http://127.0.0.1:2379"\nnode_id = "n"\nadvertise = "127.0.0.1"\n'  # what [cluster] needs


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "exod.toml"
    path.write_text(text)
    return path


# -- the configuration file ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("section", "key"), sorted(DURATIONS))
def test_every_duration_of_the_file_has_a_ceiling_said_in_the_error(tmp_path, section, key):
    most, said = DURATIONS[section, key]
    extra = {("retry", "cap"): "initial = 1.0\n", ("retry", "initial"): "cap = 86400.0\n"}.get((section, key), "")
    needed = CLUSTER if section == "cluster" else ""
    assert load(write(tmp_path, f"[{section}]\n{needed}{extra}{key} = {float(most)}\n"))  # the ceiling itself is fine
    for beyond in (most + 1, 1e308):
        with pytest.raises(ConfigError, match=re.escape(f"[{section}] {key}: {said}, got {beyond!r}")):
            load(write(tmp_path, f"[{section}]\n{needed}{key} = {beyond!r}\n"))


def test_no_number_of_the_file_goes_unbounded_unnoticed(tmp_path):
    """A number of seconds (or days) added to the file without a ceiling fails here: every float the schema
    takes is one of `DURATIONS`, or a factor with a ceiling of its own."""
    from exod.config import _File

    floats = set()
    for section, field in _File.model_fields.items():
        model = field.annotation.__args__[0] if hasattr(field.annotation, "__args__") else field.annotation
        for key, inner in getattr(model, "model_fields", {}).items():
            if inner.annotation is float or "float" in str(inner.annotation):
                floats.add((section, key))
    keep_alives = {("models", "keep_alive"), ("place", "keep_alive")}  # `keep_alive`, tested below
    assert floats - keep_alives - {("retry", "factor")} == set(DURATIONS)
    with pytest.raises(ConfigError, match=re.escape("[retry] factor: input should be less than or equal to 100")):
        load(write(tmp_path, "[retry]\nfactor = 1e308\n"))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[timeouts]\nstop_grace = 1e308\n", f"[timeouts] stop_grace: {DAY}, got 1e+308"),
        ('[timeouts]\nstop_grace = "5m5m"\n', "[timeouts] stop_grace: input should be a valid number, got '5m5m'"),
        ('[models]\nkeep_alive = "5m5m"\n', "[models] keep_alive must be seconds or a duration such as '5m'"),
        (
            '[models]\nkeep_alive = "99999999999999999h"\n',
            f"[models] keep_alive must be at most 10 years ({TEN_YEARS} s)",
        ),
        (
            '[[place]]\nmodel = "a/b"\nkeep_alive = 1e18\n',
            f"[[place]] keep_alive must be at most 10 years ({TEN_YEARS} s)",
        ),
    ],
)
def test_the_attacks_values_in_the_file_are_refused_naming_the_key_and_the_ceiling(tmp_path, text, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load(write(tmp_path, text))


# -- keep_alive: Ollama's durations, per request and in the file -----------------------------------------------


@pytest.mark.parametrize(
    "given", [1e18, "99999999999999999h", "1e400", float("inf"), "inf", TEN_YEARS + 1, "87601h", "5256001m"]
)
def test_a_keep_alive_beyond_ten_years_is_refused_saying_so(given):
    with pytest.raises(ValueError, match=re.escape(f"keep_alive must be at most 10 years ({TEN_YEARS} s), got ")):
        keep_alive(given)


@pytest.mark.parametrize("given", ["5m5m", "1h1h", "30m1h", "5s1m", "1ms1s", "1h5m5m", "h", "5m-5m"])
def test_a_duration_with_a_unit_repeated_or_out_of_order_is_malformed(given):
    with pytest.raises(ValueError, match="each unit at most once, largest first"):
        keep_alive(given)


@pytest.mark.parametrize(
    ("given", "seconds"),
    [(TEN_YEARS, float(TEN_YEARS)), ("87600h", float(TEN_YEARS)), ("1h2m3s4ms", 3723.004), (-1e18, None)],
)
def test_up_to_the_ceiling_and_forever_are_taken(given, seconds):
    assert keep_alive(given) == seconds


# -- a real daemon: Ollama's per-request keep_alive, POST /instances, /api/ps ---------------------------------

MODEL = "exod/tiny-qwen2"
CONFIG = """
[daemon]
host = "127.0.0.1"
port = 0
offline = true
"""


@contextmanager
def daemon(tmp: Path) -> Iterator[str]:
    """`exod serve` with the tiny model in its cache and the state of ``tmp`` (nothing placed by the file)."""
    hf = tmp / "hf"
    if not hf.exists():
        make_tiny_model(MODEL, layers=2, hf_home=hf)
    (tmp / "exod.toml").write_text(CONFIG)
    process, url = start_daemon(tmp, {**os.environ, "HF_HOME": str(hf), "HF_HUB_OFFLINE": "1"})
    try:
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0


def models_in_memory(url: str) -> list[dict]:
    answer = httpx.get(f"{url}/api/ps", timeout=30)
    assert answer.status_code == 200, answer.text
    return answer.json()["models"]


def expires(listed: dict) -> float:
    return datetime.fromisoformat(listed["expires_at"].replace("Z", "+00:00")).timestamp()


@pytest.mark.usefixtures("no_runner_left_behind")
def test_ollama_keep_alives_past_the_ceiling_are_400_and_api_ps_never_500_whatever_is_stored(tmp_path):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": False}
    chat |= {"options": {"num_predict": 2}}
    with daemon(tmp_path) as url:
        placed = httpx.post(f"{url}/instances", json={"model": MODEL, "keep_alive": "5m"}, timeout=30)
        assert placed.status_code == 201, placed.text
        wait_instance(url, lambda i: i["state"] == "ready")
        asked = {
            "chat 1e18": httpx.post(f"{url}/api/chat", json=chat | {"keep_alive": 1e18}, timeout=30),
            "chat 99999999999999999h": httpx.post(
                f"{url}/api/chat", json=chat | {"keep_alive": "99999999999999999h"}, timeout=30
            ),
            "chat 5m5m": httpx.post(f"{url}/api/chat", json=chat | {"keep_alive": "5m5m"}, timeout=30),
            "load 1e18": httpx.post(f"{url}/api/generate", json={"model": MODEL, "keep_alive": 1e18}, timeout=30),
            "a 400-digit number": httpx.post(
                f"{url}/api/generate",
                content=f'{{"model": "{MODEL}", "keep_alive": 1{"0" * 400}}}',
                headers={"content-type": "application/json"},
                timeout=30,
            ),
        }
        assert {k: r.status_code for k, r in asked.items()} == dict.fromkeys(asked, 400), {
            k: r.text for k, r in asked.items()
        }
        said = asked["chat 1e18"].json()["error"]
        assert said == f"keep_alive must be at most 10 years ({TEN_YEARS} s), got 1e+18"
        assert "each unit at most once" in asked["chat 5m5m"].json()["error"]
        another = httpx.post(f"{url}/instances", json={"model": MODEL, "keep_alive": 1e18}, timeout=30)
        assert another.status_code == 400 and "at most 10 years" in another.json()["error"]["message"]

        [listed] = models_in_memory(url)  # the refused requests changed nothing: still its own 5 minutes
        [instance] = httpx.get(f"{url}/instances", timeout=30).json()["instances"]
        assert instance["keep_alive"] == 300.0
        assert 0 < expires(listed) - time.time() <= 300

        longest = httpx.post(f"{url}/api/chat", json=chat | {"keep_alive": TEN_YEARS}, timeout=60)
        assert longest.status_code == 200, longest.text
        [listed] = models_in_memory(url)
        assert TEN_YEARS - 120 < expires(listed) - time.time() <= TEN_YEARS  # ten years on, about 2036

    # what an earlier version could store: a keep-alive of 1e18 s, written into the state as it would have been
    with sqlite3.connect(tmp_path / "state" / "state.db") as db:
        body = json.loads(db.execute("SELECT body FROM snapshot").fetchone()[0])
        stored = _set_keep_alive(body, 1e18)
        db.execute("UPDATE snapshot SET body = ?", (json.dumps(body),))
    assert stored == 1
    with daemon(tmp_path) as url:
        wait_instance(url, lambda i: i["state"] == "ready" and i["residency"] == "loaded")
        [restored] = httpx.get(f"{url}/instances", timeout=30).json()["instances"]
        assert restored["keep_alive"] == 1e18
        codes = [httpx.get(f"{url}/api/ps", timeout=30).status_code for _ in range(3)]
        [listed] = models_in_memory(url)
    assert codes == [200, 200, 200]
    assert listed["expires_at"] == "9999-12-31T23:59:59Z"  # the latest date there is, never a 500
    attack(
        "unbounded durations",
        f"Ollama keep_alive 1e18, '99999999999999999h', '5m5m' and a 400-digit number per request, and 1e18 "
        f"to POST /instances: 400 ({said!r}), the instance's own 300 s kept; stop_grace = 1e308 in the file: "
        f"'[timeouts] stop_grace: {DAY}'; '5m5m' refused as malformed; {len(DURATIONS)} durations of the file "
        f"bounded; /api/ps with a keep-alive of 1e18 s stored: {codes}, expires_at {listed['expires_at']}",
    )


def _set_keep_alive(value: object, seconds: float) -> int:
    """Every instance's keep-alive in a snapshot set to ``seconds``; how many were set."""
    if isinstance(value, list):
        return sum(_set_keep_alive(v, seconds) for v in value)
    if not isinstance(value, dict):
        return 0
    count = 0
    if "model_id" in value and "keep_alive" in value:
        value["keep_alive"] = seconds
        value.pop("keep_alive_now", None)  # the one in force: its own
        count = 1
    return count + sum(_set_keep_alive(v, seconds) for v in value.values())
