"""Token counting and the model's own tokenizer over HTTP: Anthropic's ``/v1/messages/count_tokens``, and vLLM's
``/tokenize`` and ``/detokenize``.

Each is a request that reads the prompt and generates nothing (``max_tokens`` 0, the prompt echoed): the
runners tokenize it exactly as a generation would (the chat template, the tools, a forced call's beginning),
so a count is never an estimate, and it works the same on any node of a cluster.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, Field

from exod.api.chat import LENIENT, MAX_MESSAGES, ChatMessage, Text, Tool
from exod.api.errors import ApiError, responses
from exod.api.generation import Generation, Output
from exod.api.messages import MessagesRequest
from exod.controller import Controller

MAX_TOKEN_IDS = 1 << 20


class CountTokensRequest(MessagesRequest):
    """Anthropic's count_tokens: a Messages request without ``max_tokens`` (nothing is generated)."""

    max_tokens: int | None = Field(None, ge=1)  # type: ignore[assignment]  # not asked for here


class TokenizeRequest(BaseModel):
    """vLLM's: a raw ``prompt``, or chat ``messages`` (with ``tools``) as the chat template renders them."""

    model_config = LENIENT

    model: Text = Field(..., min_length=1, max_length=200)
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=MAX_MESSAGES)
    tools: list[Tool] | None = Field(None, max_length=128)


class DetokenizeRequest(BaseModel):
    model_config = LENIENT

    model: Text = Field(..., min_length=1, max_length=200)
    tokens: list[int] = Field(..., min_length=1, max_length=MAX_TOKEN_IDS)


async def read(generation: Generation, **prompt: Any) -> Output:
    """The prompt as the model reads it, from the runners; errors as any generation's."""
    await generation.start(max_tokens=0, echo_prompt=True, **prompt)
    [output] = await generation.outputs()
    return output


def router(controller: Controller, metrics: Any, _max_tokens_ceiling: int) -> APIRouter:
    api = APIRouter()

    @api.post("/v1/messages/count_tokens", responses=responses(400, 404, 429, 502, 503, anthropic=True))
    async def count_tokens(body: CountTokensRequest) -> dict[str, int]:
        """Anthropic's token count of a Messages request: what ``input_tokens`` would be."""
        generation = Generation(controller, metrics, body.model)
        output = await read(
            generation, messages=body.chat_messages(), tools=body.chat_tools(), tool_choice=body.forced_tool()
        )
        assert output.done is not None
        return {"input_tokens": output.done.prompt_tokens}

    @api.post("/tokenize", responses=responses(400, 404, 429, 502, 503))
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        """vLLM's: the prompt's token ids, how many, and the model's context (``max_model_len``)."""
        generation = Generation(
            controller, metrics, body.model, prompt="prompt" if body.messages is None else "messages"
        )
        if (body.prompt is None) == (body.messages is None):
            raise generation.rejected(ApiError(400, "send a prompt or messages: exactly one of them", param="prompt"))
        if body.messages is None:
            output = await read(generation, prompt_text=body.prompt)
        else:
            tools = [t.for_template() for t in body.tools or []] or None
            output = await read(generation, messages=[m.for_template() for m in body.messages], tools=tools)
        assert output.prompt is not None
        context = controller.model_card(body.model).context_length
        return {"count": len(output.prompt.tokens), "max_model_len": context, "tokens": output.prompt.tokens}

    @api.post("/detokenize", responses=responses(400, 404, 429, 502, 503))
    async def detokenize(body: DetokenizeRequest) -> dict[str, str]:
        """vLLM's: the text of token ids."""
        output = await read(Generation(controller, metrics, body.model, prompt="tokens"), prompt_tokens=body.tokens)
        assert output.prompt is not None
        return {"prompt": output.prompt.text}

    return api
