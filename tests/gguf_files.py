"""GGUF files for the importer's tests, written as llama.cpp's ``convert_hf_to_gguf.py`` would write them.

No GGUF can be downloaded here, so the tests make their own from the tiny models of
:mod:`exod.host.tiny_model`: the same metadata keys, tensor names, tensor types and (for a llama) the same
permutation of the Q and K projections that llama.cpp applies. An imported file can then be compared, logit for
logit, with the model directory it was written from.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "K_QUANTS",
    "QUANTIZED",
    "SPM_CORPUS",
    "TYPES",
    "gguf_from_tiny_model",
    "gguf_name",
    "header_layout",
    "spm_gguf_from_tiny_model",
]

TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")  # what gguf.quants can write and the importer keeps
QUANTIZED = ("Q8_0", "Q4_0", "Q4_1")
K_QUANTS = ("Q2_K", "Q4_K", "Q6_K")  # no quantizer in gguf.quants: written as random blocks, rows of 256
# Where the f16 scales lie in a block of each K-quant (ggml-common.h: block_q2_K, block_q4_K, block_q6_K).
_SCALES = {"Q2_K": (80, 82), "Q4_K": (0, 2), "Q6_K": (208,)}

_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}

# Words for the SentencePiece vocabulary: what the tests encode is spelled from these (and bytes for the rest).
SPM_CORPUS = "The quick brown fox jumps over the lazy dog. Hello world, how are you today? Numbers 0 1 2 3 42."


def gguf_name(hf_name: str) -> str:
    """llama.cpp's name of a Hugging Face tensor's (``model.layers.0.mlp.up_proj.weight`` → ``blk.0.ffn_up.weight``)."""
    base, _, part = hf_name.rpartition(".")
    if base in _TOP:
        return f"{_TOP[base]}.{part}"
    match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", base)
    if match is None or match[2] not in _LAYER:
        raise ValueError(f"no GGUF name for {hf_name!r}")
    return f"blk.{match[1]}.{_LAYER[match[2]]}.{part}"


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's ``LlamaModel.permute``: Q and K rows reordered for llama.cpp's interleaved RoPE."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_from_tiny_model(
    model_dir: Path,
    out: Path,
    *,
    tensor_type: str = "F32",
    architecture: str | None = None,
    permute_qk: bool = True,
    metadata: dict[str, Any] | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
) -> Path:
    """Write ``model_dir`` (a tiny llama or qwen2) to the GGUF file ``out`` as llama.cpp would, and return ``out``.

    ``tensor_type`` is one of `TYPES` (2-D matrices whose rows are a multiple of its block long take it; norms and
    biases stay F32, as llama.cpp keeps them), or any other GGML type name (`K_QUANTS`, ``Q5_0``…), whose tensors
    are then random blocks of the right size (a K-quant's with small scales; its rows must be 256 long).
    ``architecture`` writes another ``general.architecture`` (its keys named after it); ``permute_qk=False`` skips
    llama.cpp's Q/K permutation (a wrong file, to prove a test notices). ``metadata`` adds or replaces
    string/int/float/bool keys, after all the others; ``extra_tensors`` are written as they are (F32), after them.
    """
    config = json.loads((model_dir / "config.json").read_text())
    weights = _load_weights(model_dir)
    arch = config["model_type"]
    writer = _writer(out, architecture or arch, config)
    _add_bpe_tokenizer(writer, model_dir)
    _add_metadata(writer, metadata or {})
    _add_tensors(writer, weights, config, tensor_type=tensor_type, permute_qk=permute_qk and arch == "llama")
    for name, data in (extra_tensors or {}).items():
        writer.add_tensor(name, data.astype(np.float32))
    _finish(writer)
    return out


def spm_gguf_from_tiny_model(model_dir: Path, out: Path, *, add_bos: bool | None = True) -> tuple[Path, list[str]]:
    """A tiny llama's weights with a SentencePiece ("llama") vocabulary, as Llama 2 and Mistral files have.

    The vocabulary is made here, as long as the model's embedding: ``<unk>``, ``<s>``, ``</s>``, the 256 byte
    tokens ``<0x00>``…``<0xFF>`` (type 6), then the characters and ``▁``-prefixed words of `SPM_CORPUS` with
    every prefix of each (so the merges derived from the scores reach every word), then filler pieces.
    ``add_bos=None`` leaves ``tokenizer.ggml.add_bos_token`` out. Returns the file and the vocabulary.
    """
    config = json.loads((model_dir / "config.json").read_text())
    weights = _load_weights(model_dir)
    vocab = _spm_vocab(config["vocab_size"])
    writer = _writer(out, config["model_type"], config)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(vocab)
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(vocab) - 259)])
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * (len(vocab) - 259))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    if add_bos is not None:  # older files say nothing, and llama.cpp adds BOS to a SentencePiece vocabulary then
        writer.add_add_bos_token(add_bos)
    writer.add_add_eos_token(False)
    _add_tensors(writer, weights, config, tensor_type="F32", permute_qk=True)
    _finish(writer)
    return out, vocab


# --- the parts --------------------------------------------------------------------------------------------------


def _load_weights(model_dir: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(model_dir / "model.safetensors"))


def _writer(out: Path, arch: str, config: dict[str, Any]) -> Any:
    import gguf

    writer = gguf.GGUFWriter(out, arch)
    writer.add_type("model")
    writer.add_name(config.get("exod_tiny_model", {}).get("repo_id", "tiny").split("/")[-1])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_theta"])
    if config["model_type"] == "llama":
        writer.add_rope_dimension_count(config["hidden_size"] // config["num_attention_heads"])
    writer.add_file_type(0)
    return writer


def _add_metadata(writer: Any, metadata: dict[str, Any]) -> None:
    for key, value in metadata.items():
        writer.kv_data[0].pop(key, None)  # replaced, not warned about
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_string(key, value)


def _add_bpe_tokenizer(writer: Any, model_dir: Path) -> None:
    """The byte-level BPE of tokenizer.json as llama.cpp's ``_set_vocab_gpt2`` writes it."""
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    vocab: dict[str, int] = dict(tokenizer["model"]["vocab"])
    special = {t["content"]: t["id"] for t in tokenizer.get("added_tokens", [])}
    vocab |= special
    by_id = {i: t for t, i in vocab.items()}
    size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(size)]  # padded to the embedding, as llama.cpp does
    types = [3 if t in special else (5 if i not in by_id else 1) for i, t in enumerate(tokens)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab[tokenizer_config["bos_token"]])
    writer.add_eos_token_id(vocab[tokenizer_config["eos_token"]])
    writer.add_pad_token_id(vocab[tokenizer_config["pad_token"]])
    writer.add_add_bos_token(False)
    writer.add_chat_template(tokenizer_config["chat_template"])


def _add_tensors(
    writer: Any, weights: dict[str, np.ndarray], config: dict[str, Any], *, tensor_type: str, permute_qk: bool
) -> None:
    import gguf

    qtype = gguf.GGMLQuantizationType[tensor_type]
    rng = np.random.default_rng(0)
    for name in sorted(weights, key=_order):
        data = weights[name].astype(np.float32)
        if permute_qk and name.endswith("q_proj.weight"):
            data = permute(data, config["num_attention_heads"])
        elif permute_qk and name.endswith("k_proj.weight"):
            data = permute(data, config["num_key_value_heads"])
        target = gguf_name(name)
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        if data.ndim != 2 or data.shape[-1] % block or qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(target, data)  # norms and biases: F32, as llama.cpp keeps them
        elif tensor_type in TYPES:
            writer.add_tensor(target, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:  # no quantizer here (K-quants) or a type the importer refuses: random blocks of the right size
            blocks = rng.integers(0, 256, (data.size // block, type_size), dtype=np.uint8)
            for at in _SCALES.get(tensor_type, ()):  # small f16 scales: finite weights, as a real file's
                blocks[:, at : at + 2] = np.frombuffer(np.float16(1e-3).tobytes(), dtype=np.uint8)
            writer.add_tensor(target, blocks.reshape(data.shape[0], -1), raw_dtype=qtype)


def _order(name: str) -> tuple[int, str]:
    """llama.cpp's order: the embedding, then layer by layer, then the final norm and output."""
    parts = name.split(".")
    if len(parts) > 2 and parts[1] == "layers":
        return (int(parts[2]), name)
    return (-1, name) if "embed" in name else (1 << 20, name)


def _finish(writer: Any) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _spm_vocab(size: int) -> list[str]:
    words = SPM_CORPUS.replace(".", " .").replace(",", " ,").replace("?", " ?").split()
    pieces = ["▁", *sorted(set(SPM_CORPUS.replace(" ", "")))]
    for word in words:
        spelled = "▁" + word
        pieces += [spelled[:end] for end in range(2, len(spelled) + 1)]
        pieces += [word[:end] for end in range(2, len(word) + 1)]
    vocab = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    vocab += list(dict.fromkeys(p for p in pieces if p not in vocab))
    if len(vocab) > size:
        raise ValueError(f"the SentencePiece vocabulary needs {len(vocab)} rows; make the model's vocab_size larger")
    return vocab + [f"▁filler{i}" for i in range(size - len(vocab))]


# --- damaging a file ----------------------------------------------------------------------------------------------


def header_layout(path: Path) -> dict[str, int]:
    """Byte offsets of the fields a damaged file would get wrong, for patching them.

    ``tensor_count`` and ``kv_count`` (u64s), ``merge_end`` (one past the last byte of the first merge's text),
    ``tensor_infos`` (where the first tensor's description begins), the first tensor's ``first_dim`` (its
    fastest-moving side, a u64), ``first_type`` (u32) and ``first_offset`` (u64, from the start of the data), and
    ``data_offset`` (where the tensor data begins).
    """
    import gguf

    reader = gguf.GGUFReader(path)
    merges = reader.fields["tokenizer.ggml.merges"]
    first_merge = merges.parts[merges.data[0]]
    field = reader.tensors[0].field
    name_len, name, n_dims, dims, _, _ = field.parts
    first_dim = field.offset + int(name_len.nbytes + name.nbytes + n_dims.nbytes)
    return {
        "tensor_count": 8,
        "kv_count": 16,
        "merge_end": _offset(reader, first_merge) + int(first_merge.nbytes),
        "tensor_infos": field.offset,
        "first_dim": first_dim,
        "first_type": first_dim + int(dims.nbytes),
        "first_offset": first_dim + int(dims.nbytes) + 4,
        "data_offset": int(reader.data_offset),
    }


def _offset(reader: Any, part: np.ndarray) -> int:
    """Where a part the reader parsed lies in the file (each is a view of the reader's map of it)."""
    return part.__array_interface__["data"][0] - reader.data.__array_interface__["data"][0]
