"""Embeddings from the placed model: OpenAI's ``/v1/embeddings`` (and, through `embed`, Ollama's
``/api/embed``).

Each input is a request like any other, computed by the instance's runners (every rank of a pipeline runs
its layers): the last layer's hidden states mean-pooled and L2-normalised (`exod.runner.batch.embeddings`).
The inputs of one call are submitted together, a few at a time (`gathered`), so the runners take them in the
same step and embed them in one forward pass (``exod_embedding_batch_size`` in ``/metrics`` says how many).
"""

from __future__ import annotations

import base64
import functools
import struct
from typing import Any, Literal

from fastapi import APIRouter
from pydantic import BaseModel, Field

from exod.api.chat import LENIENT, MAX_MESSAGE_CHARS, Text
from exod.api.errors import ApiError, responses
from exod.api.generation import Generation, gathered
from exod.controller import Controller

MAX_INPUTS = 2048  # OpenAI's own bound on one call's inputs


class EmbeddingsRequest(BaseModel):
    """OpenAI's: ``input`` a string, strings, token ids, or lists of token ids; ``encoding_format`` float or
    base64 (the OpenAI SDK asks for base64 by default and decodes it); ``dimensions`` only as the model has."""

    model_config = LENIENT

    model: Text = Field(..., min_length=1, max_length=200)
    input: Text | list[Text] | list[int] | list[list[int]] = Field(
        ..., description="a string, strings, token ids, or lists of token ids"
    )
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: Text | None = Field(None, max_length=256)

    def inputs(self) -> list[dict[str, Any]]:
        """Each input as a prompt of its own; a 400 naming the one that is empty or too long."""
        given = self.input
        if isinstance(given, str) or (given and all(isinstance(x, int) for x in given)):
            given = [given]  # type: ignore[list-item]
        if not given:
            raise ApiError(400, "input is empty: send a string, or a list of them", param="input")
        if len(given) > MAX_INPUTS:
            raise ApiError(400, f"at most {MAX_INPUTS} inputs per request, got {len(given)}", param="input")
        prompts = []
        for i, item in enumerate(given):
            if not item:
                raise ApiError(400, f"input.{i} is empty", param=f"input.{i}")
            if isinstance(item, str) and len(item) > MAX_MESSAGE_CHARS:
                raise ApiError(400, f"input.{i}: at most {MAX_MESSAGE_CHARS} characters", param=f"input.{i}")
            prompts.append({"prompt_text": item} if isinstance(item, str) else {"prompt_tokens": list(item)})
        return prompts


async def embed(
    controller: Controller, metrics: Any, model: str, prompts: list[dict[str, Any]]
) -> tuple[list[list[float]], int]:
    """Every prompt's embedding, in order, and the tokens read; errors as any generation's (the first one).
    A few at a time (`gathered`): a list of 2,048 is not refused as over the instance's bound."""

    async def one(prompt: dict[str, Any]) -> tuple[list[float], int]:
        generation = Generation(controller, metrics, model, prompt="input")
        await generation.start(max_tokens=0, embed=True, **prompt)
        [output] = await generation.outputs()
        assert output.embedding is not None and output.done is not None
        return output.embedding.vector, output.done.prompt_tokens

    done = await gathered(controller, [functools.partial(one, prompt) for prompt in prompts])
    vectors, tokens = [v for v, _ in done], [n for _, n in done]
    label = metrics.label(model)
    metrics.embedded.labels(label).inc(len(prompts))
    metrics.embedded_tokens.labels(label).inc(sum(tokens))
    return vectors, sum(tokens)


def router(controller: Controller, metrics: Any, _max_tokens_ceiling: int) -> APIRouter:
    api = APIRouter()

    @api.post("/v1/embeddings", responses=responses(400, 404, 429, 502, 503))
    async def embeddings(body: EmbeddingsRequest) -> dict[str, Any]:
        vectors, tokens = await embed(controller, metrics, body.model, body.inputs())
        width = len(vectors[0])
        if body.dimensions is not None and body.dimensions != width:
            raise ApiError(400, not_honoured(body.dimensions, width), param="dimensions")
        data = [
            {"object": "embedding", "index": i, "embedding": _encoded(v, body.encoding_format)}
            for i, v in enumerate(vectors)
        ]
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        return {"object": "list", "data": data, "model": body.model, "usage": usage}

    return api


def not_honoured(dimensions: int, width: int) -> str:
    """Why ``dimensions`` cannot be given, and the one value that can. Embeddings here are the last layer's
    hidden states, mean-pooled: cut short they are not a smaller embedding of the same text, as they are of a
    model trained for it (Matryoshka), so none shorter is offered, and none longer can be."""
    return (
        f"dimensions: {dimensions} cannot be honoured: this model's embeddings have {width} dimensions, and "
        f"the only value dimensions can take is {width} (or leave it out). exod does not cut embeddings "
        "shorter: they are the model's mean-pooled hidden states, which no model was trained to keep meaning "
        "when cut (Matryoshka)"
    )


def _encoded(vector: list[float], encoding: str) -> list[float] | str:
    """As floats, or as OpenAI's base64: the float32 values, little-endian."""
    if encoding == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
