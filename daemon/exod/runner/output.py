"""What one generation says, as it comes: text, tool calls, stop strings and log-probabilities.

The runner's decoding loop hands each step here; what leaves is `Token` and `ToolCall` reports (rank 0
only: the other ranks compute the same and stay silent) and, at the end, whether and why it stopped.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from exod.runner import protocol as p
from exod.runner.tool_prompt import call_head

log = logging.getLogger("exod.runner")

Send = Callable[..., None]  # `exod.runner.process.Channel.send`: a report class and its fields


class Output:
    """What one generation says, as it comes: text held back while it could be the start of a stop string
    or of a tool call, tool calls parsed once complete (the tokenizer's markers and parser, as mlx-lm's),
    and each token's log-probabilities when asked for."""

    def __init__(self, tokenizer: Any, request: p.Generate, send: Send, *, speaks: bool) -> None:
        self.tokenizer, self.request, self.send, self.speaks = tokenizer, request, send, speaks
        calls = bool(request.tools) and getattr(tokenizer, "has_tool_calling", False)
        self.start: str | None = tokenizer.tool_call_start if calls else None
        self.end: str | None = tokenizer.tool_call_end if calls else None
        self.parser = tokenizer.tool_parser if calls else None
        self.pending = ""  # text not sent yet
        self.call: str | None = None  # inside a tool call: its text so far
        if forced := forced_call(tokenizer, request):  # the prompt began the call: the output is inside it
            self.call = forced.removeprefix(self.start or "")
        self.tool_calls = 0
        self.tokens = 0
        self.stop_sequence: str | None = None  # the stop string that ended the generation, if one did

    def add(self, text: str, token_id: int | None, logprobs_row: Any = None) -> bool:
        """Take one step of the generation (its text, token and log-probabilities over the vocabulary); True
        once a stop string was hit (the generation ends)."""
        self.tokens += token_id is not None
        logprobs = self._logprobs(token_id, logprobs_row)
        if self.call is not None:
            self.call += text
            self._finish_call()
            self._send("", token_id, logprobs)
            return False
        self.pending += text
        if self.start is not None and (at := self.pending.find(self.start)) >= 0:
            before, self.call = self.pending[:at], self.pending[at + len(self.start) :]
            self.pending = ""
            hit = _first_stop(before, self.request.stop)
            self._send(before if hit is None else before[: hit[0]], token_id, logprobs)
            if hit is not None:
                self.stop_sequence = hit[1]
                return True
            self._finish_call()
            return False
        hit = _first_stop(self.pending, self.request.stop)
        if hit is not None:
            self._send(self.pending[: hit[0]], token_id, logprobs)
            self.pending, self.stop_sequence = "", hit[1]
            return True
        keep = _stop_prefix_len(self.pending, [*self.request.stop, *([self.start] if self.start else [])])
        self._send(self.pending[: len(self.pending) - keep], token_id, logprobs)
        self.pending = self.pending[len(self.pending) - keep :]
        return False

    def flush(self) -> None:
        if self.call is not None:  # a tool call cut short (max_tokens): its text, as it is
            self.pending += (self.start or "") + self.call
            self.call = None
        self._send(self.pending, None, (None, None))
        self.pending = ""

    def _finish_call(self) -> None:
        assert self.call is not None and self.end is not None and self.parser is not None
        at = self.call.find(self.end)
        if at < 0:
            return
        body, rest = self.call[:at], self.call[at + len(self.end) :]
        self.call = None
        try:
            parsed = self.parser(body, self.request.tools)
        except Exception as exc:  # not a call after all: it stays text
            log.warning("tool call not parsed (%s): %r", exc, body[:200])
            self.pending += f"{self.start}{body}{self.end}"
        else:
            for call in parsed if isinstance(parsed, list) else [parsed]:
                arguments = call.get("arguments", {})
                arguments = arguments if isinstance(arguments, str) else json.dumps(arguments)
                if self.speaks:
                    name = str(call["name"])
                    self.send(p.ToolCall, request_id=self.request.request_id, name=name, arguments=arguments)
                self.tool_calls += 1
        self.pending += rest.lstrip("\n") if self.tool_calls else rest

    def _send(self, text: str, token_id: int | None, logprobs: tuple[Any, Any]) -> None:
        if self.speaks and (text or token_id is not None):
            chosen, top = logprobs
            fields = {"text": text, "token_id": token_id, "chosen": chosen, "top_logprobs": top}
            self.send(p.Token, request_id=self.request.request_id, **fields)

    def _logprobs(self, token_id: int | None, row: Any) -> tuple[Any, Any]:
        k = self.request.logprobs
        if k is None or token_id is None or row is None or not self.speaks:
            return None, None
        import mlx.core as mx

        values = row.reshape(-1)
        decode = self.tokenizer.decode
        chosen = p.Alternative(token_id, decode([token_id]), float(values[token_id].item()))
        if k == 0:
            return chosen, []
        ids = mx.argpartition(-values, kth=k - 1)[:k].tolist()
        top = sorted((p.Alternative(i, decode([i]), float(values[i].item())) for i in ids), key=lambda a: -a.logprob)
        return chosen, top


def forced_call(tokenizer: Any, request: p.Generate) -> str:
    """The beginning of a tool call the prompt ends with, when the request forces one (``tool_choice``): the
    tokenizer's tool-call marker, and for a named function in the JSON form (``{"name": …, "arguments": …}``)
    its name too. The model can then only go on with the call. Empty when nothing is forced."""
    choice = request.tool_choice
    if not choice or not request.tools or not getattr(tokenizer, "has_tool_calling", False):
        return ""
    start = tokenizer.tool_call_start + "\n"
    json_calls = getattr(tokenizer.tool_parser, "__module__", "").endswith(".json_tools")
    if choice == p.REQUIRED or not json_calls:  # another form names the function its own way: any call, then
        return start
    return start + call_head(choice)


def _first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """Where the first stop string in ``text`` begins, and which one it is."""
    hits = [(i, s) for s in stops if s and (i := text.find(s)) >= 0]
    return min(hits) if hits else None


def _stop_prefix_len(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best
