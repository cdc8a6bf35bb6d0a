"""Forced tool calls through the clients that failed on them (#48): a real `exod serve` on the tiny model,
each client's own way of forcing a call, streamed and not, in every dialect that has one.

A random-weight model decoded greedily spends any whitespace the grammar allows (before the grammar was made
compact, every one of these ran into ``max_tokens`` on whitespace and came back without a call). Each must
now get a call its client parses, whose arguments validate against the tool's schema, within the tokens the
longest compact call can take. Ollama's API has no ``tool_choice``: nothing is forced there.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import anthropic
import jsonschema
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field
from test_batching_api import loopback_only

from daemon_harness import placing, ready_daemon, runner_pids
from exod.runner.tool_prompt import call_head

MODEL = "exod/tiny-qwen2"
CONFIG = placing(MODEL)


class Weather(BaseModel):
    """The weather where the user asks."""

    model_config = ConfigDict(extra="forbid")  # what a strict tool says: no property beyond these
    city: str = Field(max_length=12)
    unit: Literal["C", "F"]


SCHEMA = Weather.model_json_schema()
NAME = "get_weather"
TOOLS = [{"type": "function", "function": {"name": NAME, "parameters": SCHEMA}}]
RESPONSES_TOOLS = [{"type": "function", "name": NAME, "parameters": SCHEMA}]
CLAUDE_TOOLS = [{"name": NAME, "input_schema": SCHEMA}]
ASK = [{"role": "user", "content": "Weather?"}]
# A bound, not a guess: one token is at least a byte, the longest character a string may hold is 12 bytes
# (an escaped surrogate pair), and the end of sequence is one token more. Whitespace runs go far past it.
MOST = len((call_head(NAME) + '{"city":"","unit":"C"}}\n</tool_call>').encode()) + 12 * 12 + 1
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": MOST}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with ready_daemon(tmp_path_factory.mktemp("forced"), CONFIG, {MODEL: 0}) as (url, _):
        yield url
    assert runner_pids() == []


@pytest.fixture
def client(daemon):
    return openai.OpenAI(base_url=f"{daemon}/v1", api_key="unused", max_retries=0, timeout=60)


def valid(arguments: str | dict[str, Any]) -> Weather:
    """The call's arguments, as the tool's schema and its pydantic model both read them."""
    parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    jsonschema.validate(parsed, SCHEMA)
    return Weather.model_validate(parsed)


NAMED = {"type": "function", "function": {"name": NAME}}


@pytest.mark.parametrize("choice", ["required", NAMED], ids=["required", "named"])
def test_openais_chat_completions_get_a_valid_call_streamed_or_not(client, choice):
    done = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, **GREEDY)
    (call,) = done.choices[0].message.tool_calls
    assert done.choices[0].finish_reason == "tool_calls" and call.function.name == NAME
    valid(call.function.arguments)
    assert done.usage.completion_tokens < MOST
    with client.chat.completions.stream(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, **GREEDY) as stream:
        streamed = stream.get_final_completion()
    (call,) = streamed.choices[0].message.tool_calls
    assert streamed.choices[0].finish_reason == "tool_calls" and call.function.name == NAME
    assert valid(call.function.arguments) == valid(done.choices[0].message.tool_calls[0].function.arguments)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": NAME}], ids=["required", "named"])
def test_openais_responses_get_a_valid_function_call_streamed_or_not(client, choice):
    asked = {"model": MODEL, "input": "Weather?", "tools": RESPONSES_TOOLS, "tool_choice": choice, "temperature": 0}
    done = client.responses.create(**asked, max_output_tokens=MOST)
    (item,) = [item for item in done.output if item.type == "function_call"]
    assert done.status == "completed" and item.name == NAME
    valid(item.arguments)
    events = list(client.responses.create(**asked, max_output_tokens=MOST, stream=True))
    last = events[-1].response
    (streamed,) = [item for item in last.output if item.type == "function_call"]
    assert last.status == "completed" and valid(streamed.arguments) == valid(item.arguments)


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": NAME}], ids=["any", "tool"])
def test_anthropics_messages_get_a_valid_tool_use_streamed_or_not(daemon, choice):
    claude = anthropic.Anthropic(base_url=daemon, api_key="unused", max_retries=0, timeout=60)
    asked = {"model": MODEL, "max_tokens": MOST, "messages": ASK, "tools": CLAUDE_TOOLS}
    asked["extra_body"] = {"temperature": 0}  # this client no longer takes it as an argument
    done = claude.messages.create(**asked, tool_choice=choice)
    (block,) = [b for b in done.content if b.type == "tool_use"]
    assert done.stop_reason == "tool_use" and block.name == NAME
    valid(block.input)
    with claude.messages.stream(**asked, tool_choice=choice) as stream:
        final = stream.get_final_message()
    (streamed,) = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and valid(streamed.input) == valid(block.input)


def test_langchains_structured_output_by_function_calling_gets_an_instance(daemon):
    """LangChain's ``with_structured_output(method="function_calling")`` forces the schema's tool by name and
    parses its arguments into the model."""
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(
        model=MODEL, base_url=f"{daemon}/v1", api_key="unused", max_retries=0, temperature=0, max_tokens=MOST
    )
    answer = chat.with_structured_output(Weather, method="function_calling").invoke("Weather?")
    assert isinstance(answer, Weather)
    valid(answer.model_dump())


@pytest.mark.parametrize("choice", ["required", NAMED], ids=["required", "named"])
def test_litellm_gets_a_valid_call(daemon, monkeypatch, choice):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    monkeypatch.setenv("LITELLM_OFFLINE_MODE", "true")
    tried = loopback_only(monkeypatch)
    import litellm

    done = litellm.completion(
        model=f"openai/{MODEL}",
        api_base=f"{daemon}/v1",
        api_key="unused",
        messages=ASK,
        tools=TOOLS,
        tool_choice=choice,
        num_retries=0,
        timeout=60,
        **GREEDY,
    )
    (call,) = done.choices[0].message.tool_calls
    assert done.choices[0].finish_reason == "tool_calls" and call.function.name == NAME
    valid(call.function.arguments)
    assert tried == []
