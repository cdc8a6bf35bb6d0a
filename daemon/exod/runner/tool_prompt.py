"""Tools for a model whose chat template takes none (SmolLM2's, most GGUF templates): exod writes them itself.

Refusing ``tools`` (as Ollama does for such models) would leave every agent framework without a way to use
the model; ignoring them (as the template alone would) would answer as if no tool existed. Instead, as LM
Studio does, the tools go into the system turn in the words Qwen2.5's template uses (the format small
instruct models have seen most: a JSON object between ``<tool_call>`` markers), earlier calls and their
results become text in that format, and the answer's calls are read back with mlx-lm's ``json_tools``
parser. A forced call (``tool_choice``) is then held to the tool's schema by the grammar like any other
(`exod.runner.grammar`), so it is valid whatever the model knows of tools; a free choice is the model's.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

__all__ = ["JSON_TOOLS", "call_head", "takes_tools", "with_tools"]

JSON_TOOLS = {"tool_parser_type": "json_tools"}  # mlx-lm's tokenizer option: <tool_call>{json}</tool_call>

_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    'XML tags:\n<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def call_head(name: str) -> str:
    """How a JSON tool call begins, up to its arguments: as the preamble shows it and `_call` writes it, and as
    the prompt of a call forced by name ends (`exod.runner.output.forced_call`). The grammar of a forced call
    writes it so too (`exod.runner.grammar`): fixed text, no whitespace for the model to choose."""
    return '{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": '


def takes_tools(chat_template: Any) -> bool:
    """Whether a chat template renders the tools it is given (a template that never names them does not)."""
    return "tools" in (chat_template if isinstance(chat_template, str) else json.dumps(chat_template))


def with_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` as a template without tools can render them: the tools in the system turn, each earlier
    call as the assistant wrote it, each result in a user turn."""
    listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    preamble = _PREAMBLE.format(tools=listed)
    out: list[dict[str, Any]] = []
    for message in messages:
        role, content = message.get("role"), message.get("content") or ""
        if role == "assistant" and message.get("tool_calls"):
            calls = "".join(f"\n<tool_call>\n{_call(call)}\n</tool_call>" for call in message["tool_calls"])
            out.append({"role": "assistant", "content": f"{content}{calls}".lstrip("\n")})
        elif role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            out.append({"role": role, "content": content})
    if out and out[0]["role"] == "system":
        out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{preamble}"}
    else:
        out.insert(0, {"role": "system", "content": preamble})
    return out


def _call(call: dict[str, Any]) -> str:
    function = call.get("function", call)
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        with contextlib.suppress(ValueError):  # else written as the client sent it
            arguments = json.loads(arguments)
    return json.dumps({"name": function.get("name"), "arguments": arguments}, ensure_ascii=False)
