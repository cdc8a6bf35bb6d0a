"""Tool calls and the other dialects — OpenAI's Responses, Anthropic's Messages — end to end: a real `exod
serve`, a real runner, the tiny model, the official `openai` and `anthropic` clients.

A random-weight model never calls a tool, so this daemon's runners emit a given text instead of sampling
(`[script]`, a test-only hook like fault injection); the tokens are the tiny model's, the log-probabilities
its own. The tools still reach the prompt through the tiny model's chat template, and the call is parsed
with the tokenizer's markers and parser, as mlx-lm does."""

from __future__ import annotations

import json
import time

import anthropic
import httpx
import openai
import pytest

from daemon_harness import ready_daemon, runner_pids

MODEL = "exod/tiny-qwen2"
SAID = "Let me check."
CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
SCRIPT = SAID + "<tool_call>\n" + json.dumps(CALL) + "\n</tool_call>"
CONFIG = f"""
[daemon]
port = 0
offline = true

[script]
text = {json.dumps(SCRIPT)}

[[place]]
model = "{MODEL}"
ranks = 1
"""
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city, now.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
ENOUGH = 200  # tokens: the script is about 70 of the tiny model's


def serving(tmp_path_factory, name: str, script: str):
    """A daemon whose runners emit ``script``, until the module is done with it."""
    config = CONFIG.replace(json.dumps(SCRIPT), json.dumps(script))
    with ready_daemon(tmp_path_factory.mktemp(name), config, {MODEL: 0}) as (url, _):
        yield url


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    yield from serving(tmp_path_factory, "dialects", SCRIPT)
    assert runner_pids() == []  # torn down last (set up first): no daemon of this module left a runner


@pytest.fixture
def client(daemon):
    return openai.OpenAI(base_url=f"{daemon}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture
def claude(daemon):
    return anthropic.Anthropic(base_url=daemon, api_key="unused", max_retries=0, timeout=60)


# -- chat completions -------------------------------------------------------------------------------


def test_a_tool_call_is_parsed_into_tool_calls(client):
    done = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=ENOUGH)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == SAID
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == CALL["arguments"]


def test_without_tools_the_same_output_is_plain_text(client):
    done = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=ENOUGH)
    assert done.choices[0].message.content == SCRIPT and not done.choices[0].message.tool_calls
    assert done.choices[0].finish_reason == "stop"


def test_a_streamed_tool_call_comes_as_a_delta(client):
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=ENOUGH, stream=True)
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert text == SAID and [c.choices[0].finish_reason for c in chunks][-1] == "tool_calls"
    [call] = calls
    assert call.index == 0 and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == CALL["arguments"]


def test_the_tools_and_the_tool_turns_reach_the_prompt_through_the_chat_template(client):
    def prompt_tokens(**kwargs) -> int:
        return client.chat.completions.create(model=MODEL, max_tokens=1, **kwargs).usage.prompt_tokens

    bare = prompt_tokens(messages=ASK)
    with_tools = prompt_tokens(messages=ASK, tools=TOOLS)
    turn = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 degrees."},
    ]
    answered = prompt_tokens(messages=turn, tools=TOOLS)
    assert bare < with_tools < answered
    assert prompt_tokens(messages=ASK, tools=TOOLS, tool_choice="none") == bare  # none: the tools stay out


def test_the_legacy_functions_are_tools_and_their_calls_come_back_in_the_legacy_shape(client):
    """#28: ``functions`` / ``function_call`` (older clients and tutorials) were silently ignored: the tools never
    reached the prompt. Now they are the tools they became, and the answer speaks their shape."""
    functions = [TOOLS[0]["function"]]

    def prompt_tokens(**kwargs) -> int:
        return client.chat.completions.create(model=MODEL, max_tokens=1, **kwargs).usage.prompt_tokens

    assert prompt_tokens(messages=ASK, functions=functions) == prompt_tokens(messages=ASK, tools=TOOLS)
    assert prompt_tokens(messages=ASK, functions=functions, function_call="none") == prompt_tokens(messages=ASK)
    done = client.chat.completions.create(model=MODEL, messages=ASK, functions=functions, max_tokens=ENOUGH)
    choice = done.choices[0]
    assert choice.finish_reason == "function_call" and choice.message.tool_calls is None
    assert choice.message.function_call.name == "get_weather"
    assert json.loads(choice.message.function_call.arguments) == CALL["arguments"]
    streamed = list(
        client.chat.completions.create(model=MODEL, messages=ASK, functions=functions, max_tokens=ENOUGH, stream=True)
    )
    (call,) = [c.choices[0].delta.function_call for c in streamed if c.choices and c.choices[0].delta.function_call]
    assert call.name == "get_weather" and streamed[-1].choices[0].finish_reason == "function_call"
    legacy_turn = [  # the legacy conversation: an assistant's function_call, a function's answer
        *ASK,
        {"role": "assistant", "content": None, "function_call": {"name": "get_weather", "arguments": "{}"}},
        {"role": "function", "name": "get_weather", "content": "Sunny, 21 degrees."},
    ]
    modern_turn = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_get_weather", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_get_weather", "content": "Sunny, 21 degrees."},
    ]
    assert prompt_tokens(messages=legacy_turn, functions=functions) == prompt_tokens(messages=modern_turn, tools=TOOLS)
    both = httpx.post(
        f"{client.base_url}chat/completions",
        json={"model": MODEL, "messages": ASK, "functions": functions, "tools": TOOLS},
    )
    assert both.status_code == 400 and "not both" in both.json()["error"]["message"]


def test_logprobs_of_a_scripted_output_are_the_models_own(client):
    done = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=5, logprobs=True, top_logprobs=2, temperature=0
    )
    content = done.choices[0].logprobs.content
    assert (
        "".join(e.token for e in content)
        == done.choices[0].message.content
        == SAID[: len(done.choices[0].message.content)]
    )
    assert all(e.logprob <= e.top_logprobs[0].logprob <= 0 for e in content)  # forced, not always the likeliest


# -- the Responses API ------------------------------------------------------------------------------

RESPONSES_TOOLS = [{"type": "function", **TOOLS[0]["function"]}]


def test_responses_answer_with_a_message_and_a_function_call(client):
    done = client.responses.create(
        model=MODEL,
        input="What is the weather in Paris?",
        instructions="Be brief.",
        tools=RESPONSES_TOOLS,
        max_output_tokens=ENOUGH,
    )
    assert done.status == "completed" and done.output_text == SAID
    [message, call] = done.output
    assert message.type == "message" and call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == CALL["arguments"] and call.call_id.startswith("call_")
    assert done.usage.input_tokens > 0 and done.usage.output_tokens > 0


def test_responses_stream_from_created_to_completed_and_take_function_call_output(client):
    conversation = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "Sunny."},
    ]
    with client.responses.stream(
        model=MODEL, input=conversation, tools=RESPONSES_TOOLS, max_output_tokens=ENOUGH
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds and "response.function_call_arguments.done" in kinds
    assert [item.type for item in final.output] == ["message", "function_call"] and final.output_text == SAID


def test_responses_cut_short_are_incomplete(client):
    done = client.responses.create(model=MODEL, input="hi", max_output_tokens=3)
    assert done.status == "incomplete" and done.incomplete_details.reason == "max_output_tokens"


def test_responses_are_stateless_and_say_so(client):
    with pytest.raises(openai.BadRequestError, match="send the whole conversation"):
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_123")


# -- Anthropic's Messages API -----------------------------------------------------------------------

CLAUDE_TOOLS = [
    {"name": "get_weather", "description": "The weather.", "input_schema": TOOLS[0]["function"]["parameters"]}
]


def test_messages_answer_with_text_and_tool_use(claude):
    done = claude.messages.create(
        model=MODEL,
        max_tokens=ENOUGH,
        system="Be brief.",
        messages=ASK,
        tools=CLAUDE_TOOLS,
        extra_headers={"anthropic-version": "2023-06-01"},
    )
    assert done.stop_reason == "tool_use" and done.role == "assistant"
    [text, use] = done.content
    assert text.type == "text" and text.text == SAID
    assert use.type == "tool_use" and use.name == "get_weather" and use.input == CALL["arguments"]
    assert done.usage.input_tokens > 0 and done.usage.output_tokens > 0


def test_messages_stream_events_and_take_tool_results(claude):
    conversation = [
        {"role": "user", "content": [{"type": "text", "text": "What is the weather in Paris?"}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny."}]},
    ]
    with claude.messages.stream(model=MODEL, max_tokens=ENOUGH, messages=conversation, tools=CLAUDE_TOOLS) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert [block.type for block in final.content] == ["text", "tool_use"] and final.stop_reason == "tool_use"
    assert final.content[0].text == SAID and final.content[1].input == CALL["arguments"]


def test_messages_say_which_stop_sequence_ended_them(claude):
    done = claude.messages.create(model=MODEL, max_tokens=ENOUGH, messages=ASK, stop_sequences=["check"])
    assert (done.stop_reason, done.stop_sequence) == ("stop_sequence", "check")
    assert done.content[0].text == "Let me "


def test_messages_errors_are_in_anthropics_shape(claude, daemon):
    with pytest.raises(anthropic.NotFoundError) as missing:
        claude.messages.create(model="nobody/nothing", max_tokens=5, messages=ASK)
    assert missing.value.body["type"] == "error" and missing.value.body["error"]["type"] == "not_found_error"
    image = [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": ""}}]}]
    refused = httpx.post(f"{daemon}/v1/messages", json={"model": MODEL, "max_tokens": 5, "messages": image})
    assert refused.status_code == 400 and refused.json()["error"]["type"] == "invalid_request_error"
    assert "text" in refused.json()["error"]["message"]


# -- a tool call forced by tool_choice --------------------------------------------------------------
# This daemon's runners emit only what follows the name of a forced call: the arguments, and the end.

ARGUMENTS = json.dumps(CALL["arguments"]) + "}\n</tool_call>"


@pytest.fixture(scope="module")
def forced(tmp_path_factory):
    yield from serving(tmp_path_factory, "forced", ARGUMENTS)


def test_a_named_tool_choice_begins_the_call_in_every_dialect(forced):
    client = openai.OpenAI(base_url=f"{forced}/v1", api_key="unused", max_retries=0, timeout=60)
    claude = anthropic.Anthropic(base_url=forced, api_key="unused", max_retries=0, timeout=60)
    named = {"type": "function", "function": {"name": "get_weather"}}
    chat = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=ENOUGH)
    [call] = chat.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", CALL["arguments"])
    assert chat.choices[0].finish_reason == "tool_calls" and not chat.choices[0].message.content
    message = claude.messages.create(
        model=MODEL,
        max_tokens=ENOUGH,
        messages=ASK,
        tools=CLAUDE_TOOLS,
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    assert [(b.type, b.name, b.input) for b in message.content] == [("tool_use", "get_weather", CALL["arguments"])]
    response = client.responses.create(
        model=MODEL,
        input="Weather?",
        tools=RESPONSES_TOOLS,
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=ENOUGH,
    )
    [item] = response.output
    assert (item.type, item.name, json.loads(item.arguments)) == ("function_call", "get_weather", CALL["arguments"])


def test_required_begins_a_call_and_auto_leaves_the_model_free(forced):
    client = openai.OpenAI(base_url=f"{forced}/v1", api_key="unused", max_retries=0, timeout=60)
    free = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=ENOUGH)
    assert free.choices[0].message.content == ARGUMENTS  # nothing forced: just what the model said
    required = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=ENOUGH
    )
    # the call was begun for it; what it wrote next names no function, so it stays text, as the model wrote it
    assert required.choices[0].message.content == "<tool_call>\n" + ARGUMENTS
    assert required.usage.prompt_tokens > free.usage.prompt_tokens


# -- Ollama's API ------------------------------------------------------------------------------------


@pytest.fixture
def llama(daemon):
    import ollama

    return ollama.Client(host=daemon, timeout=60)


def test_ollama_lists_shows_and_says_what_is_loaded(llama, daemon):
    """#28: the official `ollama` client's list, show and ps, and /api/version, which apps probe first."""
    assert [m.model for m in llama.list().models] == [MODEL]
    shown = llama.show(MODEL)
    assert shown.details.family == "qwen2" and shown.details.format == "safetensors"
    assert shown.modelinfo["qwen2.context_length"] == 2048 and "tools" in shown.capabilities
    (loaded,) = llama.ps().models
    assert loaded.model == MODEL and loaded.context_length == 2048
    assert httpx.get(f"{daemon}/api/version").json()["version"]


def test_ollama_chat_by_short_name_streamed_by_default_and_whole_when_asked(llama, daemon):
    whole = llama.chat(model="tiny-qwen2:latest", messages=ASK, stream=False, options={"num_predict": ENOUGH})
    assert whole.message.role == "assistant" and whole.message.content == SCRIPT
    assert whole.done and whole.done_reason == "stop" and whole.prompt_eval_count > 0 and whole.eval_count > 0
    parts = list(llama.chat(model="tiny-qwen2", messages=ASK, stream=True, options={"num_predict": ENOUGH}))
    assert "".join(p.message.content for p in parts) == SCRIPT
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    raw = httpx.post(f"{daemon}/api/chat", json={"model": MODEL, "messages": ASK, "options": {"num_predict": 3}})
    assert raw.headers["content-type"].startswith("application/x-ndjson")  # Ollama streams unless told not to
    lines = [json.loads(line) for line in raw.text.splitlines()]
    assert lines[-1]["done"] is True and lines[-1]["done_reason"] == "length" and lines[-1]["eval_count"] == 3


def test_ollama_chat_with_tools_calls_them_with_arguments_as_an_object_and_takes_their_results(llama):
    done = llama.chat(model=MODEL, messages=ASK, tools=TOOLS, stream=False, options={"num_predict": ENOUGH})
    (call,) = done.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == CALL["arguments"]
    assert done.message.content == SAID
    turn = [
        *ASK,
        {"role": "assistant", "content": "", "tool_calls": [{"function": CALL}]},
        {"role": "tool", "content": "Sunny, 21 degrees.", "tool_name": "get_weather"},
    ]
    answered = llama.chat(model=MODEL, messages=turn, tools=TOOLS, stream=False, options={"num_predict": 1})
    assert answered.prompt_eval_count > done.prompt_eval_count


def test_ollama_generate_templated_or_raw_with_its_options(llama):
    templated = llama.generate(model=MODEL, prompt="Hello", stream=False, options={"num_predict": ENOUGH})
    assert templated.response == SCRIPT and templated.done_reason == "stop"
    raw = llama.generate(model=MODEL, prompt="Hello", raw=True, stream=False, options={"num_predict": 1})
    assert raw.prompt_eval_count < templated.prompt_eval_count  # no chat template around it
    parts = list(
        llama.generate(model=MODEL, prompt="Hello", system="Be brief.", stream=True, options={"num_predict": 4})
    )
    assert parts[-1].done and parts[-1].done_reason == "length" and parts[-1].eval_count == 4
    loaded = llama.generate(model=MODEL, prompt="")  # how apps load a model before using it
    assert loaded.done and loaded.done_reason == "load"


def test_ollama_errors_are_in_its_shape(llama, daemon):
    import ollama

    with pytest.raises(ollama.ResponseError) as unknown:
        llama.chat(model="nothing-here", messages=ASK, stream=False)
    assert unknown.value.status_code == 404 and "nothing-here" in unknown.value.error
    bad = httpx.post(f"{daemon}/api/chat", json={"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]})
    assert bad.status_code == 400 and set(bad.json()) == {"error"} and "role" in bad.json()["error"]


def test_ollama_stop_ends_the_text_before_the_stop_string_and_says_stop(llama):
    """#28: ``options.stop``, as Ollama answers one: the text up to the string, ``done_reason`` "stop"."""
    chat = llama.chat(model=MODEL, messages=ASK, stream=False, options={"num_predict": ENOUGH, "stop": ["check"]})
    assert chat.message.content == "Let me " and chat.done_reason == "stop"
    made = llama.generate(model=MODEL, prompt="Hello", stream=False, options={"num_predict": ENOUGH, "stop": ["me"]})
    assert made.response == "Let " and made.done_reason == "stop"


def test_ollama_generate_streams_ndjson_unless_told_not_to(daemon):
    """#28: no ``stream`` key is a stream: application/x-ndjson, one JSON object per line (each line ended),
    the pieces adding up to the text, only the last ``done``, with the counts."""
    body = {"model": MODEL, "prompt": "Hello", "options": {"num_predict": ENOUGH}}
    with httpx.stream("POST", f"{daemon}/api/generate", json=body, timeout=60) as answer:
        assert answer.status_code == 200
        assert answer.headers["content-type"].split(";")[0] == "application/x-ndjson"
        raw = answer.read().decode()
    assert raw.endswith("\n")
    objects = [json.loads(line) for line in raw.removesuffix("\n").split("\n")]
    assert all(isinstance(o, dict) and o["model"] == MODEL for o in objects) and len(objects) > 2
    assert [o["done"] for o in objects] == [False] * (len(objects) - 1) + [True]
    assert "".join(o["response"] for o in objects) == SCRIPT
    assert objects[-1]["done_reason"] == "stop" and objects[-1]["eval_count"] > 0


# -- Ollama's sampling options, on a daemon that samples ----------------------------------------------

TWIN = "acme/tiny-qwen2"  # the same name in another organisation: "tiny-qwen2" alone names neither
SAMPLED = f"""
[daemon]
port = 0
offline = true

[[place]]
model = "{MODEL}"
ranks = 1

[[place]]
model = "{TWIN}"
ranks = 1
"""
SAMPLED_TOKENS = 24


@pytest.fixture(scope="module")
def sampled(tmp_path_factory):
    """A daemon whose runners sample (no script), serving ``MODEL`` and ``TWIN``, both Ready."""
    with ready_daemon(tmp_path_factory.mktemp("sampled"), SAMPLED, {MODEL: 0, TWIN: 1}) as (url, _):
        deadline = time.monotonic() + 60  # ready_daemon waited for one instance: the other may still load
        while not all(i["state"] == "ready" for i in httpx.get(f"{url}/instances").json()["instances"]):
            assert time.monotonic() < deadline, httpx.get(f"{url}/instances").text
            time.sleep(0.05)
        yield url


def test_ollama_sampling_options_do_what_ollama_says(sampled):
    """#28: temperature, top_k, top_p and seed, each through the official client: 0, a top_k of 1 or a tiny
    top_p are the greedy text (OpenAI chat's at temperature 0), even at temperature 2, where nothing else
    is; a seed gives OpenAI chat's text for that seed, another seed another text."""
    import ollama

    llama = ollama.Client(host=sampled, timeout=60)
    client = openai.OpenAI(base_url=f"{sampled}/v1", api_key="unused", max_retries=0, timeout=60)

    def said(**options) -> str:
        answer = llama.chat(model=MODEL, messages=ASK, stream=False, options={"num_predict": SAMPLED_TOKENS, **options})
        return answer.message.content

    def openai_said(**sampling) -> str:
        done = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=SAMPLED_TOKENS, **sampling)
        return done.choices[0].message.content

    greedy = openai_said(temperature=0)
    assert len(greedy) > 10
    assert said(temperature=2, seed=1) != greedy  # hot: not the greedy text, unless an option makes it so
    assert said(temperature=0) == greedy
    assert said(temperature=2, top_k=1, seed=1) == greedy
    assert said(temperature=2, top_p=1e-6, seed=1) == greedy
    # Ollama's defaults (top_p 0.9, top_k 40) turned off: the sampling is OpenAI chat's, the same seed its text
    seeded = said(temperature=1, top_p=1, top_k=0, seed=7)
    assert seeded == openai_said(temperature=1, top_p=1, seed=7) != greedy
    assert said(temperature=1, top_p=1, top_k=0, seed=8) != seeded


def test_ollama_format_json_holds_the_output_to_json(sampled):
    """#28: ``format: "json"``: the text parses as a JSON object, where the same request without it does not."""
    import ollama

    llama = ollama.Client(host=sampled, timeout=60)
    options = {"num_predict": 200, "temperature": 0}
    free = llama.chat(model=MODEL, messages=ASK, stream=False, options=options).message.content
    with pytest.raises(ValueError):
        json.loads(free)
    chat = llama.chat(model=MODEL, messages=ASK, format="json", stream=False, options=options)
    assert chat.done_reason == "stop" and isinstance(json.loads(chat.message.content), dict)
    made = llama.generate(model=MODEL, prompt="Weather?", format="json", stream=False, options=options)
    assert made.done_reason == "stop" and isinstance(json.loads(made.response), dict)


def test_ollama_a_name_without_its_organisation_that_two_models_share_is_refused_naming_both(sampled):
    """#28: "tiny-qwen2" is both ``MODEL`` and ``TWIN``: neither is guessed; the answer names them, and each
    full name still serves."""
    import ollama

    llama = ollama.Client(host=sampled, timeout=60)
    for ask in (
        lambda: llama.chat(model="tiny-qwen2", messages=ASK, stream=False, options={"num_predict": 1}),
        lambda: llama.generate(model="tiny-qwen2:latest", prompt="Hello", stream=False),
        lambda: llama.show("tiny-qwen2"),
    ):
        with pytest.raises(ollama.ResponseError) as refused:
            ask()
        assert refused.value.status_code == 400
        assert f"{MODEL}" in refused.value.error and f"{TWIN}" in refused.value.error
        assert "ambiguous" in refused.value.error and "org/name" in refused.value.error
    for model in (MODEL, TWIN):  # seeded: unseeded, this daemon samples, and may draw the end within two tokens
        answer = llama.chat(model=model, messages=ASK, stream=False, options={"num_predict": 2, "seed": 7})
        assert answer.done_reason == "length" and answer.eval_count == 2
