"""Constrained decoding: a request's output held to a JSON schema, a regular expression or a grammar, token by
token, inside the continuous batch.

llguidance (a Rust engine, one dependency-free wheel) compiles the constraint in milliseconds and, at each
step, says which tokens may come next; that set becomes a mask on the logits, as an mlx-lm logits processor
of the sequence's own. Every rank builds the same matcher from the same request and sees the same tokens,
so every rank masks alike and samples the same token. (xgrammar needs torch; outlines-core compiles
through a regex automaton that takes seconds on a real vocabulary: see the README.)

A constraint is a program a client hands the engine, so it is sized before it runs: compiled under explicit
limits (`LIMITS`) and walked for a few hundred bytes by `vet`, at admission in the daemon and again in the
runner, which refuses one that blows a limit (a schema that requires itself, a pattern repeated 10^9 times)
as the caller's 400. One that still fails mid-decode fails its own sequence alone (`ConstraintFailed`).

Forced tool calls are constrained too, where the model writes calls as JSON (``{"name": …, "arguments":
…}``, mlx-lm's ``json_tools`` parsers): the call's envelope is fixed text, the one exod writes into the prompt
(`exod.runner.tool_prompt.call_head`), the arguments are held to the tool's schema as compactly as a response
format (no whitespace between JSON tokens: a model that has not learned where to stop would otherwise spend
its ``max_tokens`` on it), and the call is closed with the tokenizer's end marker, so a forced call always
parses. Other call formats stay unconstrained.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import attrs

from exod.runner import protocol as p
from exod.runner.tool_prompt import call_head

# compact JSON: no runaway whitespace from a model that has not learned where to stop
_JSON_OPTIONS = {"whitespace_flexible": False}
# llguidance's defaults but for two: the lexer's states (1-2 kB each), 50,000 of which bound one request's
# memory; and the fuel of its first analysis (~50 per µs), a fifth of the default: a 300-property schema or a
# 5,000-value enum take under a tenth of it, and a pattern built to exhaust it costs 0.2 s, not 1-2 s
_MAX_LEXER_STATES = 50_000
_INITIAL_LEXER_FUEL = 200_000
PROBE_BYTES = 256  # how far `vet` walks a constraint: past where the bombs found so far go off (the first byte)


class GrammarError(ValueError):
    """The request's constraint cannot be compiled; the message names the part (the request's 400)."""


class ConstraintFailed(RuntimeError):
    """A constraint hit a limit mid-decode: its sequence ends with this error, the batch goes on."""


def limits() -> Any:
    """The limits every matcher of exod is compiled under: the admission's walk (`vet`) and the runner's alike."""
    import llguidance as llg

    return llg.LLParserLimits(max_lexer_states=_MAX_LEXER_STATES, initial_lexer_fuel=_INITIAL_LEXER_FUEL)


def vet(request: p.Generate) -> None:
    """Size the request's constraints before any runner decodes them: its ``grammar``, and the schema of each tool
    a forced call may take. Each is compiled under `limits` and walked for `PROBE_BYTES` over a tokenizer of
    single bytes, where what the model's tokens can reach, single bytes reach too. `GrammarError` (the caller's
    400) for one that cannot compile or blows a limit; needs no model, so any node can do it."""
    if request.grammar is not None:
        _walk(request.grammar, source(request.grammar))
    if request.tool_choice and request.tools:
        for tool in request.tools:
            function = tool.get("function") or {}
            if request.tool_choice in (p.REQUIRED, function.get("name")):
                schema = function.get("parameters") or {"type": "object"}
                _walk({"json_schema": schema}, source({"json_schema": schema}), f"tool {function.get('name')!r}: ")


def _walk(constraint: dict[str, Any], grammar: str, where: str = "") -> None:
    import llguidance as llg
    import llguidance.numpy as llnp
    import numpy as np

    tokenizer = _bytes_tokenizer()
    ((kind, _),) = constraint.items()
    failed, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer, limits=limits())
    if failed:
        raise GrammarError(f"{where}{kind}: {messages[0] if messages else 'the constraint cannot be compiled'}")
    matcher = llg.LLMatcher(tokenizer, grammar, log_level=0, limits=limits())
    mask = llnp.allocate_token_bitmask(1, tokenizer.vocab_size)
    for _ in range(PROBE_BYTES):
        llnp.fill_next_token_bitmask(matcher, mask)
        if matcher.is_error() or matcher.is_stopped():
            break
        allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[: tokenizer.vocab_size])
        choices = [int(b) for b in allowed if b != tokenizer.eos_token]
        if not choices:
            break
        closing = [b for b in _CLOSING if b in choices]  # ends strings, objects and arrays where it can
        if not matcher.consume_token(closing[0] if closing else choices[0]):
            break
    if matcher.is_error():
        error = matcher.get_error().split("\n", 1)[0]
        raise GrammarError(f"{where}{kind} is beyond what exod decodes (it exceeds a limit of the engine: {error})")


_CLOSING = b'"}]0'


@functools.cache
def _bytes_tokenizer() -> Any:
    """An LLTokenizer whose tokens are the 256 bytes and an end: the walk's, the same on every node."""
    import llguidance as llg

    return llg.LLTokenizer(llg.TokenizerWrapper(_Bytes()), n_vocab=257)


class _Bytes:
    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b""]
    special_token_ids = [256]

    def __call__(self, text: str | bytes) -> list[int]:
        return list(text.encode() if isinstance(text, str) else text)


def source(constraint: dict[str, Any]) -> str:
    """llguidance's grammar for a request's ``grammar`` field: one of ``json_schema`` (a schema),
    ``regex`` (a pattern), ``lark`` (a grammar in llguidance's Lark). `GrammarError` if it cannot be made."""
    import llguidance as llg

    if len(constraint) != 1:
        raise GrammarError(f"one constraint at a time, got {sorted(constraint)}")
    ((kind, spec),) = constraint.items()
    try:
        if kind == "json_schema":
            return llg.LLMatcher.grammar_from_json_schema(spec, defaults=_JSON_OPTIONS)
        if kind == "regex":
            return llg.LLMatcher.grammar_from_regex(spec)
        if kind == "lark":
            return llg.LLMatcher.grammar_from_lark(spec)
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"{kind}: {exc}") from None
    raise GrammarError(f"unknown constraint {kind!r}: json_schema, regex or lark")


def forced_call_grammar(tokenizer: Any, request: p.Generate) -> str | None:
    """The rest of a forced tool call, as a grammar: the prompt ended with its beginning
    (`exod.runner.output.forced_call`). None where calls are not written as JSON. Nothing in it is free
    whitespace: the envelope is fixed text and the arguments are compact JSON of the tool's schema."""
    import llguidance as llg

    if not request.tool_choice or not request.tools or not getattr(tokenizer, "has_tool_calling", False):
        return None
    if not getattr(tokenizer.tool_parser, "__module__", "").endswith(".json_tools"):
        return None
    schemas = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in request.tools}
    end = json.dumps("\n" + tokenizer.tool_call_end)
    if request.tool_choice == p.REQUIRED:  # the prompt ends with the marker: the whole call, any tool
        names = list(schemas)
        rules = [f"start: call {end}", "call: " + " | ".join(f"call_{i}" for i in range(len(names)))]
        for i, name in enumerate(names):
            rules.append(f'call_{i}: {json.dumps(call_head(name))} arguments_{i} "}}"')
            rules.append(f"arguments_{i}: %json {json.dumps(_compact(schemas[name]))}")
        return llg.LLMatcher.grammar_from_lark("\n".join(rules))
    if request.tool_choice not in schemas:
        raise GrammarError(f"tool_choice names {request.tool_choice!r}, which is not one of the tools")
    arguments = json.dumps(_compact(schemas[request.tool_choice]))  # the prompt ends with `call_head(name)`
    return llg.LLMatcher.grammar_from_lark(f'start: arguments "}}" {end}\narguments: %json {arguments}')


def _compact(schema: Any) -> Any:
    """A tool's parameter schema compiled as `source` compiles a response format's: `_JSON_OPTIONS`, where
    the schema's own ``x-guidance`` options may say otherwise (llguidance reads them only at its top)."""
    if not isinstance(schema, dict):
        return schema
    return {**schema, "x-guidance": {**_JSON_OPTIONS, **(schema.get("x-guidance") or {})}}


@attrs.define
class Grammars:
    """One model's side of the engine: its tokenizer as llguidance reads it (built once, on the first
    constrained request: about 2 s for a 150k vocabulary), and each request's matcher."""

    tokenizer: Any  # mlx-lm's TokenizerWrapper
    width: int  # the model's logits (its embedding rows, which may exceed the tokenizer's)
    _engine: Any = None

    def processor(self, request: p.Generate) -> GrammarProcessor | None:
        """The request's constraint as a logits processor, or None if it has none; `GrammarError` if it
        cannot be compiled."""
        import llguidance as llg

        forced = forced_call_grammar(self.tokenizer, request)
        if request.grammar is None and forced is None:
            return None
        if request.grammar is not None and forced is not None:
            raise GrammarError("a forced tool call and a response format at once: ask for one of them")
        grammar = forced if forced is not None else source(request.grammar)  # type: ignore[arg-type]
        vet(request)  # sized again here: a command that did not come through a daemon's admission
        failed, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, self._tokenizer(), limits=limits())
        if failed:
            raise GrammarError(messages[0] if messages else "the constraint cannot be compiled")
        matcher = llg.LLMatcher(self._tokenizer(), grammar, log_level=0, limits=limits())
        return GrammarProcessor(matcher, self.width)

    def _tokenizer(self) -> Any:
        if self._engine is None:
            import llguidance.hf

            try:
                self._engine = llguidance.hf.from_tokenizer(
                    self.tokenizer._tokenizer, n_vocab=self.width, eos_token=self.tokenizer.eos_token_id
                )
            except Exception as exc:  # e.g. a slow (pure Python) tokenizer: the request's error, not the runner's
                raise GrammarError(
                    f"this model's tokenizer cannot be constrained ({type(exc).__name__}: {exc})"
                ) from exc
        return self._engine


class GrammarProcessor:
    """An mlx-lm logits processor: ``(tokens, logits) -> logits`` with what the constraint forbids at -inf.

    Its first call sees the prompt; each later call's last token is the one sampled at the step before,
    which the matcher takes before it says what may follow. Once the constraint is complete only the end of
    sequence may follow, so the generation stops there (``stop``), or at ``max_tokens`` (``length``)."""

    def __init__(self, matcher: Any, width: int) -> None:
        import llguidance.numpy as llnp

        self.matcher, self.width = matcher, width
        self.mask = llnp.allocate_token_bitmask(1, width)
        self.started = False

    def __call__(self, tokens: Any, logits: Any) -> Any:
        import llguidance.numpy as llnp
        import mlx.core as mx
        import numpy as np

        if self.started and not self.matcher.consume_token(int(tokens[-1].item())):
            raise ConstraintFailed(f"the constraint failed at this token: {self._error()}")
        self.started = True
        llnp.fill_next_token_bitmask(self.matcher, self.mask)
        if self.matcher.is_error():
            raise ConstraintFailed(f"the constraint failed after {len(tokens)} tokens: {self._error()}")
        columns = logits.shape[-1]
        allowed = np.unpackbits(self.mask.view(np.uint8), axis=-1, count=columns, bitorder="little").view(np.bool_)
        return mx.where(mx.array(allowed), logits, mx.array(-mx.inf, dtype=logits.dtype))

    def _error(self) -> str:
        return self.matcher.get_error().split("\n", 1)[0]
