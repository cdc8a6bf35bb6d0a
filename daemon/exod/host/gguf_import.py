"""A GGUF file (llama.cpp's format: Ollama's blobs, LM Studio's downloads) made into a model directory mlx-lm loads.

Theory of operation. A GGUF holds the weights, the architecture's sizes, the tokenizer and the chat template in
one file. Three libraries each read the part they know best:

* ``gguf`` (llama.cpp's own reader) reads the header: every metadata value and every tensor's type, shape and
  place. It is read first and checked in full (types, sizes, bounds), because MLX's C reader trusts the header:
  a corrupt one can crash the process rather than raise (measured: 38 of 112 randomly corrupted headers did).
* ``mlx.core.load`` reads the tensors. Q4_0, Q4_1 and Q8_0 arrive already in MLX's quantized layout (weight,
  scales, biases; group 32), so they stay quantized; Q2_K and Q6_K arrive dequantized to float16 (said so, with
  the memory it costs); F32 and F16 as they are. BF16 and Q4_K, which MLX's reader gets wrong, are read by
  ``gguf`` (`exod.host.gguf_tensors`): BF16 raw, Q4_K repacked into MLX's 4-bit layout, which it maps onto exactly.
* transformers builds the tokenizer from the vocabulary, merges and token types (gpt2-style byte-level BPE and
  llama's SentencePiece), as its own ``from_pretrained(gguf_file=…)`` does.

Compared with the alternatives (transformers' ``gguf_file=`` loading, ``gguf2mlx``), MLX's own loader is the one
that keeps the 4- and 8-bit formats quantized without a detour through float32 and adds no dependency.

llama.cpp stores a llama's Q and K projections permuted for its interleaved RoPE, so a llama is written with
``rope_traditional = true`` (qwen2's are not permuted). The directory is written beside its place in the cache
and renamed into it only once mlx-lm has loaded it: a failed import leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs

from exod.host.gguf_tensors import EXACT, ExactReader
from exod.host.models import hub_cache_dir, validate_model_id

__all__ = [
    "ARCHITECTURES",
    "CorruptGGUF",
    "GGUFImportError",
    "ImportedModel",
    "UnsupportedGGUF",
    "default_model_id",
    "import_gguf",
]

ARCHITECTURES = ("llama", "qwen2")  # and what llama.cpp files as llama: Llama 2/3, Mistral, SmolLM
TOKENIZERS = ("gpt2", "llama")  # byte-level BPE, SentencePiece
KEPT = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0", "Q4_K")  # stored as the file has them (Q4_K: as MLX's 4-bit)
QUANTIZED = frozenset({"Q4_0", "Q4_1", "Q8_0", "Q4_K"})  # kept in MLX's quantized layout, groups of 32
DEQUANTIZED = ("Q2_K", "Q6_K")  # MLX's reader turns these into float16
_ROPE_FREQS = "rope_freqs.weight"
_GROUP_SIZE = 32  # llama.cpp's block of Q4_0, Q4_1 and Q8_0, and Q4_K's sub-block
_MAX_DIM = 1 << 31  # no real tensor has a side this long; a header that says so is corrupt
_MAX_ELEMENTS = 1 << 40
_MAX_LAYERS = 1024
_SHARD_BYTES = 2 << 30  # safetensors files of ~2 GiB of the GGUF at most: no single huge file

Progress = Callable[[int, int], None]  # (bytes of the file's tensors done, bytes of them in all)


class GGUFImportError(ValueError):
    """A GGUF file cannot be imported; the message says why and what to do."""


class CorruptGGUF(GGUFImportError):
    """The file is not a well-formed GGUF: truncated, damaged, or not GGUF at all."""


class UnsupportedGGUF(GGUFImportError):
    """A well-formed GGUF of an architecture, tokenizer or tensor type exod does not serve."""


@attrs.frozen
class ImportedModel:
    """What an import made: where, from what, and what it costs in memory."""

    model_id: str
    path: Path  # the snapshot directory in the cache
    architecture: str
    tensor_types: tuple[tuple[str, int], ...]  # (GGUF type, how many tensors), most common first
    weight_bytes: int  # what the weights take once imported (memory and disk alike)
    dequantized: tuple[str, ...] = ()  # the GGUF types that were turned into float16
    file_bytes: int = 0

    @property
    def notes(self) -> tuple[str, ...]:
        if not self.dequantized:
            return ()
        return (
            f"tensors stored as {'/'.join(self.dequantized)} were dequantized to float16 (MLX has no kernels for "
            f"them): the weights take {_mib(self.weight_bytes)} in memory, against {_mib(self.file_bytes)} on disk",
        )


@attrs.frozen
class _Tensor:
    name: str
    kind: str  # the GGUF type's name
    shape: tuple[int, ...]  # rows first, as MLX and safetensors have it
    elements: int
    nbytes: int  # in the file


@attrs.frozen
class _Header:
    metadata: dict[str, Any]
    tensors: tuple[_Tensor, ...]
    digest: str  # of the header's bytes and the file's size: the snapshot's revision
    rope_freqs: tuple[float, ...] = ()  # Llama 3.1's RoPE scaling, as llama.cpp stores it: each frequency's divisor
    reader: Any = attrs.field(default=None, eq=False, repr=False)  # gguf's, kept: a header is slow to parse

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)


def import_gguf(
    source: str | Path,
    *,
    model_id: str | None = None,
    hf_home: Path | None = None,
    progress: Progress | None = None,
) -> ImportedModel:
    """Make the GGUF file ``source`` a model in the Hugging Face cache, named ``model_id`` (default: from the file).

    Raises `CorruptGGUF` or `UnsupportedGGUF` (both `GGUFImportError`) with nothing left in the cache.
    Importing the same file again replaces the snapshot with an identical one.
    """
    path = Path(source).expanduser()
    if not path.is_file():
        raise GGUFImportError(f"{str(path)!r} is not a file: pass the path of a .gguf file")
    header = _read_header(path)
    architecture = _check_supported(path, header)
    model_id = validate_model_id(model_id or default_model_id(path, header))
    config = _config(header, architecture)

    cache = hub_cache_dir(hf_home)
    staging = cache / f".exod-import-{uuid.uuid4().hex}"  # beside the repositories: huggingface_hub ignores it
    try:
        staging.mkdir(parents=True)
        weight_bytes, counts, dequantized = _write_weights(path, header, staging, progress or _quiet)
        if any(kind in QUANTIZED for kind, _ in counts):
            config["quantization"] = {"group_size": _GROUP_SIZE, "bits": 4}  # mlx-lm infers 8-bit layers from shapes
        _write_json(staging / "config.json", config)
        _write_tokenizer(header, architecture, staging)
        _verify(staging)
        snapshot = _publish(cache / ("models--" + model_id.replace("/", "--")), staging, header.digest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return ImportedModel(
        model_id=model_id,
        path=snapshot,
        architecture=architecture,
        tensor_types=counts,
        weight_bytes=weight_bytes,
        dequantized=dequantized,
        file_bytes=path.stat().st_size,
    )


def default_model_id(path: Path, header: _Header | None = None) -> str:
    """``gguf/<the file's name>``, or, for a file named by its digest (Ollama's blobs), the name its metadata gives."""
    stem = path.name.removesuffix(".gguf")
    if re.fullmatch(r"(sha256[-:])?[0-9a-f]{32,}", stem):
        header = header or _read_header(path)
        parts = [header.get("general.basename") or header.get("general.name") or "model"]
        parts += [header.get("general.size_label"), header.get("general.finetune")]
        kinds = {t.kind for t in header.tensors if t.kind not in {"F32"}}
        parts.append("-".join(sorted(kinds)))
        stem = "-".join(str(p) for p in parts if p)
    slug = re.sub(r"[^a-z0-9_]+", "-", stem.lower()).strip("-_")[:96] or "model"
    return f"gguf/{slug}"


# --- reading and checking the header ----------------------------------------------------------------------------


def _read_header(path: Path) -> _Header:
    import gguf

    try:
        reader = gguf.GGUFReader(path)
        metadata = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
        tensors = tuple(_tensor(t) for t in reader.tensors)
        data_start, data_size = int(reader.data_offset), path.stat().st_size - int(reader.data_offset)
        ends = [(int(t.data_offset) - data_start, int(t.n_bytes)) for t in reader.tensors]
    except GGUFImportError:
        raise
    except Exception as exc:  # the reader's errors are as varied as the damage: IndexError, UnicodeDecodeError…
        raise CorruptGGUF(
            f"{path} is not a readable GGUF file ({type(exc).__name__}: {str(exc)[:200]}): it may be truncated or "
            "damaged; download it again"
        ) from None
    if not tensors:  # (and the check of spans below needs one)
        raise CorruptGGUF(f"{path} holds no tensors: a vocabulary-only or damaged file, not a model's")
    spans = sorted(ends)
    for (start, size), following in zip(spans, [*spans[1:], (data_size, 0)], strict=True):
        if start < 0 or size < 0 or start + size > following[0]:
            raise CorruptGGUF(f"{path}: a tensor's data lies outside the file or overlaps another: download it again")
    with path.open("rb") as f:
        digest = hashlib.sha256(f.read(data_start))
    digest.update(str(path.stat().st_size).encode())
    rope = next((t for t in reader.tensors if t.name == _ROPE_FREQS), None)
    if rope is not None and rope.tensor_type.name != "F32":
        raise CorruptGGUF(f"{path}: its RoPE frequency factors are {rope.tensor_type.name}, not F32")
    rope_freqs = () if rope is None else tuple(float(x) for x in rope.data.ravel())
    return _Header(metadata, tensors, digest.hexdigest()[:40], rope_freqs, reader)


def _tensor(t: Any) -> _Tensor:
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists the fastest-moving side first
    if not 1 <= len(shape) <= 4 or any(not 1 <= d < _MAX_DIM for d in shape):
        raise CorruptGGUF(f"tensor {t.name!r} has an impossible shape {shape}")
    elements = math.prod(shape)
    if elements > _MAX_ELEMENTS:
        raise CorruptGGUF(f"tensor {t.name!r} claims {elements} elements")
    return _Tensor(name=str(t.name), kind=t.tensor_type.name, shape=shape, elements=elements, nbytes=int(t.n_bytes))


def _check_supported(path: Path, header: _Header) -> str:
    architecture = header.get("general.architecture")
    if architecture not in ARCHITECTURES:
        raise UnsupportedGGUF(
            f"{path.name} is a {architecture!r} model; exod imports {', '.join(ARCHITECTURES)} GGUF files "
            "(Llama 2 and 3, Mistral, SmolLM, Qwen2 and 2.5). Convert other architectures with mlx_lm.convert "
            "from their Hugging Face repository"
        )
    tokenizer = header.get("tokenizer.ggml.model")
    if tokenizer not in TOKENIZERS:
        raise UnsupportedGGUF(
            f"{path.name} has a {tokenizer!r} tokenizer; exod builds gpt2-style BPE and llama SentencePiece ones"
        )
    unsupported = sorted({t.kind for t in header.tensors} - set(KEPT) - set(DEQUANTIZED))
    if unsupported:
        raise UnsupportedGGUF(
            f"{path.name} holds tensors of type {', '.join(unsupported)}; exod imports {', '.join(KEPT)} as they "
            f"are and {', '.join(DEQUANTIZED)} dequantized to float16. Pick a Q4_0, Q4_1, Q8_0 or Q4_K_M file "
            "of the model instead"
        )
    unknown = [t.name for t in header.tensors if _hf_name(t.name) is None and t.name != _ROPE_FREQS]
    if header.rope_freqs and architecture != "llama":
        unknown.append(_ROPE_FREQS)
    if unknown:
        raise UnsupportedGGUF(f"{path.name} has tensors exod does not know for {architecture}: {unknown[:5]}")
    return architecture


# --- config.json --------------------------------------------------------------------------------------------------


def _config(header: _Header, architecture: str) -> dict[str, Any]:
    def size(key: str, *, low: int = 1, high: int = _MAX_DIM, default: int | None = None) -> int:
        value = header.get(f"{architecture}.{key}", default)
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise CorruptGGUF(f"the file's {architecture}.{key} is {value!r}: not a size a model can have")
        return value

    tokens = header.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise CorruptGGUF("the file has no vocabulary (tokenizer.ggml.tokens)")
    embedding = next((t for t in header.tensors if t.name == "token_embd.weight"), None)
    hidden, heads = size("embedding_length"), size("attention.head_count")
    if embedding is None or embedding.shape[0] != len(tokens) or hidden % heads:
        raise CorruptGGUF("the file's embedding, vocabulary and head count do not agree")
    eps = header.get(f"{architecture}.attention.layer_norm_rms_epsilon", 1e-6)
    theta = header.get(f"{architecture}.rope.freq_base", 10000.0)
    config: dict[str, Any] = {
        "model_type": architecture,
        "architectures": ["LlamaForCausalLM" if architecture == "llama" else "Qwen2ForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": size("block_count", high=_MAX_LAYERS),
        "intermediate_size": size("feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": size("attention.head_count_kv", default=heads, high=heads),
        "vocab_size": len(tokens),
        "max_position_embeddings": size("context_length", default=4096),
        "rms_norm_eps": float(eps),
        "rope_theta": float(theta),
        "rope_traditional": architecture == "llama",  # llama.cpp permuted Q and K for its RoPE
        "tie_word_embeddings": not any(t.name == "output.weight" for t in header.tensors),
        "bos_token_id": header.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": header.get("tokenizer.ggml.eos_token_id"),
        "exod_gguf": {"name": header.get("general.name"), "license": header.get("general.license")},
    }
    if architecture == "llama":
        config["head_dim"] = size("rope.dimension_count", default=hidden // heads)
    if header.rope_freqs:
        config["rope_scaling"] = _llama3_scaling(header.rope_freqs, float(theta), config["head_dim"])
    return config


def _llama3_scaling(divisors: tuple[float, ...], base: float, dims: int) -> dict[str, Any]:
    """Llama 3.1's scaled RoPE (Llama 3.2 and 3.3 too), which llama.cpp stores as each frequency's divisor, back as
    the parameters mlx-lm computes it from: the largest divisor is the factor, the rest is Llama 3's constants.
    Refused unless those parameters give back the file's divisors."""
    import numpy as np

    factor, low, high, original = max(divisors), 1.0, 4.0, 8192
    wavelengths = 2 * math.pi * base ** (np.arange(0, dims, 2) / dims)
    smooth = (original / wavelengths - low) / (high - low)
    expected = np.where(
        wavelengths > original / low,
        factor,
        np.where(wavelengths < original / high, 1.0, 1 / ((1 - smooth) / factor + smooth)),
    )
    if len(divisors) != len(expected) or not np.allclose(divisors, expected, rtol=1e-3):
        raise UnsupportedGGUF(
            "the file scales its RoPE frequencies in a way other than Llama 3's (rope_freqs): exod cannot import "
            "it; convert the model with mlx_lm.convert from its Hugging Face repository"
        )
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": original,
    }


# --- weights ------------------------------------------------------------------------------------------------------

_RENAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _hf_name(name: str) -> str | None:
    """mlx-lm's name of a GGUF tensor (or of one of the parts MLX splits a quantized one into)."""
    base, _, part = name.rpartition(".")
    if part not in {"weight", "bias", "scales", "biases"}:
        return None
    if base in _TOP:
        return f"{_TOP[base]}.{part}"
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if match and match[2] in _RENAMES and int(match[1]) < _MAX_LAYERS:
        return f"model.layers.{match[1]}.{_RENAMES[match[2]]}.{part}"
    return None


def _write_weights(
    path: Path, header: _Header, directory: Path, progress: Progress
) -> tuple[int, tuple[tuple[str, int], ...], tuple[str, ...]]:
    """Tensor by tensor, in layer order: each read (and repacked where `ExactReader` reads it), renamed, and
    written in shards; ``progress`` counts the file's tensor bytes done. Returns the bytes written, the count of
    each GGUF type and the types dequantized."""
    import mlx.core as mx

    try:
        arrays = mx.load(str(path), format="gguf")  # not from the name: an Ollama blob has no extension
    except (RuntimeError, ValueError) as exc:
        raise CorruptGGUF(f"MLX cannot read the tensors of {path.name} ({exc}): download it again") from None
    arrays.pop(_ROPE_FREQS, None)  # in config.json's rope_scaling now (`_llama3_scaling`)
    tensors = [t for t in header.tensors if t.name != _ROPE_FREQS]
    exact = ExactReader(header.reader) if any(t.kind in EXACT for t in tensors) else None
    shards = list(_shards(tensors))
    total, done, written, index = sum(t.nbytes for t in tensors), 0, 0, {}
    progress(0, total)
    for number, group in enumerate(shards, start=1):
        file = "model.safetensors" if len(shards) == 1 else f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        shard: dict[str, Any] = {}
        for t in group:
            parts = exact.read(t.name) if exact and t.kind in EXACT else {n: arrays[n] for n in _parts(t.name, arrays)}
            mx.eval(list(parts.values()))
            shard |= {_hf_name(name): array for name, array in parts.items()}
            for name in parts:
                arrays.pop(name, None)
            done += t.nbytes
            progress(done, total)
        mx.save_safetensors(str(directory / file), shard, metadata={"format": "mlx"})
        written += sum(a.nbytes for a in shard.values())
        index |= dict.fromkeys(shard, file)
    if arrays:
        raise CorruptGGUF(f"{path.name}: MLX read tensors its header does not list ({sorted(arrays)[:3]})")
    _write_json(directory / "model.safetensors.index.json", {"metadata": {"total_size": written}, "weight_map": index})
    counts: dict[str, int] = {}
    for t in header.tensors:
        counts[t.kind] = counts.get(t.kind, 0) + 1
    ordered = tuple(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
    return written, ordered, tuple(k for k in DEQUANTIZED if k in counts)


def _parts(name: str, arrays: dict[str, Any]) -> list[str]:
    """The arrays MLX's reader made of the GGUF tensor ``name``: itself, and a quantized one's scales and biases."""
    base = name.removesuffix(".weight")
    return [name, *(f"{base}.{part}" for part in ("scales", "biases") if name != base and f"{base}.{part}" in arrays)]


def _shards(tensors: list[_Tensor]) -> Iterator[list[_Tensor]]:
    """The tensors in layer order, cut into groups of at most ~_SHARD_BYTES of the file (a layer may straddle two:
    mlx-lm minds not)."""
    group: list[_Tensor] = []
    size = 0
    for t in sorted(tensors, key=lambda t: _layer_order(t.name)):
        if group and size + t.nbytes > _SHARD_BYTES:
            yield group
            group, size = [], 0
        group.append(t)
        size += t.nbytes
    if group:
        yield group


def _layer_order(name: str) -> tuple[int, str]:
    match = re.match(r"blk\.(\d+)\.", name)
    return (int(match[1]) if match else -1, name)


# --- tokenizer ----------------------------------------------------------------------------------------------------


def _write_tokenizer(header: _Header, architecture: str, directory: Path) -> None:
    from tokenizers import processors

    tokenizer_dict = {
        name: header.get(f"tokenizer.{key}")
        for key, name in _TOKENIZER_KEYS.items()
        if header.get(f"tokenizer.{key}") is not None
    }
    try:
        backend = _convert_tokenizer(architecture, tokenizer_dict)
    except ImportError:
        raise
    except Exception as exc:  # the tokenizers library's own errors are bare Exceptions ("Token `x` out of vocabulary")
        raise CorruptGGUF(f"the file's tokenizer cannot be built ({type(exc).__name__}: {exc})") from None
    tokens = tokenizer_dict["tokens"]

    def token(key: str) -> str | None:
        index = header.get(f"tokenizer.ggml.{key}")
        return tokens[index] if isinstance(index, int) and 0 <= index < len(tokens) else None

    bos, eos = token("bos_token_id"), token("eos_token_id")
    add_bos = bool(header.get("tokenizer.ggml.add_bos_token", tokenizer_dict.get("tokenizer_type") == "llama"))
    add_eos = bool(header.get("tokenizer.ggml.add_eos_token", False))
    single = " ".join([*([f"{bos}:0"] if add_bos and bos else []), "$A:0", *([f"{eos}:0"] if add_eos and eos else [])])
    named = [t for t in (bos, eos) if t]
    if unknown := [t for t in named if backend.token_to_id(t) is None]:  # spelled outside a byte-level alphabet
        raise UnsupportedGGUF(
            f"the file's special tokens {unknown} are not in its vocabulary as spelled: exod cannot build its "
            "tokenizer; convert the model with mlx_lm.convert from its Hugging Face repository"
        )
    backend.post_processor = processors.TemplateProcessing(
        single=single, special_tokens=[(t, backend.token_to_id(t)) for t in dict.fromkeys(named)]
    )
    backend.save(str(directory / "tokenizer.json"))
    template = header.get("tokenizer.chat_template")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id") or eos,
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": header.get(f"{architecture}.context_length", 4096),
    }
    if isinstance(template, str) and template:
        config["chat_template"] = template
    _write_json(directory / "tokenizer_config.json", config)
    ids = {key: header.get(f"tokenizer.ggml.{key}") for key in ("bos_token_id", "eos_token_id")}
    _write_json(directory / "generation_config.json", ids)


_TOKENIZER_KEYS = {
    "ggml.model": "tokenizer_type",
    "ggml.pre": "pre_tokenizer_type",
    "ggml.tokens": "tokens",
    "ggml.scores": "scores",
    "ggml.token_type": "token_type",
    "ggml.merges": "merges",
    "ggml.add_space_prefix": "add_prefix_space",
}


def _convert_tokenizer(architecture: str, tokenizer_dict: dict[str, Any]) -> Any:
    """transformers' own builder (what ``from_pretrained(gguf_file=…)`` uses): where it lives moved in 5.0."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # not "PyTorch was not found": no model is built here
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer
    except ImportError:  # transformers 4.x
        from transformers.integrations.ggml import convert_gguf_tokenizer

    return convert_gguf_tokenizer(architecture, tokenizer_dict)[0]


# --- checking and publishing ----------------------------------------------------------------------------------------


def _verify(directory: Path) -> None:
    """Load what was written as a runner will (lazily: nothing is computed), so a bad import fails here."""
    from exod.runner.mlx_import import import_mlx_lm

    import_mlx_lm()
    from mlx_lm.utils import load_model, load_tokenizer

    try:
        _, config = load_model(directory, lazy=True, strict=True)
        load_tokenizer(directory, eos_token_ids=config.get("eos_token_id"))
    except (ValueError, KeyError, TypeError, OSError) as exc:
        raise CorruptGGUF(f"the imported model does not load ({type(exc).__name__}: {exc})") from None


def _publish(repo_dir: Path, staging: Path, revision: str) -> Path:
    """Rename the finished directory into the cache's layout (snapshots/REV, refs/main) in one step each."""
    snapshot = repo_dir / "snapshots" / revision
    snapshot.parent.mkdir(parents=True, exist_ok=True)
    if snapshot.exists():  # the same file imported again: replace it whole
        old = staging.with_name(f".exod-replaced-{uuid.uuid4().hex}")
        os.replace(snapshot, old)
        shutil.rmtree(old, ignore_errors=True)
    os.replace(staging, snapshot)
    (repo_dir / "refs").mkdir(exist_ok=True)
    ref = repo_dir / "refs" / f".main.{uuid.uuid4().hex}"
    ref.write_text(revision)  # no trailing newline: huggingface_hub reads it verbatim
    os.replace(ref, repo_dir / "refs" / "main")
    return snapshot


def _write_json(path: Path, value: object) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.0f} MiB"


def _quiet(done: int, total: int) -> None:
    """No one asked for progress."""
