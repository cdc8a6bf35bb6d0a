"""exod judged by what it answers: SmolLM2-135M-Instruct (a real instruct model, a 49,152-token vocabulary, a ChatML
template without tools), imported from the package registry's GGUF as `make run` does, served by `exod serve`,
spoken to with the official clients. Every request is short: MLX runs this model at 5–7 tokens/s here."""

from __future__ import annotations

import json
import math
import time

import anthropic
import httpx
import jsonschema
import ollama
import openai
import pytest

from daemon_harness import runner_pids
from real_model_harness import REAL_MODEL, serving_real_model

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
TEMPLATE_TOKENS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, real_model_home):
    with serving_real_model(tmp_path_factory.mktemp("real"), real_model_home) as url:
        yield url
    assert runner_pids() == []


@pytest.fixture
def client(daemon):
    return openai.OpenAI(base_url=f"{daemon}/v1", api_key="unused", max_retries=0, timeout=120)


def test_the_capital_question_is_answered_with_paris_streamed_or_not_alike(client):
    whole = client.chat.completions.create(model=REAL_MODEL, messages=CAPITAL, temperature=0, max_tokens=24)
    answer = whole.choices[0].message.content
    assert "Paris" in answer, answer
    assert whole.choices[0].finish_reason == "stop"  # the model's end of turn ended it, not max_tokens
    assert not any(token in answer for token in TEMPLATE_TOKENS)

    stream = client.chat.completions.create(
        model=REAL_MODEL, messages=CAPITAL, temperature=0, max_tokens=24, stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]


def test_a_stop_sequence_ends_the_answer_before_it_and_max_tokens_ends_it_at_length(client):
    stopped = client.chat.completions.create(
        model=REAL_MODEL, messages=CAPITAL, temperature=0, max_tokens=24, stop=[" Paris"]
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert "Paris" not in stopped.choices[0].message.content and stopped.choices[0].message.content

    cut = client.chat.completions.create(model=REAL_MODEL, messages=CAPITAL, temperature=0, max_tokens=3)
    assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == 3


def test_the_end_of_turn_ends_the_answer_in_every_dialect_and_no_template_token_leaks(daemon, client):
    openai_text = client.chat.completions.create(model=REAL_MODEL, messages=CAPITAL, temperature=0, max_tokens=24)
    claude = anthropic.Anthropic(base_url=daemon, api_key="unused", max_retries=0, timeout=120)
    message = claude.messages.create(model=REAL_MODEL, messages=CAPITAL, max_tokens=24, extra_body={"temperature": 0})
    llama = ollama.Client(host=daemon, timeout=120)
    chat = llama.chat(model=REAL_MODEL, messages=CAPITAL, options={"temperature": 0, "num_predict": 24})
    streamed = "".join(
        part.message.content
        for part in llama.chat(
            model=REAL_MODEL, messages=CAPITAL, options={"temperature": 0, "num_predict": 24}, stream=True
        )
    )
    texts = [openai_text.choices[0].message.content, message.content[0].text, chat.message.content, streamed]
    assert len(set(texts)) == 1 and "Paris" in texts[0], texts
    assert not any(token in text for text in texts for token in TEMPLATE_TOKENS)
    assert (message.stop_reason, chat.done_reason) == ("end_turn", "stop")


def test_a_strict_json_schema_is_valid_on_the_real_vocabulary(client):
    answer = client.chat.completions.create(
        model=REAL_MODEL,
        messages=[{"role": "user", "content": "Give me a person as JSON."}],
        temperature=0,
        max_tokens=48,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": PERSON}},
    )
    person = json.loads(answer.choices[0].message.content)
    jsonschema.validate(person, PERSON)
    assert answer.choices[0].finish_reason == "stop"


def test_ids_beyond_the_real_vocabulary_and_a_constraint_bomb_are_the_callers_400_and_the_runner_lives(client):
    pids = runner_pids()
    with pytest.raises(openai.BadRequestError, match="0 to 49151") as refused:
        client.completions.create(model=REAL_MODEL, prompt=[1, 49152], max_tokens=2)
    assert refused.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError, match="0 to 49151"):
        client.embeddings.create(model=REAL_MODEL, input=[[10**9]])
    node = {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}
    bomb = {"$defs": {"n": node}, "$ref": "#/$defs/n"}  # requires itself: no finite value
    with pytest.raises(openai.BadRequestError, match="Too many items"):
        client.chat.completions.create(
            model=REAL_MODEL,
            messages=CAPITAL,
            max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": bomb}},
        )
    assert runner_pids() == pids


def test_a_forced_tool_call_is_valid_though_the_template_takes_no_tools(daemon, client):
    """SmolLM2's template has no place for tools: exod writes them into the system turn itself
    (`exod.runner.tool_prompt`), and a forced call is held to the tool's schema by the grammar."""
    asked = [{"role": "user", "content": "What is the weather in Paris?"}]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        answer = client.chat.completions.create(
            model=REAL_MODEL, messages=asked, temperature=0, max_tokens=48, tools=[WEATHER], tool_choice=choice
        )
        (call,) = answer.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and answer.choices[0].finish_reason == "tool_calls"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])

    claude = anthropic.Anthropic(base_url=daemon, api_key="unused", max_retries=0, timeout=120)
    tool = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}
    message = claude.messages.create(
        model=REAL_MODEL,
        messages=asked,
        max_tokens=48,
        tools=[tool],
        tool_choice={"type": "any"},
        extra_body={"temperature": 0},
    )
    (use,) = [block for block in message.content if block.type == "tool_use"]
    jsonschema.validate(use.input, tool["input_schema"])


def test_tools_given_to_a_template_without_them_reach_the_prompt_and_a_free_choice_is_the_models(client):
    plain = client.chat.completions.create(model=REAL_MODEL, messages=CAPITAL, temperature=0, max_tokens=24)
    with_tools = client.chat.completions.create(
        model=REAL_MODEL, messages=CAPITAL, temperature=0, max_tokens=24, tools=[WEATHER]
    )
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 50  # the tool's signature is in the prompt
    choice = with_tools.choices[0]
    assert choice.finish_reason in {"stop", "tool_calls"}  # answered, as text or as a call: never a 400
    assert not any(token in (choice.message.content or "") for token in ("<tool_call>", *TEMPLATE_TOKENS))


def test_embeddings_of_paraphrases_are_closer_than_of_unrelated_sentences(client):
    texts = ["The cat sat on the mat.", "A cat was sitting on the rug.", "Interest rates rose by half a point."]
    vectors = [item.embedding for item in client.embeddings.create(model=REAL_MODEL, input=texts).data]
    assert len(vectors[0]) == 576  # the model's hidden size

    def cosine(a: list[float], b: list[float]) -> float:
        return sum(x * y for x, y in zip(a, b, strict=True)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))

    assert cosine(vectors[0], vectors[1]) > cosine(vectors[0], vectors[2])
    assert cosine(vectors[0], vectors[1]) > cosine(vectors[1], vectors[2])


def test_a_second_turn_reuses_the_first_turns_cache_and_its_first_token_comes_sooner(daemon, client):
    """The same second-turn prompt twice: after its first turn (cached) and as a stranger (a first turn that
    differs from its first token on, so nothing of it is cached). The long system turn makes prefill the cost."""
    system = "You answer in one short sentence. " + " ".join(f"Rule {i}: be brief and precise." for i in range(8))

    def conversation(opening: str) -> list[dict[str, str]]:
        return [{"role": "system", "content": opening + system}, *CAPITAL]

    def first_token(messages: list[dict[str, str]]) -> tuple[float, int]:
        started = time.monotonic()
        stream = client.chat.completions.create(
            model=REAL_MODEL,
            messages=messages,
            temperature=0,
            max_tokens=1,
            stream=True,
            stream_options={"include_usage": True},
        )
        waited, cached = None, 0
        for chunk in stream:
            if waited is None and chunk.choices and chunk.choices[0].delta.content is not None:
                waited = time.monotonic() - started
            if chunk.usage is not None:
                cached = chunk.usage.prompt_tokens_details.cached_tokens
        assert waited is not None
        return waited, cached

    first = conversation("A. ")
    reply = client.chat.completions.create(model=REAL_MODEL, messages=first, temperature=0, max_tokens=12)
    second = [*first, {"role": "assistant", "content": reply.choices[0].message.content}, *CAPITAL]
    cached_wait, cached = first_token(second)
    stranger = [*conversation("B. "), *second[1:]]
    fresh_wait, fresh_cached = first_token(stranger)
    assert cached > 80 and fresh_cached < 10, (cached, fresh_cached)
    assert cached_wait < fresh_wait, (cached_wait, fresh_wait, cached)


def test_the_ollama_client_lists_and_shows_the_model_with_its_context(daemon):
    llama = ollama.Client(host=daemon, timeout=60)
    assert REAL_MODEL in {m.model for m in llama.list().models}
    shown = llama.show(REAL_MODEL)
    assert "tools" in shown.capabilities  # its template has no place for them: exod writes them
    assert shown.modelinfo.get("llama.context_length") == 8192 or "8192" in json.dumps(shown.model_dump(), default=str)
    models = httpx.get(f"{daemon}/v1/models", timeout=30).json()["data"]
    assert any(m["id"] == REAL_MODEL for m in models)


def test_three_ranks_over_the_ring_answer_the_same_greedy_text_as_one(tmp_path, real_model_home, client):
    """Tensor parallel (mlx-lm has no pipeline for llama): 9 attention heads and 3 key/value heads split over 3
    ranks, not 2, so three it is. Each rank computes its heads and a third of the MLP; sums go round the ring."""
    one = client.chat.completions.create(model=REAL_MODEL, messages=CAPITAL, temperature=0, max_tokens=10)
    with serving_real_model(tmp_path, real_model_home, ranks=3) as url:
        ring = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
        three = ring.chat.completions.create(model=REAL_MODEL, messages=CAPITAL, temperature=0, max_tokens=10)
        instance = httpx.get(f"{url}/instances", timeout=30).json()["instances"][0]
        assert [r["state"] for r in instance["runners"]] == ["ready"] * 3
    assert three.choices[0].message.content == one.choices[0].message.content


def test_the_dashboards_chat_shows_the_models_answer(browser, daemon, client):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    from browser_harness import console_errors, open_page, screenshot, until

    open_page(browser, daemon + "/")
    until(lambda: Select(browser.find_element(By.ID, "chat-model")).select_by_value(REAL_MODEL) or True, what="model")
    for field, value in (("chat-temperature", "0"), ("chat-max-tokens", "24")):
        browser.find_element(By.ID, field).clear()
        browser.find_element(By.ID, field).send_keys(value)
    browser.find_element(By.ID, "chat-input").send_keys(CAPITAL[0]["content"])
    browser.find_element(By.ID, "chat-send").click()
    answer = until(
        lambda: browser.find_element(By.CSS_SELECTOR, '#chat-log .assistant[data-done="true"]'),
        timeout=120,
        what="the answer",
    )
    shown = answer.get_attribute("textContent")
    expected = client.chat.completions.create(model=REAL_MODEL, messages=CAPITAL, temperature=0, max_tokens=24)
    assert "Paris" in shown and shown == expected.choices[0].message.content
    assert console_errors(browser) == []
    screenshot(browser, "dashboard-chat")
