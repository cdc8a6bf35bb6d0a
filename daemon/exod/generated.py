"""What one generation said, as the request book hands it to the front end: text with its log-probabilities,
tool calls, and how it ended.

Domain values, not the runner's wire messages: the book translates rank 0's reports
(`exod.runner.protocol`) into these, so the dialects never depend on the wire, and the wire can change
without touching them.
"""

from __future__ import annotations

import enum

import attrs


class FinishReason(enum.Enum):
    STOP = "stop"  # end-of-sequence token or a stop string
    LENGTH = "length"  # max_tokens reached, or the model's context
    TOOL_CALLS = "tool_calls"  # the model called a tool and stopped
    CANCELLED = "cancelled"  # its caller went away


@attrs.frozen
class Alternative:
    """A token the model could have chosen, with its log-probability."""

    token_id: int
    text: str
    logprob: float


@attrs.frozen
class Token:
    """A piece of the output. ``token_id`` is None for a final flush of text held back (a stop string's
    possible start). With log-probabilities asked for: the chosen token's, and the likeliest alternatives."""

    text: str
    token_id: int | None
    chosen: Alternative | None = None
    top_logprobs: list[Alternative] | None = None


@attrs.frozen
class ToolCall:
    """The model called a tool: its name and arguments (JSON text, as OpenAI's clients expect them)."""

    name: str
    arguments: str


@attrs.frozen
class Done:
    """The generation ended: why, what it counted, and how it was served."""

    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    stop_sequence: str | None = None  # the stop string that ended it (Anthropic's clients ask which)
    cached_tokens: int = 0  # prompt tokens whose KV came from an earlier request (the prompt cache)
    batch_size: int = 1  # the most requests decoded together while this one ran (an embedding: in its pass)
    prompt_cache_bytes: int = 0  # what rank 0's prompt cache holds once it finished


@attrs.frozen
class Prompt:
    """The prompt as the model read it, when asked: its tokens and their text."""

    tokens: list[int]
    text: str
    logprobs: list[Alternative | None] | None = None  # asked: each token's, given those before (the first: None)
    top_logprobs: list[list[Alternative]] | None = None


@attrs.frozen
class Embedding:
    """A prompt's embedding (normalised)."""

    vector: list[float]


Said = Token | ToolCall | Done | Prompt | Embedding
