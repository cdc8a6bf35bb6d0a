"""A model's tokenizer as vLLM's ``/tokenizer_info`` describes it, from the files of its directory.

What tools that tokenize through the server read (lm-eval's remote tokenizer: ``eos_token``, ``bos_token``,
``pad_token``, ``chat_template``). vLLM answers with its tokenizer's ``init_kwargs``: ``tokenizer_config.json``
as transformers read it, file paths left out, special tokens as their text, plus the class and the chat
template. The same is read here from the files, without loading transformers into the daemon.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

SPECIAL = ("bos_token", "eos_token", "pad_token", "unk_token", "sep_token", "cls_token", "mask_token")
_PATHS = ("vocab_file", "merges_file", "tokenizer_file")  # this node's paths: nothing a client can use


def tokenizer_info(directory: Path) -> dict[str, Any] | None:
    """``tokenizer_config.json`` of ``directory`` as vLLM's ``/tokenizer_info`` gives it; special tokens it
    leaves out taken from ``special_tokens_map.json``, the chat template from ``chat_template.jinja`` where
    the config has none (transformers' newer layout). None where there is no readable config (it only
    describes: never an error)."""
    config = _read(directory / "tokenizer_config.json")
    if config is None:
        return None
    info: dict[str, Any] = {key: _text(value) for key, value in config.items() if key not in _PATHS}
    for key, value in (_read(directory / "special_tokens_map.json") or {}).items():
        if key in SPECIAL and info.get(key) is None:
            info[key] = _text(value)
    template = _chat_template(config.get("chat_template"))
    if template is None:
        with contextlib.suppress(OSError, ValueError):
            template = (directory / "chat_template.jinja").read_text()
    info.pop("chat_template", None)
    if template is not None:
        info["chat_template"] = template
    info.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    return info


def _read(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _text(value: Any) -> Any:
    """A special token written as transformers' ``AddedToken`` (``{"content": …, "lstrip": …}``) as its text,
    as vLLM serialises it; within lists and mappings too (``added_tokens_decoder``: id → text)."""
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    if isinstance(value, dict):
        return {key: _text(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_text(item) for item in value]
    return value


def _chat_template(value: Any) -> str | None:
    """The template transformers would use: the text, or of named templates the one named ``default``."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        default = named.get("default")
        return default if isinstance(default, str) else None
    return None
