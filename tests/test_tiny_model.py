"""The deterministic tiny model, model-id validation, offline resolution and the ``exod model`` CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from exod.cli import main
from exod.host.models import (
    CachedModel,
    InvalidModelId,
    ModelNotFound,
    list_cached_models,
    resolve_local_dir,
    resolve_model,
    validate_model_id,
)
from exod.host.tiny_model import InvalidTinyModelArgs, make_tiny_model


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One qwen2 and one llama in a shared cache; made once because several tests only read them."""
    home = tmp_path_factory.mktemp("hf")
    return {
        "home": home,
        "qwen2": make_tiny_model("exod/tiny-qwen2", arch="qwen2", hf_home=home),
        "llama": make_tiny_model("exod/tiny-llama", arch="llama", hf_home=home),
    }


# --- determinism and layout -------------------------------------------------------------------------------


def test_same_arguments_give_identical_bytes_and_revision(tmp_path: Path) -> None:
    a = make_tiny_model(hf_home=tmp_path / "a")
    b = make_tiny_model(hf_home=tmp_path / "b")
    assert a.name == b.name
    assert _tree(tmp_path / "a") == _tree(tmp_path / "b")
    # Making it again in place is idempotent.
    assert make_tiny_model(hf_home=tmp_path / "a") == a
    assert _tree(tmp_path / "a") == _tree(tmp_path / "b")


def test_other_process_with_other_hash_seed_gives_identical_bytes(tmp_path: Path) -> None:
    here = make_tiny_model("exod/tiny-llama", arch="llama", seed=3, hf_home=tmp_path / "here")
    code = (
        "import sys; from pathlib import Path; from exod.host.tiny_model import make_tiny_model; "
        "print(make_tiny_model('exod/tiny-llama', arch='llama', seed=3, hf_home=Path(sys.argv[1])))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345", "RAYON_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "there")], env=env, capture_output=True, text=True, check=True
    )
    there = Path(out.stdout.strip())
    assert there.name == here.name
    assert _tree(there) == _tree(here)


def test_different_arguments_give_a_different_revision(tmp_path: Path) -> None:
    a = make_tiny_model(hf_home=tmp_path, seed=0)
    b = make_tiny_model(hf_home=tmp_path, seed=1)
    c = make_tiny_model(hf_home=tmp_path, layers=3)
    assert len({a.name, b.name, c.name}) == 3


def test_hf_cache_layout(models: dict[str, Path]) -> None:
    snap = models["qwen2"]
    repo_dir = models["home"] / "hub" / "models--exod--tiny-qwen2"
    assert snap.parent == repo_dir / "snapshots"
    ref = (repo_dir / "refs" / "main").read_bytes()
    assert ref == snap.name.encode()
    assert len(ref) == 40
    assert all(c in b"0123456789abcdef" for c in ref)
    names = {p.name for p in snap.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
    } <= names
    assert not [n for n in names if n.endswith(".tmp")]


def test_index_lists_every_tensor(models: dict[str, Path]) -> None:
    from safetensors import safe_open

    for arch in ("qwen2", "llama"):
        snap = models[arch]
        index = json.loads((snap / "model.safetensors.index.json").read_text())
        with safe_open(str(snap / "model.safetensors"), framework="numpy") as f:
            keys = set(f.keys())
            total = sum(f.get_tensor(k).nbytes for k in keys)
        assert set(index["weight_map"]) == keys
        assert set(index["weight_map"].values()) == {"model.safetensors"}
        assert index["metadata"]["total_size"] == total
        # every layer appears: sharded_load matches layers by index to pick each pipeline stage's files
        config = json.loads((snap / "config.json").read_text())
        for layer in range(config["num_hidden_layers"]):
            assert any(f"layers.{layer}." in k for k in keys)


# --- loading and generating with mlx-lm -------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_mlx_lm_loads_and_generates_greedily(models: dict[str, Path], arch: str) -> None:
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(models[arch]))
    prompt = tokenizer.encode("The quick brown fox")
    tokens = [r.token for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=8)]
    assert 1 <= len(tokens) <= 8
    config = json.loads((models[arch] / "config.json").read_text())
    assert all(0 <= t < config["vocab_size"] for t in tokens)
    # greedy: the same prompt gives the same text
    assert mlx_lm.generate(model, tokenizer, prompt, max_tokens=8) == mlx_lm.generate(
        model, tokenizer, prompt, max_tokens=8
    )


def test_chat_template_applies_and_eos_is_the_turn_end(models: dict[str, Path]) -> None:
    import mlx_lm

    _, tokenizer = mlx_lm.load(str(models["qwen2"]))
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi there"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi there"}], add_generation_prompt=True)
    assert tokenizer.decode(ids) == text
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.eos_token_ids == {eos}
    assert ids.count(eos) == 1


# --- argument validation ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"arch": "gpt2"}, "qwen2, llama"),
        ({"hidden": 30}, "divisible by heads"),
        ({"heads": 4, "kv_heads": 3}, "multiple of kv_heads"),
        ({"layers": 0}, "layers must be a positive integer"),
        ({"vocab_size": 100}, "at least 259"),
        ({"seed": -1}, "seed"),
    ],
)
def test_bad_arguments_raise_a_helpful_value_error(tmp_path: Path, kwargs: dict, match: str) -> None:
    with pytest.raises(InvalidTinyModelArgs, match=match):
        make_tiny_model(hf_home=tmp_path, **kwargs)
    assert not (tmp_path / "hub").exists()


@pytest.mark.parametrize("bad", ["../x", "/abs", "a/b/c", "a\\b", "", "a/", "/a", "a/..", "x/a b", "org/na:me"])
def test_invalid_model_ids(bad: str) -> None:
    with pytest.raises(InvalidModelId, match="org/name"):
        validate_model_id(bad)
    with pytest.raises(InvalidModelId):
        resolve_model(bad, offline=True)
    assert issubclass(InvalidModelId, ValueError)


def test_valid_model_ids() -> None:
    for good in ("exod/tiny-qwen2", "Qwen/Qwen2.5-0.5B-Instruct", "a_b/c.d-e"):
        assert validate_model_id(good) == good


def test_make_tiny_rejects_an_invalid_repo_id(tmp_path: Path) -> None:
    with pytest.raises(InvalidModelId):
        make_tiny_model("../evil", hf_home=tmp_path)


# --- resolution -------------------------------------------------------------------------------------------


def test_resolve_model_offline_finds_the_cached_snapshot(models: dict[str, Path]) -> None:
    assert resolve_model("exod/tiny-qwen2", hf_home=models["home"], offline=True) == models["qwen2"]


def test_resolve_model_honours_hf_hub_offline_in_a_fresh_process(models: dict[str, Path]) -> None:
    code = "from exod.host.models import resolve_model; print(resolve_model('exod/tiny-llama'))"
    env = {**os.environ, "HF_HOME": str(models["home"]), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert Path(out.stdout.strip()) == models["llama"]


def test_unknown_model_offline_fails_with_a_hint(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFound, match="exod model make-tiny") as info:
        resolve_model("nobody/nothing", hf_home=tmp_path, offline=True)
    assert "neither cached" in str(info.value)


def test_unknown_model_online_fails_fast_without_a_hub(tmp_path: Path) -> None:
    # No machine here reaches the hub: the call must end with ModelNotFound, never hang.
    timeout = 10.0
    start = time.monotonic()
    with pytest.raises(ModelNotFound, match="exod model make-tiny"):
        resolve_model("nobody/nothing", hf_home=tmp_path, offline=False, timeout=timeout)
    assert time.monotonic() - start < timeout + 1.0


def test_a_hub_that_never_answers_is_cut_off_at_the_timeout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    release = threading.Event()

    def hang(*args: object, **kwargs: object) -> str:
        release.wait(30)
        return "/nowhere"

    monkeypatch.setattr(huggingface_hub, "snapshot_download", hang)
    start = time.monotonic()
    try:
        with pytest.raises(ModelNotFound, match=r"sent nothing for 0\.3 s"):
            resolve_model("nobody/nothing", hf_home=tmp_path, offline=False, timeout=0.3)
    finally:
        release.set()
    assert time.monotonic() - start < 5


def test_a_slow_download_that_keeps_moving_is_not_cut_off_and_reports_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The timeout is a stall limit: 1 s of download with a byte every 0.1 s passes a 0.3 s timeout."""
    import huggingface_hub

    def trickle(*args: object, tqdm_class: type, **kwargs: object) -> str:
        bar = tqdm_class(total=0, initial=0, unit="B", desc="Reconstructing (incomplete total...)", name="x")
        files = tqdm_class(total=2, desc="Fetching 2 files")  # the file-count bar is not bytes
        bar.total = 1000
        for _ in range(10):
            time.sleep(0.1)
            bar.update(100)
            files.update(0)
        bar.close()
        files.close()
        return str(tmp_path)

    seen: list[tuple[int, int | None]] = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download", trickle)
    path = resolve_model(
        "org/slow", hf_home=tmp_path, offline=False, timeout=0.3, progress=lambda d, t: seen.append((d, t))
    )
    assert path == tmp_path
    assert seen[0] == (100, 1000) and seen[-1] == (1000, 1000) and len(seen) == 10


def test_resolve_local_dir(models: dict[str, Path], tmp_path: Path) -> None:
    assert resolve_local_dir(models["qwen2"]) == models["qwen2"].resolve()
    with pytest.raises(ModelNotFound, match="does not exist"):
        resolve_local_dir(tmp_path / "missing")
    with pytest.raises(ModelNotFound, match=r"config\.json"):
        resolve_local_dir(tmp_path)


def test_list_cached_models(models: dict[str, Path], tmp_path: Path) -> None:
    listed = {m.repo_id: m for m in list_cached_models(models["home"])}
    assert set(listed) >= {"exod/tiny-qwen2", "exod/tiny-llama"}
    qwen = listed["exod/tiny-qwen2"]
    assert isinstance(qwen, CachedModel)
    assert qwen.revision == models["qwen2"].name
    assert qwen.path == models["qwen2"]
    assert qwen.size_bytes == sum(len(b) for b in _tree(models["qwen2"]).values())
    assert list_cached_models(tmp_path / "empty") == []


# --- CLI --------------------------------------------------------------------------------------------------


def test_cli_make_tiny_then_list(tmp_path: Path) -> None:
    runner = CliRunner()
    made = runner.invoke(
        main, ["model", "make-tiny", "--arch", "llama", "--repo-id", "t/llama", "--hf-home", str(tmp_path)]
    )
    assert made.exit_code == 0, made.output
    path = Path(made.output.strip())
    assert path == make_tiny_model("t/llama", arch="llama", hf_home=tmp_path)
    assert (path / "config.json").is_file()

    listed = runner.invoke(main, ["model", "list", "--hf-home", str(tmp_path)])
    assert listed.exit_code == 0, listed.output
    header, row = listed.output.strip().splitlines()
    assert header.split()[:2] == ["REPO", "REVISION"]
    assert row.split()[0] == "t/llama"
    assert path.name.startswith(row.split()[1])
    assert row.endswith(str(path))


def test_cli_make_tiny_reports_bad_arguments(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["model", "make-tiny", "--hidden", "30", "--hf-home", str(tmp_path)])
    assert result.exit_code == 2
    assert "divisible by heads" in result.output


def test_cli_model_list_on_an_empty_cache(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["model", "list", "--hf-home", str(tmp_path)])
    assert result.exit_code == 0
    assert "exod model make-tiny" in result.output


def test_sharded_load_pipeline_for_qwen2_tensor_for_both(models: dict[str, Path]) -> None:
    """A one-process group: enough to prove the files suit mlx_lm's sharded loader (index, layer names)."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.utils import sharded_load

    group = mx.distributed.init()  # no hostfile: a singleton group
    model, tokenizer = sharded_load(str(models["qwen2"]), pipeline_group=group)
    assert mlx_lm.generate(model, tokenizer, "hi", max_tokens=2) is not None
    for arch in ("qwen2", "llama"):
        sharded_load(str(models[arch]), tensor_group=group)
    with pytest.raises(ValueError, match="does not support pipelining"):
        sharded_load(str(models["llama"]), pipeline_group=group)


def test_cli_pull_resolves_from_the_cache_and_fails_fast_with_the_cause(
    models: dict[str, Path], tmp_path: Path
) -> None:
    hf_home = models["home"]
    ok = CliRunner().invoke(main, ["model", "pull", "exod/tiny-qwen2", "--hf-home", str(hf_home), "--offline"])
    assert ok.exit_code == 0, ok.output
    assert ok.output.strip() == str(models["qwen2"])
    missing = CliRunner().invoke(main, ["model", "pull", "exod/absent", "--hf-home", str(tmp_path), "--offline"])
    assert missing.exit_code == 1
    assert "neither cached" in missing.output and "exod model make-tiny" in missing.output
