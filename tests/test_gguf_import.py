"""Importing GGUF files: the model and tokenizer they were written from, the formats kept, refused and damaged.

No GGUF can be downloaded here, so `gguf_files` writes them from the tiny models as llama.cpp's converter would
(its tensor names, metadata, tensor types, and a llama's permuted Q and K), and the tests compare what the
import makes with the directory the file was written from.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon_harness import runner_pids, start_daemon
from exod.cli import main
from exod.host.gguf_import import (
    CorruptGGUF,
    GGUFImportError,
    UnsupportedGGUF,
    default_model_id,
    import_gguf,
)
from exod.host.models import InvalidModelId, resolve_model
from exod.host.tiny_model import make_tiny_model
from gguf_files import K_QUANTS, gguf_from_tiny_model, gguf_name, header_layout, spm_gguf_from_tiny_model

SENTENCE = "The quick brown fox jumps over the lazy dog."
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi there"}]
TOLERANCE = 1e-5  # F32 in, F32 out: the measured differences are 2e-7 at most


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A llama and a qwen2 (2 layers, hidden 64, 4 heads of 16, 2 KV heads), made once: the tests only read them."""
    home = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_model(f"exod/tiny-{arch}", arch=arch, hf_home=home) for arch in ("llama", "qwen2")}


@pytest.fixture(scope="module")
def ids(tiny: dict[str, Path]) -> list[int]:
    """The sentence's token ids (15 of them: positions up to 14 for RoPE to rotate)."""
    from mlx_lm.utils import load_tokenizer

    tokens = load_tokenizer(tiny["llama"]).encode(SENTENCE)
    assert len(tokens) > 8
    return tokens


def _logits(model_dir: Path, tokens: list[int], model_config: dict[str, Any] | None = None) -> np.ndarray:
    import mlx.core as mx
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(model_dir), model_config=model_config)
    return np.array(model(mx.array([tokens])).astype(mx.float32))[0]


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def _left_in(home: Path) -> list[str]:
    """What the HF cache under ``home`` holds: repositories, and any staging directory an import left."""
    hub = home / "hub"
    return sorted(p.name for p in hub.iterdir()) if hub.exists() else []


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _weights(model_dir: Path) -> dict[str, Any]:
    import mlx.core as mx

    return mx.load(str(model_dir / "model.safetensors"))


def _file_tensors(path: Path) -> dict[str, Any]:
    import gguf

    return {t.name: t for t in gguf.GGUFReader(path).tensors}


# --- faithfulness ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_an_f32_gguf_imports_to_the_model_it_was_written_from(
    tiny: dict[str, Path], ids: list[int], tmp_path: Path, arch: str
) -> None:
    """Same logits at every position, same token ids, same chat template and end of turn.

    Each head is 16 wide, so RoPE turns 8 pairs by an angle that grows with the position: from the second token
    on, the logits depend on ``rope_traditional`` matching how llama.cpp laid out Q and K. The next test shows
    that either mistake moves them far past this tolerance.
    """
    from mlx_lm import load

    imported = import_gguf(gguf_from_tiny_model(tiny[arch], tmp_path / f"tiny-{arch}.gguf"), hf_home=tmp_path)
    assert imported.architecture == arch
    config = json.loads((imported.path / "config.json").read_text())
    assert config["rope_traditional"] is (arch == "llama")
    assert config["tie_word_embeddings"] is True and "quantization" not in config

    np.testing.assert_allclose(_logits(imported.path, ids), _logits(tiny[arch], ids), atol=TOLERANCE, rtol=0)

    _, original = load(str(tiny[arch]))
    _, tokenizer = load(str(imported.path))
    assert tokenizer.encode(SENTENCE) == ids
    assert tokenizer.decode(ids) == SENTENCE
    assert tokenizer.encode("<|im_start|>user") == original.encode("<|im_start|>user")  # a special token stays whole
    template = {"add_generation_prompt": True, "tokenize": False}
    assert tokenizer.apply_chat_template(CHAT, **template) == original.apply_chat_template(CHAT, **template)
    assert tokenizer.apply_chat_template(CHAT, add_generation_prompt=True) == original.apply_chat_template(
        CHAT, add_generation_prompt=True
    )
    assert tokenizer.eos_token_ids == original.eos_token_ids == {original.convert_tokens_to_ids("<|im_end|>")}


def test_a_wrong_rope_or_a_missing_permutation_moves_llama_logits_far_past_the_tolerance(
    tiny: dict[str, Path], ids: list[int], tmp_path: Path
) -> None:
    """The faithfulness test can fail: both mistakes leave position 0 alone (RoPE turns it by nothing) and move
    every later one past 20 times the tolerance (measured: by 2e-3 to 8e-3, the random model's attention being
    nearly uniform)."""
    reference = _logits(tiny["llama"], ids)
    right = import_gguf(gguf_from_tiny_model(tiny["llama"], tmp_path / "right.gguf"), hf_home=tmp_path)
    unpermuted = import_gguf(
        gguf_from_tiny_model(tiny["llama"], tmp_path / "unpermuted.gguf", permute_qk=False), hf_home=tmp_path
    )
    for wrong in (_logits(right.path, ids, {"rope_traditional": False}), _logits(unpermuted.path, ids)):
        np.testing.assert_allclose(wrong[0], reference[0], atol=TOLERANCE, rtol=0)
        assert np.abs(wrong[1:] - reference[1:]).max(axis=-1).min() > 20 * TOLERANCE


def _llama3_divisors(base: float, dims: int, factor: float) -> np.ndarray:
    """convert_hf_to_gguf's ``rope_freqs`` for Llama 3.1 (low 1, high 4, an original context of 8192), as it writes
    them: each frequency's divisor."""
    divisors = []
    for period in base ** (np.arange(0, dims, 2) / dims):
        wavelength = 2 * np.pi * period
        if wavelength < 8192 / 4:
            divisors.append(1.0)
        elif wavelength > 8192 / 1:
            divisors.append(factor)
        else:
            smooth = (8192 / wavelength - 1) / (4 - 1)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, dtype=np.float32)


def test_llama_3s_scaled_rope_imports_as_the_scaling_it_was_written_from(tmp_path: Path) -> None:
    """Llama 3.1 and later store their RoPE scaling as a tensor of divisors (``rope_freqs``): imported as the
    ``rope_scaling`` mlx-lm computes them from, the logits are the original's. Heads of 16 at base 10000 put one
    frequency past the original context's wavelength (divided by the factor) and one in the smoothed band; 500
    positions turn them far enough for a wrong scaling to show. Divisors that are not Llama 3's are refused."""
    original = make_tiny_model("exod/tiny-llama3", arch="llama", hf_home=tmp_path / "made")
    config = json.loads((original / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    (original / "config.json").write_text(json.dumps(config))
    divisors = _llama3_divisors(config["rope_theta"], config["head_dim"], 32.0)
    assert 1.0 < divisors[-2] < 32.0 == divisors[-1]  # one frequency smoothed, one scaled whole
    made = gguf_from_tiny_model(original, tmp_path / "llama3.gguf", extra_tensors={"rope_freqs.weight": divisors})
    imported = import_gguf(made, hf_home=tmp_path)
    assert json.loads((imported.path / "config.json").read_text())["rope_scaling"]["factor"] == 32.0
    tokens = list(range(3, 503))
    reference = _logits(original, tokens)
    np.testing.assert_allclose(_logits(imported.path, tokens), reference, atol=TOLERANCE, rtol=0)
    unscaled = _logits(imported.path, tokens, {"rope_scaling": None})
    assert np.abs(unscaled - reference).max() > 10 * TOLERANCE  # measured: 3.6e-4

    odd = divisors.copy()
    odd[-2] *= 1.5
    with pytest.raises(UnsupportedGGUF, match="Llama 3's"):
        import_gguf(
            gguf_from_tiny_model(original, tmp_path / "odd.gguf", extra_tensors={"rope_freqs.weight": odd}),
            hf_home=tmp_path / "odd",
        )
    assert _left_in(tmp_path / "odd") == []


def test_a_sentencepiece_vocabulary_becomes_a_tokenizer_that_round_trips_text(
    tiny: dict[str, Path], tmp_path: Path
) -> None:
    """Llama 2 and Mistral files carry pieces and scores, not merges: the words come out whole, BOS first,
    and what the vocabulary lacks falls back to byte tokens and decodes back to the text."""
    from mlx_lm.utils import load_tokenizer

    path, vocab = spm_gguf_from_tiny_model(tiny["llama"], tmp_path / "spm.gguf")
    tokenizer = load_tokenizer(import_gguf(path, hf_home=tmp_path).path)
    ids = tokenizer.encode(SENTENCE)
    assert [vocab[i] for i in ids] == ["<s>", *(f"▁{w}" for w in SENTENCE[:-1].split()), "."]
    assert [vocab[i] for i in tokenizer.encode("café")][-3:] == ["f", "<0xC3>", "<0xA9>"]
    for text in (SENTENCE, "Hello world, how are you today?", "naïve café ☕ 42", "two  spaces\nand\ta tab"):
        assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=True) == text
    assert tokenizer.eos_token_ids == {vocab.index("</s>")}

    without_bos, _ = spm_gguf_from_tiny_model(tiny["llama"], tmp_path / "spm-no-bos.gguf", add_bos=False)
    assert load_tokenizer(import_gguf(without_bos, hf_home=tmp_path).path).encode(SENTENCE) == ids[1:]
    unsaid, _ = spm_gguf_from_tiny_model(tiny["llama"], tmp_path / "spm-unsaid.gguf", add_bos=None)
    assert load_tokenizer(import_gguf(unsaid, hf_home=tmp_path).path).encode(SENTENCE) == ids  # as llama.cpp does


# --- tensor types ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "bits", "cosine"), [("Q8_0", 8, 0.999), ("Q4_0", 4, 0.97), ("Q4_1", 4, 0.97)])
def test_q8_0_q4_0_and_q4_1_stay_quantized_holding_exactly_the_files_values(
    tiny: dict[str, Path], ids: list[int], tmp_path: Path, kind: str, bits: int, cosine: float
) -> None:
    """MLX's affine 4- and 8-bit layout (group 32) holds these blocks exactly: dequantized, the imported weights
    are llama.cpp's own dequantization of the file. The logits stay near the F32 model's (measured cosine:
    0.99995 for Q8_0, 0.991 for the 4-bit ones)."""
    import gguf
    import mlx.core as mx

    path = gguf_from_tiny_model(tiny["llama"], tmp_path / f"tiny-{kind}.gguf", tensor_type=kind)
    imported = import_gguf(path, hf_home=tmp_path)
    assert json.loads((imported.path / "config.json").read_text())["quantization"]["group_size"] == 32
    weights = _weights(imported.path)
    hf_names = {gguf_name(name): name.removesuffix(".weight") for name in _weights(tiny["llama"])}
    quantized = [t for t in _file_tensors(path).values() if t.tensor_type.name == kind]
    assert len(quantized) == 15  # the embedding and 7 matrices a layer; norms stay F32
    for tensor in quantized:
        base = hf_names[tensor.name]
        packed, scales, biases = (weights[f"{base}.{part}"] for part in ("weight", "scales", "biases"))
        assert packed.dtype == mx.uint32
        assert packed.shape[-1] * 32 // bits == int(tensor.shape[0])  # GGUF lists the row length first
        # in float32, scale × code + bias is exact for every one of these block formats: equal, not close
        scales, biases = scales.astype(mx.float32), biases.astype(mx.float32)
        ours = mx.dequantize(packed, scales, biases, group_size=32, bits=bits)
        theirs = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        np.testing.assert_array_equal(np.array(ours), theirs, err_msg=tensor.name)
    assert weights["model.norm.weight"].dtype == mx.float32
    assert _cosine(_logits(imported.path, ids), _logits(tiny["llama"], ids)) > cosine


@pytest.mark.parametrize(("kind", "dtype"), [("F16", "float16"), ("BF16", "bfloat16")])
def test_f16_and_bf16_weights_keep_their_type_and_bits(
    tiny: dict[str, Path], ids: list[int], tmp_path: Path, kind: str, dtype: str
) -> None:
    """BF16 must not pass through float16 (MLX's GGUF reader would make it so): same 16 bits as the file."""
    import mlx.core as mx

    path = gguf_from_tiny_model(tiny["qwen2"], tmp_path / f"tiny-{kind}.gguf", tensor_type=kind)
    imported = import_gguf(path, hf_home=tmp_path)
    weights = _weights(imported.path)
    hf_names = {gguf_name(name): name for name in _weights(tiny["qwen2"])}
    halves = [t for t in _file_tensors(path).values() if t.tensor_type.name == kind]
    assert len(halves) == 15  # the embedding and 7 matrices a layer; norms and biases stay F32
    for tensor in halves:
        ours = weights[hf_names[tensor.name]]
        assert ours.dtype == getattr(mx, dtype)
        bits = np.ascontiguousarray(tensor.data).view(np.uint16).ravel()
        np.testing.assert_array_equal(np.array(ours.view(mx.uint16)).ravel(), bits, err_msg=tensor.name)
    assert weights["model.layers.0.self_attn.q_proj.bias"].dtype == mx.float32
    assert "quantization" not in json.loads((imported.path / "config.json").read_text())
    assert _cosine(_logits(imported.path, ids), _logits(tiny["qwen2"], ids)) > 0.9999


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-layer llama whose rows are 256 long: the K-quants' super-block."""
    home = tmp_path_factory.mktemp("wide")
    return make_tiny_model("exod/tiny-wide", arch="llama", layers=1, hidden=256, intermediate=256, hf_home=home)


@pytest.mark.parametrize("kind", [k for k in K_QUANTS if k != "Q4_K"])
def test_k_quants_are_dequantized_to_float16_as_llama_cpp_does_and_said_so(
    wide: Path, tmp_path: Path, kind: str
) -> None:
    """Every value as llama.cpp's reference dequantization gives it, and the notes say what the memory costs."""
    import gguf
    import mlx.core as mx

    path = gguf_from_tiny_model(wide, tmp_path / f"wide-{kind}.gguf", tensor_type=kind)
    imported = import_gguf(path, hf_home=tmp_path)
    assert imported.dequantized == (kind,)
    assert len(imported.notes) == 1 and kind in imported.notes[0] and "float16" in imported.notes[0]
    assert "quantization" not in json.loads((imported.path / "config.json").read_text())
    weights = _weights(imported.path)
    hf_names = {gguf_name(name): name for name in _weights(wide)}
    checked = 0
    for tensor in _file_tensors(path).values():
        if tensor.tensor_type.name == kind:
            ours = weights[hf_names[tensor.name]]
            assert ours.dtype == mx.float16
            theirs = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float16)
            np.testing.assert_array_equal(np.array(ours), theirs, err_msg=tensor.name)
            checked += 1
    assert checked == 8  # the embedding and 7 matrices of the one layer
    assert imported.weight_bytes == sum(a.nbytes for a in weights.values()) > path.stat().st_size


def test_q4_k_stays_4_bit_in_mlxs_layout_holding_the_values_llama_cpp_reads(
    wide: Path, ids: list[int], tmp_path: Path
) -> None:
    """Q4_K, most of every Q4_K_M file, maps onto MLX's affine 4-bit groups of 32: kept so, not dequantized (MLX's
    own reader would dequantize it, and give half its sub-blocks their neighbour's scale). Dequantized by MLX, each
    value is llama.cpp's reference but for the float16 rounding of a sub-block's scale and bias."""
    import gguf
    import mlx.core as mx

    path = gguf_from_tiny_model(wide, tmp_path / "wide-Q4_K.gguf", tensor_type="Q4_K")
    imported = import_gguf(path, hf_home=tmp_path)
    assert imported.dequantized == () and imported.notes == ()
    assert json.loads((imported.path / "config.json").read_text())["quantization"] == {"group_size": 32, "bits": 4}
    weights = _weights(imported.path)
    hf_names = {gguf_name(name): name for name in _weights(wide)}
    checked = 0
    for tensor in _file_tensors(path).values():
        if tensor.tensor_type.name != "Q4_K":
            continue
        base = hf_names[tensor.name].removesuffix(".weight")
        packed, scales, biases = (weights[f"{base}.{part}"] for part in ("weight", "scales", "biases"))
        assert packed.dtype == mx.uint32 and scales.dtype == biases.dtype == mx.float16
        ours = np.array(mx.dequantize(packed, scales, biases, group_size=32, bits=4).astype(mx.float32))
        theirs = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        # a scale and a bias rounded to float16 (11 bits) move a value by a little of its sub-block's range
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-3 * np.abs(theirs).max(), err_msg=tensor.name)
        checked += 1
    assert checked == 8  # the embedding and 7 matrices of the one layer
    assert imported.weight_bytes < path.stat().st_size * 1.2  # 4-bit still: no float16 copy
    from mlx_lm.utils import load_model

    model, _ = load_model(imported.path)  # mlx-lm quantizes the layers as the file has them, and runs them
    assert np.isfinite(np.array(model(mx.array([ids[:4]])).astype(mx.float32))).all()


# --- what the import reports ----------------------------------------------------------------------------------


def test_the_import_reports_its_id_place_tensor_types_and_sizes(tiny: dict[str, Path], tmp_path: Path) -> None:
    """The id comes from the file's name (lowercased, dots to dashes); the sizes are what the cache holds."""
    path = gguf_from_tiny_model(tiny["qwen2"], tmp_path / "Qwen2.5-0.5B-Instruct-Q4_0.gguf", tensor_type="Q4_0")
    seen: list[tuple[int, int]] = []
    imported = import_gguf(path, hf_home=tmp_path / "hf", progress=lambda done, total: seen.append((done, total)))

    assert imported.model_id == default_model_id(path) == "gguf/qwen2-5-0-5b-instruct-q4_0"
    assert imported.architecture == "qwen2"
    # 2 layers of 7 matrices and the embedding; 2 layers of 2 norms and 3 biases, and the final norm
    assert imported.tensor_types == (("Q4_0", 15), ("F32", 11))
    assert imported.dequantized == () and imported.notes == ()
    repo = tmp_path / "hf" / "hub" / "models--gguf--qwen2-5-0-5b-instruct-q4_0"
    assert imported.path == repo / "snapshots" / (repo / "refs" / "main").read_text()
    assert imported.file_bytes == path.stat().st_size
    on_disk = sum(a.nbytes for a in _weights(imported.path).values())
    index = json.loads((imported.path / "model.safetensors.index.json").read_text())
    assert imported.weight_bytes == on_disk == index["metadata"]["total_size"]
    assert imported.weight_bytes < (tiny["qwen2"] / "model.safetensors").stat().st_size / 4  # 4-bit, from F32
    tensor_bytes = sum(int(t.n_bytes) for t in _file_tensors(path).values())  # progress counts the file's tensors
    assert seen[0] == (0, tensor_bytes) and seen[-1] == (tensor_bytes,) * 2
    assert len(seen) == 1 + 26 and [done for done, _ in seen] == sorted(done for done, _ in seen)  # one a tensor
    assert resolve_model(imported.model_id, hf_home=tmp_path / "hf", offline=True) == imported.path

    chosen = import_gguf(path, model_id="me/my-qwen", hf_home=tmp_path / "hf")
    assert chosen.model_id == "me/my-qwen" and chosen.path.parent.parent.name == "models--me--my-qwen"
    with pytest.raises(InvalidModelId):
        import_gguf(path, model_id="../escape", hf_home=tmp_path / "other")
    assert _left_in(tmp_path / "other") == []


def test_an_ollama_blob_named_by_its_digest_is_named_from_its_metadata(tiny: dict[str, Path], tmp_path: Path) -> None:
    """Ollama keeps models as ``sha256-<digest>`` files: the id is made of the name, size, finetune and type."""
    blob = tmp_path / ("sha256-" + "0123456789abcdef" * 4)
    metadata = {"general.basename": "SmolLM2", "general.size_label": "135M", "general.finetune": "Instruct"}
    gguf_from_tiny_model(tiny["llama"], blob, tensor_type="Q8_0", metadata=metadata)
    assert default_model_id(blob) == "gguf/smollm2-135m-instruct-q8_0"
    assert import_gguf(blob, hf_home=tmp_path).model_id == "gguf/smollm2-135m-instruct-q8_0"


def test_importing_the_same_file_again_gives_the_same_snapshot(
    tiny: dict[str, Path], ids: list[int], tmp_path: Path
) -> None:
    """The revision is the header's digest: a second import replaces the snapshot with identical files."""
    path = gguf_from_tiny_model(tiny["llama"], tmp_path / "again.gguf", tensor_type="Q8_0")
    first = import_gguf(path, hf_home=tmp_path / "hf")
    files = _tree(first.path)
    second = import_gguf(path, hf_home=tmp_path / "hf")
    assert second.path == first.path and _tree(second.path) == files
    repo = first.path.parent.parent
    assert (repo / "refs" / "main").read_text() == first.path.name
    assert [p.name for p in (repo / "snapshots").iterdir()] == [first.path.name]
    assert [p.name for p in (repo / "refs").iterdir()] == ["main"]
    assert _left_in(tmp_path / "hf") == [repo.name]  # no staging or replaced directory left beside it
    assert _cosine(_logits(second.path, ids), _logits(tiny["llama"], ids)) > 0.999


# --- refusals -------------------------------------------------------------------------------------------------


def _respell_bos(data: bytes) -> bytes:
    """The BOS token spelled with a character outside the byte-level alphabet (a space here), as a special token
    of DeepSeek's R1 distills is (fullwidth bars): the vocabulary holds it under another spelling."""
    return data.replace(b"<|endoftext|>", b"<|end ftext|>")


@pytest.mark.parametrize(
    ("write", "patch", "match"),
    [
        ({"architecture": "gemma"}, None, r"'gemma' model; exod imports llama, qwen2"),
        ({"tensor_type": "Q5_0"}, None, r"type Q5_0; exod imports F32, F16, BF16, Q4_0, Q4_1, Q8_0, Q4_K as they are"),
        ({"metadata": {"tokenizer.ggml.model": "bert"}}, None, r"'bert' tokenizer; exod builds gpt2-style BPE"),
        ({}, _respell_bos, r"special tokens \['<\|end ftext\|>'\] are not in its vocabulary"),
    ],
    ids=["architecture", "tensor type", "tokenizer", "special token"],
)
def test_a_gguf_exod_does_not_serve_is_refused_naming_what_it_does_and_leaves_nothing(
    tiny: dict[str, Path],
    tmp_path: Path,
    write: dict[str, Any],
    patch: Callable[[bytes], bytes] | None,
    match: str,
) -> None:
    """Refused from the header (or the tokenizer) with what exod would take instead, before anything is kept."""
    path = gguf_from_tiny_model(tiny["llama"], tmp_path / "refused.gguf", **write)
    if patch is not None:
        path.write_bytes(patch(path.read_bytes()))
    with pytest.raises(UnsupportedGGUF, match=match):
        import_gguf(path, hf_home=tmp_path / "hf")
    assert _left_in(tmp_path / "hf") == []


@pytest.fixture(scope="module")
def valid(tiny: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, dict[str, int]]:
    """A small valid GGUF (llama, Q4_0) and where its header's fields lie."""
    path = gguf_from_tiny_model(tiny["llama"], tmp_path_factory.mktemp("valid") / "valid.gguf", tensor_type="Q4_0")
    return path.read_bytes(), header_layout(path)


def _patched(at: str | int, value: int, fmt: str = "<Q") -> Callable[[bytes, dict[str, int]], bytes]:
    """Write ``value`` at a field of `header_layout` (by its name) or at a byte offset."""

    def patch(data: bytes, layout: dict[str, int]) -> bytes:
        damaged = bytearray(data)
        struct.pack_into(fmt, damaged, layout[at] if isinstance(at, str) else at, value)
        return bytes(damaged)

    return patch


def _cut(where: Callable[[bytes, dict[str, int]], int]) -> Callable[[bytes, dict[str, int]], bytes]:
    return lambda data, layout: data[: where(data, layout)]


UNREADABLE = r"is not a readable GGUF file \(.*\): it may be truncated or damaged; download it again"
DAMAGE: dict[str, tuple[Callable[[bytes, dict[str, int]], bytes], str]] = {
    "text": (lambda data, layout: b"This is a README, not a model.\n" * 40, UNREADABLE),
    "empty": (lambda data, layout: b"", UNREADABLE),
    "bad magic": (lambda data, layout: b"GGUX" + data[4:], UNREADABLE),
    "a future version": (_patched(4, 99, "<I"), UNREADABLE),
    "cut after the magic": (_cut(lambda data, layout: 4), UNREADABLE),
    "cut in the counts": (_cut(lambda data, layout: 20), UNREADABLE),
    "cut in the metadata": (_cut(lambda data, layout: layout["tensor_infos"] // 2), UNREADABLE),
    "cut in the tensor infos": (_cut(lambda data, layout: layout["tensor_infos"] + 30), UNREADABLE),
    "cut where the data begins": (_cut(lambda data, layout: layout["data_offset"]), UNREADABLE),
    "cut in the tensor data": (_cut(lambda data, layout: (layout["data_offset"] + len(data)) // 2), UNREADABLE),
    "one byte short": (_cut(lambda data, layout: len(data) - 1), UNREADABLE),
    "a merge of a token the vocabulary lacks": (
        lambda data, layout: _patched(layout["merge_end"] - 1, 0x7F, "<B")(data, layout),
        r"tokenizer cannot be built \(Exception: .*out of vocabulary\)",
    ),
    "2**62 tensors": (_patched("tensor_count", 1 << 62), UNREADABLE),
    "one tensor more than described": (
        lambda data, layout: _patched("tensor_count", struct.unpack_from("<Q", data, 8)[0] + 1)(data, layout),
        UNREADABLE,
    ),
    "no tensors": (_patched("tensor_count", 0), "holds no tensors"),
    "2**62 metadata keys": (_patched("kv_count", 1 << 62), UNREADABLE),
    "a side of 2**40": (_patched("first_dim", 1 << 40), UNREADABLE),
    "a side of 0": (_patched("first_dim", 0), r"tensor 'token_embd.weight' has an impossible shape \(512, 0\)"),
    "an unknown tensor type": (_patched("first_type", 9999, "<I"), UNREADABLE),
    "an offset past the end": (lambda data, layout: _patched("first_offset", len(data))(data, layout), UNREADABLE),
    "an offset into another tensor": (
        _patched("first_offset", 32),
        "a tensor's data lies outside the file or overlaps",
    ),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_file_is_refused_as_corrupt_and_leaves_nothing(
    valid: tuple[bytes, dict[str, int]], tmp_path: Path, damage: str
) -> None:
    """Each is a `CorruptGGUF` (a `GGUFImportError`, so a ValueError) saying what is wrong; all but the merge are
    caught from the header alone, before MLX's C reader (which trusts it) opens the file."""
    data, layout = valid
    spoil, match = DAMAGE[damage]
    path = tmp_path / "damaged.gguf"
    path.write_bytes(spoil(data, layout))
    with pytest.raises(CorruptGGUF, match=match) as raised:
        import_gguf(path, hf_home=tmp_path / "hf")
    assert isinstance(raised.value, GGUFImportError) and isinstance(raised.value, ValueError)
    assert _left_in(tmp_path / "hf") == []


@pytest.mark.parametrize(
    ("metadata", "match"),
    [
        ({"llama.block_count": 3}, r"(?s)the imported model does not load \(ValueError: .*model\.layers\.2\."),
        ({"llama.embedding_length": 66}, "the file's embedding, vocabulary and head count do not agree"),
        ({"llama.attention.head_count": 0}, r"llama\.attention\.head_count is 0: not a size a model can have"),
        ({"llama.attention.head_count_kv": 8}, r"head_count_kv is 8: not a size"),  # more than the 4 heads
    ],
    ids=["a layer more than the tensors", "a hidden size the heads do not divide", "no heads", "more KV heads"],
)
def test_a_header_that_disagrees_with_its_tensors_is_refused_as_corrupt(
    tiny: dict[str, Path], tmp_path: Path, metadata: dict[str, Any], match: str
) -> None:
    """Sizes the tensors contradict are caught, the last of them by loading the result as a runner would."""
    path = gguf_from_tiny_model(tiny["llama"], tmp_path / "disagrees.gguf", metadata=metadata)
    with pytest.raises(CorruptGGUF, match=match):
        import_gguf(path, hf_home=tmp_path / "hf")
    assert _left_in(tmp_path / "hf") == []


def test_a_path_that_is_not_a_file_is_refused(tmp_path: Path) -> None:
    """A missing file or a directory is a `GGUFImportError` saying so, not a traceback from a reader."""
    for path in (tmp_path / "absent.gguf", tmp_path):
        with pytest.raises(GGUFImportError, match="is not a file"):
            import_gguf(path, hf_home=tmp_path / "hf")
    assert _left_in(tmp_path / "hf") == []


# --- fuzzing the header, in a process of its own ------------------------------------------------------------

_MARK = "@@gguf-import@@"
_WORKER = f"""
import json, sys
from pathlib import Path
from exod.host.gguf_import import GGUFImportError, import_gguf
for line in sys.stdin:
    request = json.loads(line)
    try:
        import_gguf(request["file"], hf_home=Path(request["home"]))
        answer = {{"outcome": "imported"}}
    except GGUFImportError as exc:
        answer = {{"outcome": "refused", "error": type(exc).__name__}}
    except BaseException as exc:
        answer = {{"outcome": "raised", "error": f"{{type(exc).__name__}}: {{exc}}"[:500]}}
    print({_MARK!r} + json.dumps(answer), flush=True)
"""


class _Importer:
    """``import_gguf`` in a child process kept between calls: a damaged header must never kill a process (MLX's
    C reader would, with a signal), and the child shows it if one does. Started again after a death."""

    def __init__(self, scratch: Path) -> None:
        self.scratch = scratch
        self.process: subprocess.Popen[str] | None = None
        self.lines: queue.Queue[str | None] = queue.Queue()

    def __call__(self, file: Path, home: Path, timeout: float = 60) -> dict[str, Any]:
        if self.process is None:
            self._start()
        assert self.process is not None and self.process.stdin is not None
        self.process.stdin.write(json.dumps({"file": str(file), "home": str(home)}) + "\n")
        self.process.stdin.flush()
        while True:
            try:
                line = self.lines.get(timeout=timeout)
            except queue.Empty:
                self.close()
                return {"outcome": "hung"}
            if line is None:  # the child's end of the pipe closed: it died
                code = self.process.wait()
                self.process = None
                stderr = (self.scratch / "stderr").read_text()[-2000:]
                return {"outcome": "died", "returncode": code, "stderr": stderr}
            if line.startswith(_MARK):
                return json.loads(line[len(_MARK) :])

    def _start(self) -> None:
        self.lines = queue.Queue()
        with (self.scratch / "stderr").open("w") as stderr:
            self.process = subprocess.Popen(
                [sys.executable, "-c", _WORKER],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
            )
        threading.Thread(target=self._read, args=(self.process, self.lines), daemon=True).start()

    @staticmethod
    def _read(process: subprocess.Popen[str], lines: queue.Queue[str | None]) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.put(line)
        lines.put(None)

    def close(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None


@pytest.fixture(scope="module")
def importer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Importer]:
    child = _Importer(tmp_path_factory.mktemp("importer"))
    yield child
    child.close()


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_random_damage_to_the_header_is_imported_or_refused_never_a_crash(
    valid: tuple[bytes, dict[str, int]], importer: _Importer, tmp_path_factory: pytest.TempPathFactory, data: Any
) -> None:
    """One to four changes in the header (bytes, or 8-byte words such as counts, sides and offsets): the import
    succeeds or raises a `GGUFImportError` with nothing left in the cache; it never dies by a signal or raises
    anything else. Counts, tensor descriptions and the metadata's lengths are drawn most often."""
    original, layout = valid
    end = layout["data_offset"]
    offsets = st.one_of(st.integers(0, 23), st.integers(layout["tensor_infos"], end - 1), st.integers(0, end - 1))
    words = st.sampled_from([0, 1, 1 << 31, (1 << 32) - 1, 1 << 63, (1 << 64) - 1, len(original)])
    values = st.one_of(
        st.binary(min_size=1, max_size=1),
        st.binary(min_size=8, max_size=8),
        words.map(lambda n: struct.pack("<Q", n)),
    )
    damaged = bytearray(original)
    for at, value in data.draw(st.lists(st.tuples(offsets, values), min_size=1, max_size=4), label="changes"):
        damaged[at : at + len(value)] = value
    assert len(damaged) == len(original)

    with tempfile.TemporaryDirectory(dir=tmp_path_factory.getbasetemp()) as scratch:
        path, home = Path(scratch) / "damaged.gguf", Path(scratch) / "hf"
        path.write_bytes(bytes(damaged))
        answer = importer(path, home)
        assert answer["outcome"] in {"imported", "refused"}, answer
        if answer["outcome"] == "refused":
            assert _left_in(home) == []
        else:
            assert not [name for name in _left_in(home) if not name.startswith("models--")]


# --- the CLI --------------------------------------------------------------------------------------------------


def test_cli_import_prints_the_model_id_first_and_refuses_a_damaged_file(tiny: dict[str, Path], tmp_path: Path) -> None:
    """The id comes first, so a script can take it; a damaged file exits 1 with the reason and leaves nothing."""
    path = gguf_from_tiny_model(tiny["llama"], tmp_path / "SmolLM2-135M.Q8_0.gguf", tensor_type="Q8_0")
    runner = CliRunner()
    done = runner.invoke(main, ["model", "import", str(path), "--hf-home", str(tmp_path / "hf")])
    assert done.exit_code == 0, done.output
    lines = done.stdout.splitlines()
    assert lines[0] == "gguf/smollm2-135m-q8_0"
    assert "llama" in lines[1] and "15 Q8_0" in lines[1] and "5 F32" in lines[1]
    listed = runner.invoke(main, ["model", "list", "--hf-home", str(tmp_path / "hf")])
    assert "gguf/smollm2-135m-q8_0" in listed.output

    damaged = tmp_path / "damaged.gguf"
    damaged.write_bytes(path.read_bytes()[:1000])
    refused = runner.invoke(main, ["model", "import", str(damaged), "--hf-home", str(tmp_path / "other")])
    assert refused.exit_code == 1
    assert "not a readable GGUF file" in refused.output and "download it again" in refused.output
    assert _left_in(tmp_path / "other") == []


# --- served like any other model ------------------------------------------------------------------------------


def test_an_imported_model_is_placed_on_demand_and_through_the_api_like_any_other(
    tiny: dict[str, Path], tmp_path: Path
) -> None:
    """`exod serve` places an imported id when a request names it (on demand) and when a client places it (the
    dashboard's and `exod place`'s POST /instances), and answers from it."""
    hf = tmp_path / "hf"
    asked = import_gguf(
        gguf_from_tiny_model(tiny["qwen2"], tmp_path / "Asked-Q8_0.gguf", tensor_type="Q8_0"), hf_home=hf
    )
    placed = import_gguf(
        gguf_from_tiny_model(tiny["llama"], tmp_path / "Placed-Q4_0.gguf", tensor_type="Q4_0"), hf_home=hf
    )
    (tmp_path / "exod.toml").write_text("[daemon]\nport = 0\noffline = true\n\n[models]\non_demand = true\n")
    process, url = start_daemon(tmp_path, {**os.environ, "HF_HOME": str(hf), "HF_HUB_OFFLINE": "1"})
    try:
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
        answer = httpx.post(f"{url}/v1/chat/completions", json={"model": asked.model_id, **chat}, timeout=120)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] > 0, answer.text
        made = httpx.post(f"{url}/instances", json={"model": placed.model_id, "ranks": 1}, timeout=60)
        assert made.status_code == 201, made.text
        listed = httpx.get(f"{url}/instances", timeout=30).json()["instances"]
        assert {i["model_id"] for i in listed} == {asked.model_id, placed.model_id}
        answer = httpx.post(f"{url}/v1/chat/completions", json={"model": placed.model_id, **chat}, timeout=120)
        assert answer.status_code == 200, answer.text
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    assert runner_pids() == []
