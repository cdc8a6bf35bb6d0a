"""Admission under a flood, with a real `exod serve`: no local client can make the daemon start more than
the limits allow, a refusal stores nothing, and a restart restores what was admitted, nothing more."""

from __future__ import annotations

import os
import signal
import sqlite3

import httpx
import pytest
from reliability_report import attack

from daemon_harness import runner_pids, start_daemon
from exod.host.tiny_model import make_tiny_model

pytestmark = pytest.mark.usefixtures("no_runner_left_behind")

CONFIG = """
[daemon]
host = "127.0.0.1"
port = 0
offline = true

[limits]
runners_per_node = 3
ranks_per_instance = 4
instances_per_model = 2
"""


@pytest.fixture
def env(tmp_path):
    hf = tmp_path / "hf"
    make_tiny_model("exod/tiny-qwen2", layers=2, hf_home=hf)  # a pipeline of 2 layers: at most 2 ranks
    (tmp_path / "exod.toml").write_text(CONFIG)
    return {**os.environ, "HF_HOME": str(hf), "HF_HUB_OFFLINE": "1"}


def transitions(tmp_path) -> int:
    with sqlite3.connect(tmp_path / "state" / "state.db") as db:
        return db.execute("SELECT count(*) FROM transitions").fetchone()[0]


def place(url: str, model: str, ranks: int) -> httpx.Response:
    return httpx.post(f"{url}/instances", json={"model": model, "ranks": ranks}, timeout=30)


def test_a_flood_of_placements_is_held_to_the_limits_and_a_restart_multiplies_nothing(tmp_path, env):
    daemon, url = start_daemon(tmp_path, env)
    try:
        before = transitions(tmp_path)
        refused = {
            "unknown": place(url, "exod/zz", 1),
            "too many ranks for the model": place(url, "exod/tiny-qwen2", 3),
            "too many ranks for the limit": place(url, "exod/tiny-qwen2", 64),
            "pinned to no such node": httpx.post(
                f"{url}/instances", json={"model": "exod/tiny-qwen2", "ranks": 1, "nodes": ["mac-z"]}, timeout=30
            ),
        }
        assert {k: r.status_code for k, r in refused.items()} == {
            "unknown": 404,
            "too many ranks for the model": 422,
            "too many ranks for the limit": 422,
            "pinned to no such node": 400,
        }
        errors = {k: r.json()["error"] for k, r in refused.items()}
        assert errors["unknown"]["code"] == "unknown_model" and "offline" in errors["unknown"]["message"]
        assert "its 2 layers" in errors["too many ranks for the model"]["message"]
        # every bound exceeded is named, the tightest first: the layers, then 3 runners on this one node (issue
        # #25), then ranks_per_instance = 4 (issue #45)
        assert errors["too many ranks for the limit"]["message"] == (
            "64 ranks is more than model 'exod/tiny-qwen2' (its 2 layers), the 3 runners 1 node(s) may run "
            "(runners_per_node = 3) and ranks_per_instance = 4 allow; ask for at most 2"
        )
        assert "mac-z not among the live nodes (local)" in errors["pinned to no such node"]["message"]
        assert transitions(tmp_path) == before  # nothing stored on a refusal
        assert httpx.get(f"{url}/instances", timeout=10).json()["instances"] == []

        flood = [place(url, "exod/tiny-qwen2", 1) for _ in range(30)]
        codes = [r.status_code for r in flood]
        assert codes[:2] == [201, 201] and set(codes[2:]) == {409}
        assert "instances_per_model = 2" in flood[2].json()["error"]["message"]
        admitted = sorted(r.json()["instance_id"] for r in flood[:2])
        assert place(url, "exod/tiny-qwen2", 2).status_code == 409  # 2 + 2 runners > runners_per_node = 3

        statuses = httpx.get(f"{url}/instances", timeout=10).json()["instances"]
        assert sorted(i["instance_id"] for i in statuses) == admitted
        assert len(runner_pids()) <= 2
    finally:
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=60) == 0

    daemon, url = start_daemon(tmp_path, env)
    try:
        restored = httpx.get(f"{url}/instances", timeout=10).json()["instances"]
        assert sorted(i["instance_id"] for i in restored) == admitted  # restored as admitted, nothing added
        assert len(runner_pids()) <= 2
        assert place(url, "exod/tiny-qwen2", 1).status_code == 409  # the restored ones still count
        runners = len(runner_pids())
    finally:
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=60) == 0
    attack(
        "admission flood",
        f"30 placements of 1 rank: {codes.count(201)} admitted, {codes.count(409)} refused 409 (instances_per_model "
        "= 2); an unknown model 404, 3 ranks of a 2-layer model and 64 ranks 422, nothing stored for them; "
        f"at most 2 runner processes; after a restart {len(restored)} instances, {runners} runners",
    )


def test_the_422_for_too_many_ranks_names_the_limit_that_binds(tmp_path, env):
    """Issue #45: 5 ranks of a 2-layer model under ranks_per_instance = 3 named ranks_per_instance alone, while
    the layers bind: raising it could never help. Now the layers are named first, with what can be asked for."""
    (tmp_path / "exod.toml").write_text(
        CONFIG.replace("runners_per_node = 3", "runners_per_node = 8").replace(
            "ranks_per_instance = 4", "ranks_per_instance = 3"
        )
    )
    daemon, url = start_daemon(tmp_path, env)
    try:
        before = transitions(tmp_path)
        answers = {ranks: place(url, "exod/tiny-qwen2", ranks) for ranks in (5, 3)}
        assert transitions(tmp_path) == before and httpx.get(f"{url}/instances", timeout=10).json()["instances"] == []
    finally:
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=60) == 0
    errors = {ranks: r.json()["error"] for ranks, r in answers.items()}
    assert {ranks: r.status_code for ranks, r in answers.items()} == {5: 422, 3: 422}
    assert errors[5]["code"] == "too_many_ranks" and errors[5]["param"] == "ranks"
    assert errors[5]["message"] == (  # both exceeded: the layers bind, and no setting to raise is suggested
        "5 ranks is more than model 'exod/tiny-qwen2' (its 2 layers) and ranks_per_instance = 3 allow; "
        "ask for at most 2"
    )
    assert errors[3]["message"] == "model 'exod/tiny-qwen2' cannot be split into 3 ranks (its 2 layers); at most 2"
    assert "ranks_per_instance" not in errors[3]["message"]  # 3 is within it: the layers alone bind
    attack(
        "ranks beyond the layers",
        f"ranks = 5 on a 2-layer model under ranks_per_instance = 3: 422 {errors[5]['message']!r}; ranks = 3 (within "
        f"the limit): {errors[3]['message']!r}; nothing stored",
    )


def test_a_configuration_asking_for_what_admission_refuses_does_not_start(tmp_path, env):
    (tmp_path / "exod.toml").write_text(CONFIG + '\n[[place]]\nmodel = "exod/tiny-qwen2"\nranks = 3\n')
    log = tmp_path / "serve.log"
    with pytest.raises(AssertionError, match="cannot place what the configuration asks"):
        start_daemon(tmp_path, env)
    assert "Traceback" not in log.read_text()
    assert runner_pids() == []


# -- what admission knows of a model: read from its files ----------------------------------------------


def test_facts_are_read_from_the_model_files(tmp_path):
    import fsm
    from exod.host.models import ModelFiles, read_facts

    hf = tmp_path / "hf"
    qwen = make_tiny_model("exod/tiny-qwen2", layers=3, heads=4, kv_heads=2, hf_home=hf)
    llama = make_tiny_model("exod/tiny-llama", arch="llama", layers=2, heads=4, kv_heads=4, hf_home=hf)
    weights = sum(f.stat().st_size for f in qwen.glob("*.safetensors"))
    assert read_facts(qwen) == fsm.ModelFacts(
        layers=3, attention_heads=4, kv_heads=2, pipeline=True, weight_bytes=weights
    )
    assert read_facts(llama).pipeline is False  # mlx-lm has no pipeline for llama: tensor parallel
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text('{"num_hidden_layers": "two"}')
    assert read_facts(tmp_path / "broken") is None  # unreadable: the limits alone are checked

    offline = ModelFiles(hf_home=hf, offline=True)
    assert offline.facts("exod/tiny-qwen2") == read_facts(qwen)
    unknown = offline.facts("exod/nowhere")
    assert isinstance(unknown, fsm.UnknownModel) and "offline" in unknown.reason
    assert ModelFiles(hf_home=hf, offline=False).facts("exod/nowhere") is None  # fetchable, facts unknown
