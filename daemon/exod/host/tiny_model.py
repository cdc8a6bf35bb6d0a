"""A deterministic tiny model in the Hugging Face cache layout.

No machine here reaches a model hub, so the demo and the tests need a model the project can make itself:
random weights from a seeded RNG, a byte-level BPE tokenizer trained on a small embedded corpus, and the
files ``mlx_lm.load`` and ``mlx_lm.sharded_load`` expect. Identical arguments give identical bytes, and the
snapshot revision is a content hash, so a cache entry can be compared across runs and machines.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import attrs

from exod.host.models import hub_cache_dir, validate_model_id

__all__ = [
    "SUPPORTED_ARCHS",
    "InvalidTinyModelArgs",
    "TinyModelSpec",
    "make_tiny_model",
]

SUPPORTED_ARCHS = ("qwen2", "llama")

EOS_TOKEN = "<|im_end|>"
BOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (BOS_TOKEN, "<|im_start|>", EOS_TOKEN)
# 256 byte-level symbols plus the special tokens: a smaller vocabulary cannot encode arbitrary text.
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)

# ChatML, the format qwen2 uses; simple enough for any jinja2 and closes every turn with the eos token.
# ChatML, with tools as Qwen2.5 writes them: the tools in the system turn, each call between <tool_call>
# markers as JSON {"name", "arguments"}, each result in a user turn between <tool_response> markers. mlx-lm
# infers its json_tools parser from this template (it names <tool_call> and tool_call.name).
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{ '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{ '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n<tools>' }}"
    "{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{ '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}'
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{ '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{ '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{%- for tool_call in message['tool_calls'] %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{ \'\\n<tool_call>\\n{\\"name\\": \\"\' + tool_call.name + \'\\", \\"arguments\\": \' }}'
    "{{ tool_call.arguments if tool_call.arguments is string else (tool_call.arguments | tojson) }}"
    "{{ '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{%- elif not (message['role'] == 'system' and loop.first) %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Fixed training text: the tokenizer (and so the model bytes) must not depend on anything outside this file.
_CORPUS = (
    "The quick brown fox jumps over the lazy dog.",
    "A finite-state machine has states, events and transitions; every state has a way out.",
    "The daemon starts runner processes, watches them, and restarts them when they fail.",
    "Hello! How are you today? I am fine, thank you. What would you like to talk about?",
    "The model is loaded, warmed up, and then serves chat completions over HTTP.",
    "Pipeline parallel splits the layers across ranks; tensor parallel splits each layer.",
    "user: what is the capital of France? assistant: The capital of France is Paris.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 42 100 1000 3.14 2.71",
    "def main():\n    print('hello world')\n    return 0\n",
    "Once upon a time there was a little model that generated tokens very quickly.",
    "Errors should say what happened and what to do next, in plain words.",
    "The cache lives under HF_HOME/hub/models--org--name/snapshots/<revision>/.",
)


class InvalidTinyModelArgs(ValueError):
    """An argument of :func:`make_tiny_model` cannot produce a loadable model."""


@attrs.frozen
class TinyModelSpec:
    """The validated shape of a tiny model; the single source for config.json and the weights."""

    repo_id: str
    arch: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab_size: int
    seed: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def validate(self) -> None:
        """Raise :class:`InvalidTinyModelArgs` (or ``InvalidModelId``) naming the argument to change."""
        validate_model_id(self.repo_id)  # raises InvalidModelId, also a ValueError
        if self.arch not in SUPPORTED_ARCHS:
            raise InvalidTinyModelArgs(f"arch {self.arch!r} is not supported; use one of {', '.join(SUPPORTED_ARCHS)}")
        for name in ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidTinyModelArgs(f"{name} must be a positive integer, got {value!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise InvalidTinyModelArgs(f"seed must be a non-negative integer, got {self.seed!r}")
        if self.hidden % self.heads:
            raise InvalidTinyModelArgs(
                f"hidden ({self.hidden}) must be divisible by heads ({self.heads}); e.g. hidden=64, heads=4"
            )
        if self.head_dim % 2:
            raise InvalidTinyModelArgs(
                f"hidden/heads = {self.head_dim} must be even for rotary embeddings; change hidden or heads"
            )
        if self.heads % self.kv_heads:
            raise InvalidTinyModelArgs(
                f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads}); e.g. heads=4, kv_heads=2"
            )
        if self.vocab_size < MIN_VOCAB_SIZE:
            raise InvalidTinyModelArgs(
                f"vocab_size must be at least {MIN_VOCAB_SIZE} (256 bytes + {len(SPECIAL_TOKENS)} special tokens), "
                f"got {self.vocab_size}"
            )


def make_tiny_model(
    repo_id: str = "exod/tiny-qwen2",
    *,
    arch: str = "qwen2",
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    vocab_size: int = 512,
    seed: int = 0,
    hf_home: Path | None = None,
) -> Path:
    """Write a tiny random model into the HF cache under ``hf_home`` and return its snapshot directory.

    ``hf_home`` defaults to the cache huggingface_hub would use (``$HF_HUB_CACHE``, ``$HF_HOME/hub``, ...).

    The snapshot revision is the sha1 of the file names and bytes, and ``refs/main`` points to it, so
    ``snapshot_download(repo_id, local_files_only=True)`` finds the model without a network.
    """
    spec = TinyModelSpec(repo_id, arch, layers, hidden, heads, kv_heads, intermediate, vocab_size, seed)
    spec.validate()
    files = _build_files(spec)
    rev = _content_hash(files)

    repo_dir = hub_cache_dir(hf_home) / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo_dir / "snapshots" / rev
    snapshot.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        _write_atomic(snapshot / name, data)
    (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
    _write_atomic(repo_dir / "refs" / "main", rev.encode())  # no trailing newline: HF reads it verbatim
    return snapshot


def _write_atomic(path: Path, data: bytes) -> None:
    """Write via a temporary file and rename, so a concurrent reader never sees a half-written file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _content_hash(files: dict[str, bytes]) -> str:
    h = hashlib.sha1(usedforsecurity=False)
    for name in sorted(files):
        h.update(name.encode() + b"\0" + len(files[name]).to_bytes(8, "little") + files[name])
    return h.hexdigest()


def _json_bytes(obj: object) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode()


def _build_files(spec: TinyModelSpec) -> dict[str, bytes]:
    tokenizer_json, special_ids = _train_tokenizer(spec.vocab_size)
    weights = _random_weights(spec)
    safetensors_bytes = _safetensors_bytes(weights)
    index = {
        "metadata": {"total_size": sum(int(w.nbytes) for w in weights.values())},
        "weight_map": dict.fromkeys(sorted(weights), "model.safetensors"),
    }
    return {
        "config.json": _json_bytes(_config(spec, special_ids)),
        "generation_config.json": _json_bytes(
            {"bos_token_id": special_ids[BOS_TOKEN], "eos_token_id": special_ids[EOS_TOKEN], "do_sample": False}
        ),
        "model.safetensors": safetensors_bytes,
        "model.safetensors.index.json": _json_bytes(index),
        "tokenizer.json": tokenizer_json,
        "tokenizer_config.json": _json_bytes(_tokenizer_config()),
    }


def _config(spec: TinyModelSpec, special_ids: dict[str, int]) -> dict[str, object]:
    common: dict[str, object] = {
        "model_type": spec.arch,
        "hidden_size": spec.hidden,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "intermediate_size": spec.intermediate,
        "vocab_size": spec.vocab_size,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "bos_token_id": special_ids[BOS_TOKEN],
        "eos_token_id": special_ids[EOS_TOKEN],
        "torch_dtype": "float32",
        "exod_tiny_model": {"seed": spec.seed, "repo_id": spec.repo_id},
    }
    if spec.arch == "qwen2":
        common["architectures"] = ["Qwen2ForCausalLM"]
    else:
        common["architectures"] = ["LlamaForCausalLM"]
        common["head_dim"] = spec.head_dim
        common["attention_bias"] = False
        common["mlp_bias"] = False
    return common


def _tokenizer_config() -> dict[str, object]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": BOS_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
        "chat_template": CHAT_TEMPLATE,
    }


def _train_tokenizer(vocab_size: int) -> tuple[bytes, dict[str, int]]:
    """Train a byte-level BPE; the trainer is deterministic for a fixed corpus and vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Repeating the corpus changes no merge order but makes pair counts unambiguous enough for many merges.
    tok.train_from_iterator(list(_CORPUS) * 4, trainer=trainer)
    if tok.get_vocab_size() > vocab_size:  # pragma: no cover - the trainer honours vocab_size
        raise InvalidTinyModelArgs(f"tokenizer grew to {tok.get_vocab_size()} > vocab_size {vocab_size}")
    special_ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    # Round-trip through json with sorted keys: the Rust serializer's map order is not something to rely on.
    data = json.loads(tok.to_str())
    return _json_bytes(data), special_ids


def _random_weights(spec: TinyModelSpec) -> dict[str, object]:
    """Weights in HF names (what mlx_lm's sanitize expects), drawn in a fixed order from one seeded RNG."""
    import numpy as np

    rng = np.random.default_rng(spec.seed)
    h, hd, i_size = spec.hidden, spec.head_dim, spec.intermediate
    q_out, kv_out = spec.heads * hd, spec.kv_heads * hd
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (spec.vocab_size, h))]
    for layer in range(spec.layers):
        p = f"model.layers.{layer}."
        shapes += [
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (q_out, h)),
            (p + "self_attn.k_proj.weight", (kv_out, h)),
            (p + "self_attn.v_proj.weight", (kv_out, h)),
            (p + "self_attn.o_proj.weight", (h, q_out)),
            (p + "mlp.gate_proj.weight", (i_size, h)),
            (p + "mlp.up_proj.weight", (i_size, h)),
            (p + "mlp.down_proj.weight", (h, i_size)),
        ]
        if spec.arch == "qwen2":  # qwen2 has q/k/v biases, llama has none
            shapes += [
                (p + "self_attn.q_proj.bias", (q_out,)),
                (p + "self_attn.k_proj.bias", (kv_out,)),
                (p + "self_attn.v_proj.bias", (kv_out,)),
            ]
    shapes.append(("model.norm.weight", (h,)))

    weights = {}
    for name, shape in shapes:
        if name.endswith("norm.weight"):
            weights[name] = np.ones(shape, dtype=np.float32)
        elif name.endswith(".bias"):
            weights[name] = np.zeros(shape, dtype=np.float32)
        else:
            weights[name] = (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype("<f4")
    return weights


def _safetensors_bytes(weights: dict[str, object]) -> bytes:
    """Serialize with one metadata key: safetensors sorts tensors itself, but a multi-key map may not be ordered."""
    from safetensors.numpy import save

    return save(dict(sorted(weights.items())), metadata={"format": "pt"})
