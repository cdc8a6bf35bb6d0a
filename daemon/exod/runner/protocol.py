"""The control protocol between a supervisor and one runner process.

Theory of operation
-------------------
The supervisor creates a Unix ``socketpair()``; the child end is inherited by the
runner process (``pass_fds``) and named on its command line as ``--control-fd N``.
stdout and stderr are *not* the channel: they go to log files, so a stray print
from a library can never corrupt the protocol.

Every message is one line of JSON (UTF-8, ``\\n``-terminated) with a ``"type"`` tag.

* supervisor → runner: `Connect`, `Load`, `WarmUp`, `Generate`, `Cancel`, `Shutdown`, `Ping`.
* runner → supervisor: `Status`, `Progress`, `Token`, `ToolCall`, `Done`, `RequestError`,
  `Failed`, `Pong`; each carries ``runner_id`` and ``incarnation`` so that a late line from
  an older process can be recognised as stale by the runner machine.

End of file on the channel means the other side is gone: the runner exits 0 at
once; the supervisor treats it as "the process is ending" and waits for the exit.
A line that is not a valid message raises `ProtocolError`, never a bare
``KeyError``/``ValueError`` from the codec.
"""

from __future__ import annotations

import enum
import errno
import json
from typing import Any, ClassVar

import attrs
import cattrs

MAX_LINE_BYTES = 1 << 20  # a line longer than this is a protocol error, not a memory leak
# The host's failures (`Failed.host`): they say nothing about the model, so they spend no retry
# (fsm.FailureKind.HOST). Both sides classify with it: the runner its exceptions, the daemon a failed spawn.
HOST_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOSPC, errno.EADDRINUSE})


class ProtocolError(Exception):
    """A line on the control channel is not a valid message."""


class Phase(enum.Enum):
    """What a runner reports it is doing (mirrors the sub-phases of `fsm.runner.RunnerPhase`)."""

    JOINING = "joining"  # in the distributed init
    JOINED = "joined"  # this rank is in the group
    WEIGHTS = "weights"  # reading weights; `Progress` follows
    LOADED = "loaded"  # local weights in memory; waiting for the other ranks
    WARMING_UP = "warming_up"
    READY = "ready"


REQUIRED = "required"  # `Generate.tool_choice`: the model must call a tool, whichever


class FinishReason(enum.Enum):
    STOP = "stop"  # end-of-sequence token or a stop string
    LENGTH = "length"  # max_tokens reached
    TOOL_CALLS = "tool_calls"  # the model called a tool (`ToolCall`) and stopped
    CANCELLED = "cancelled"  # its caller went away (`Cancel`): only the request book hears of it


# -- base classes -----------------------------------------------------------------


@attrs.frozen
class Message:
    """Base of every message; ``type`` is the wire tag."""

    type: ClassVar[str]

    def to_json(self) -> str:
        """One line of JSON, without the trailing newline."""
        body = _converter.unstructure(self)
        return json.dumps({"type": self.type, **body}, separators=(",", ":"), ensure_ascii=False)

    def to_line(self) -> bytes:
        return (self.to_json() + "\n").encode()


@attrs.frozen
class Command(Message):
    """supervisor → runner."""


@attrs.frozen
class Report(Message):
    """runner → supervisor: names the process it comes from."""

    runner_id: str
    incarnation: int


# -- supervisor → runner ----------------------------------------------------------


@attrs.frozen
class Connect(Command):
    """Join the distributed group (world_size > 1 only): hostfile and rank come from argv/env."""

    type = "connect"


@attrs.frozen
class Load(Command):
    """Load ``model_path`` (a local snapshot directory) — this rank's shard of it."""

    type = "load"
    model_path: str
    layers_total: int | None = None  # informative; the runner reports the real count


@attrs.frozen
class WarmUp(Command):
    type = "warm_up"


@attrs.frozen
class Generate(Command):
    """One request. Every rank of an instance gets every Generate, in the same order.

    Exactly one of ``prompt_messages`` (chat messages, run through the model's chat
    template), ``prompt_text`` (a raw prompt, tokenized as it is) and ``prompt_tokens``
    (already tokenized) is given.
    """

    type = "generate"
    request_id: str
    prompt_messages: list[dict[str, Any]] | None = None
    prompt_tokens: list[int] | None = None
    prompt_text: str | None = None
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: every token may be sampled
    seed: int | None = None  # None: derived from request_id, identical on every rank
    stop: list[str] = attrs.field(factory=list)
    tools: list[dict[str, Any]] | None = None  # OpenAI function tools, for the chat template
    tool_choice: str | None = None  # None: the model decides; REQUIRED: some tool; else the function's name
    logprobs: int | None = None  # None: none; k: each token's log-probability and the k likeliest
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None  # token id (as JSON keys are strings) → added to its logit
    echo_prompt: bool = False  # rank 0 first says the prompt as the model reads it (`Prompt`)
    grammar: dict[str, Any] | None = None  # the output's constraint: {"json_schema"|"regex"|"lark": …}
    embed: bool = False  # the prompt's embedding instead of a generation (with max_tokens 0): `Embedding`
    prompt_logprobs: int | None = None  # with echo_prompt: each prompt token's log-probability and k others

    def __attrs_post_init__(self) -> None:
        given = [x for x in (self.prompt_messages, self.prompt_tokens, self.prompt_text) if x is not None]
        if len(given) != 1:
            raise ProtocolError("Generate needs exactly one of prompt_messages, prompt_text and prompt_tokens")
        if self.embed and self.max_tokens:
            raise ProtocolError("an embedding generates nothing: max_tokens must be 0")
        if self.max_tokens < 0:
            raise ProtocolError(
                f"max_tokens must be >= 0 (0: the prompt only, nothing generated), got {self.max_tokens}"
            )

    def outside(self, vocabulary: int) -> tuple[str, str] | None:
        """The first token id this request names that is no row of the model's ``vocabulary`` embeddings, as
        (field, message); None if every one is a row. An id beyond the table is read out of bounds, which
        kills the process: the daemon checks before a runner sees the request, the runner again before it runs."""
        bound = f"this model's token ids are 0 to {vocabulary - 1}"
        for token in self.prompt_tokens or ():
            if not 0 <= token < vocabulary:
                return "prompt_tokens", f"token id {token} is not in the vocabulary: {bound}"
        for key in self.logit_bias or {}:
            token = _token_id(key)
            if token is None or not 0 <= token < vocabulary:
                return "logit_bias", f"logit_bias key {key!r} is not a token id of this model: {bound}"
        return None


def _token_id(key: str) -> int | None:
    try:
        return int(key)
    except ValueError:
        return None


@attrs.frozen
class Cancel(Command):
    """Drop a request whose caller went away. Every rank gets it in the same place among the other commands,
    so every rank drops it at the same step of the batch; a request already finished ignores it."""

    type = "cancel"
    request_id: str


@attrs.frozen
class Shutdown(Command):
    type = "shutdown"


@attrs.frozen
class Ping(Command):
    """Say you are alive: the thread that reads the channel answers `Pong` at once, whatever the model is doing
    (`exod.host.heartbeats`), so a stopped or wedged process is told from a busy one."""

    type = "ping"


# -- runner → supervisor ----------------------------------------------------------


@attrs.frozen
class Status(Report):
    type = "status"
    phase: Phase


@attrs.frozen
class Batching(Report):
    """What the runner decodes at once, decided when it made its batch (before Ready), and why."""

    type = "batching"
    max_sequences: int
    why: str
    vocabulary: int = 0  # the model's embedding rows, which every token id must be below (0: not said)


@attrs.frozen
class Progress(Report):
    type = "progress"
    layers_loaded: int
    layers_total: int


@attrs.frozen
class Alternative:
    """A token the model could have chosen, with its log-probability."""

    token_id: int
    text: str
    logprob: float


@attrs.frozen
class Token(Report):
    """A piece of streamed output (rank 0 only). ``token_id`` is None for a final flush of text.

    With `Generate.logprobs`: the chosen token with its log-probability, and the likeliest alternatives."""

    type = "token"
    request_id: str
    text: str
    token_id: int | None
    chosen: Alternative | None = None  # the token, its own text and log-probability
    top_logprobs: list[Alternative] | None = None


@attrs.frozen
class ToolCall(Report):
    """The model called a tool (rank 0 only): its text between the tokenizer's tool-call markers, parsed."""

    type = "tool_call"
    request_id: str
    name: str
    arguments: str  # JSON text, as OpenAI's clients expect it


@attrs.frozen
class Heartbeat(Report):
    """Generation goes on (ranks > 0, which send no tokens, say so every few tokens: their watchdog's food)."""

    type = "heartbeat"
    request_id: str
    tokens: int


@attrs.frozen
class Pong(Report):
    """The answer to a `Ping`, from the thread that reads the channel (never queued behind the model's work)."""

    type = "pong"


@attrs.frozen
class Done(Report):
    """A request finished (every rank sends it: each runner's busy → available)."""

    type = "done"
    request_id: str
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    stop_sequence: str | None = None  # the stop string that ended it (Anthropic's clients ask which)
    cached_tokens: int = 0  # prompt tokens whose KV cache came from an earlier request (the prompt cache)
    batch_size: int = 1  # the most requests decoded together while this one ran (an embedding: in its pass)
    prompt_cache_bytes: int = 0  # what this rank's prompt cache holds once it finished


@attrs.frozen
class Prompt(Report):
    """The prompt as the model reads it (rank 0 only, asked by ``Generate.echo_prompt``): its tokens and their
    text. What token counting, ``/tokenize`` and ``/detokenize`` answer."""

    type = "prompt"
    request_id: str
    tokens: list[int]
    text: str
    logprobs: list[Alternative | None] | None = None  # asked: each token's given what precedes (the first: None)
    top_logprobs: list[list[Alternative]] | None = None  # … and the likeliest others there


@attrs.frozen
class Embedding(Report):
    """The prompt's embedding (rank 0 only, asked by ``Generate.embed``): the last layer's hidden states,
    mean-pooled over the prompt's tokens and L2-normalised, computed in one pass with the other inputs queued
    (`exod.runner.batch.embeddings`); its `Done` says how many shared that pass (``batch_size``)."""

    type = "embedding"
    request_id: str
    vector: list[float]


@attrs.frozen
class RequestError(Report):
    """This request was refused or failed before generation; the runner stays Ready."""

    type = "request_error"
    request_id: str
    message: str
    invalid: bool = False  # the request itself is at fault (its prompt is over the context): the caller's 400
    prompt_tokens: int | None = None  # with ``context``: the prompt did not fit the model's context
    context: int | None = None
    grammar: bool = False  # the output's constraint could not be compiled (`exod.runner.grammar`)


@attrs.frozen
class Failed(Report):
    """The runner is dying of an exception; it exits non-zero right after sending this."""

    type = "failed"
    exception_type: str
    message: str
    traceback: str
    retryable: bool
    host: bool = False  # the host's failure, not the model's (a ring port taken, no fds or disk): uncharged
    peer: bool = False  # the ring lost a peer: the consequence of another rank's failure, not its cause


COMMANDS: tuple[type[Command], ...] = (Connect, Load, WarmUp, Generate, Cancel, Shutdown, Ping)
REPORTS: tuple[type[Report], ...] = (
    Status,
    Batching,
    Progress,
    Token,
    ToolCall,
    Heartbeat,
    Pong,
    Done,
    Prompt,
    Embedding,
    RequestError,
    Failed,
)
_BY_TAG: dict[str, type[Message]] = {cls.type: cls for cls in (*COMMANDS, *REPORTS)}

_converter = cattrs.Converter(forbid_extra_keys=True)


def from_json(line: str | bytes) -> Message:
    """Decode one line; anything else than a known, complete, well-typed message is a `ProtocolError`."""
    if len(line) > MAX_LINE_BYTES:
        raise ProtocolError(f"line of {len(line)} bytes exceeds {MAX_LINE_BYTES}")
    try:
        data = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"not JSON: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("type"), str):
        raise ProtocolError(f"not a tagged object: {str(line)[:200]}")
    cls = _BY_TAG.get(data.pop("type"))
    if cls is None:
        raise ProtocolError(f"unknown message type in {str(line)[:200]}")
    try:
        return _converter.structure(data, cls)
    except ProtocolError:
        raise
    except Exception as exc:  # cattrs raises ClassValidationError/TypeError/ValueError in many shapes
        detail = cattrs.transform_error(exc) if isinstance(exc, cattrs.BaseValidationError) else exc
        raise ProtocolError(f"invalid {cls.type} message: {detail}") from exc


def _strict_scalar(expected: type) -> Any:
    """cattrs by default coerces ``"3"`` to 3 and 3 to ``"3"``: on a wire protocol that hides bugs."""

    def structure(value: Any, _type: Any) -> Any:
        ok = isinstance(value, expected) and not (expected is not bool and isinstance(value, bool))
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if not ok:
            raise TypeError(f"expected {expected.__name__}, got {value!r}")
        return value

    return structure


for _t in (str, int, float, bool):
    _converter.register_structure_hook(_t, _strict_scalar(_t))


class LineReader:
    """Splits a byte stream into lines; bounded, so a peer that never sends ``\\n`` cannot exhaust memory."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        self._buffer += data
        *lines, rest = self._buffer.split(b"\n")
        if len(rest) > MAX_LINE_BYTES:
            raise ProtocolError(f"unterminated line longer than {MAX_LINE_BYTES} bytes")
        self._buffer = bytearray(rest)
        return [bytes(line) for line in lines if line.strip()]

    @property
    def pending(self) -> bytes:
        """Bytes after the last newline (a truncated message if the stream has ended)."""
        return bytes(self._buffer)
