"""Token counting and the model's own tokenizer over HTTP: Anthropic's ``/v1/messages/count_tokens``, and vLLM's
``/tokenize``, ``/detokenize`` and ``/tokenizer_info`` (each at the root and under ``/v1``, where tools look).

Each is a request that reads the prompt and generates nothing (``max_tokens`` 0, the prompt echoed): the
runners tokenize it exactly as a generation would (the chat template, the tools, a forced call's beginning),
so a count is never an estimate, and it works the same on any node of a cluster.

lm-eval's remote tokenizer (``lm_eval/utils.py``: ``check_remote_tokenizer_support``, ``RemoteTokenizer``) names
no model: it asks ``GET /tokenizer_info`` for ``eos_token`` and ``chat_template``, and sends ``/tokenize``
``{"prompt", "add_special_tokens"}`` and ``/detokenize`` ``{"tokens"}``. So ``model`` may be left out wherever
one model is served, as vLLM (which serves one) takes it.
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

    model: Text | None = Field(None, min_length=1, max_length=200, description="optional where one model is served")
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=MAX_MESSAGES)
    tools: list[Tool] | None = Field(None, max_length=128)
    add_special_tokens: bool = Field(
        True, description="accepted; the prompt is encoded as a completion's is (the tokenizer's own special tokens)"
    )


class DetokenizeRequest(BaseModel):
    model_config = LENIENT

    model: Text | None = Field(None, min_length=1, max_length=200, description="optional where one model is served")
    tokens: list[int] = Field(..., min_length=1, max_length=MAX_TOKEN_IDS)


def served_model(controller: Controller, given: str | None) -> str:
    """``given``, or the one model served here where it is left out (as vLLM, which serves one, takes it);
    a 400 naming the choices where there are several, a 404 where there is none."""
    if given is not None:
        return given
    served = controller.placed_models()
    if len(served) == 1:
        return served[0]
    if not served:
        raise ApiError(
            404, "no model is served here: place one (exod place MODEL)", param="model", code="model_not_found"
        )
    raise ApiError(400, f"model: several are served ({', '.join(served)}); name one of them", param="model")


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
    @api.post("/v1/tokenize", responses=responses(400, 404, 429, 502, 503))
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        """vLLM's: the prompt's token ids, how many, and the model's context (``max_model_len``)."""
        model = served_model(controller, body.model)
        generation = Generation(controller, metrics, model, prompt="prompt" if body.messages is None else "messages")
        if (body.prompt is None) == (body.messages is None):
            raise generation.rejected(ApiError(400, "send a prompt or messages: exactly one of them", param="prompt"))
        if body.messages is None:
            output = await read(generation, prompt_text=body.prompt)
        else:
            tools = [t.for_template() for t in body.tools or []] or None
            output = await read(generation, messages=[m.for_template() for m in body.messages], tools=tools)
        assert output.prompt is not None
        context = controller.model_card(model).context_length
        return {"count": len(output.prompt.tokens), "max_model_len": context, "tokens": output.prompt.tokens}

    @api.post("/detokenize", responses=responses(400, 404, 429, 502, 503))
    @api.post("/v1/detokenize", responses=responses(400, 404, 429, 502, 503))
    async def detokenize(body: DetokenizeRequest) -> dict[str, str]:
        """vLLM's: the text of token ids."""
        model = served_model(controller, body.model)
        output = await read(Generation(controller, metrics, model, prompt="tokens"), prompt_tokens=body.tokens)
        assert output.prompt is not None
        return {"prompt": output.prompt.text}

    @api.get("/tokenizer_info", responses=responses(400, 404))
    @api.get("/v1/tokenizer_info", responses=responses(400, 404))
    async def get_tokenizer_info(model: str | None = None) -> dict[str, Any]:
        """vLLM's: the tokenizer's configuration (``eos_token``, ``bos_token``, ``pad_token``, ``chat_template``,
        ``tokenizer_class`` …), from the model's files on this node; ``model`` where several are served (any model
        in this node's cache may be named: one placed on demand too)."""
        name = served_model(controller, model)
        tokenizer = controller.model_card(name).tokenizer
        if tokenizer is None:
            raise ApiError(
                404,
                f"no tokenizer of {name!r} on this node (its files hold no readable tokenizer_config.json, or the "
                "model is not here): GET /v1/models lists the models served",
                param="model",
                code="model_not_found",
            )
        return {**tokenizer, "name_or_path": name}  # what transformers' init_kwargs, and so vLLM, say: its name

    return api
