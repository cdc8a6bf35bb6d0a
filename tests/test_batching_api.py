"""Batching and the prompt cache as a client sees them: a real `exod serve`, real runners, the official clients.

Requests sent at once are decoded in one batch (`/metrics` says how wide), each answer as it is alone; the
second turn of a conversation reads the first from the prompt cache and says so in ``usage``, in each
dialect's words; a prompt the model's context cannot hold is a 400."""

from __future__ import annotations

import ipaddress
import re
import socket
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anthropic
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from daemon_harness import ready_daemon, runner_pids
from exod.host.models import resolve_model
from exod.host.tiny_model import EOS_TOKEN

MODEL = "exod/tiny-qwen2"
CONFIG = f"""
[daemon]
port = 0
offline = true

[[place]]
model = "{MODEL}"
ranks = 2
"""
GREEDY = {"temperature": 0.0, "max_tokens": 24}
LONG = {"temperature": 0.0, "max_tokens": 1000}  # long enough that 4 requests sent at once overlap


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with ready_daemon(tmp_path_factory.mktemp("batching"), CONFIG, {MODEL: 0}) as (url, hf):
        yield url, hf
    assert runner_pids() == []


@pytest.fixture(scope="module")
def daemon(served):
    return served[0]


@pytest.fixture(scope="module")
def hf(served):
    return served[1]


@pytest.fixture
def client(daemon):
    return openai.OpenAI(base_url=f"{daemon}/v1", api_key="unused", max_retries=0, timeout=60)


def wide_batches(url: str) -> float:
    """How many finished requests shared their batch with at least 3 others (`exod_batch_size` > 3)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == "exod_batch_size"]
    count = next(s.value for s in family.samples if s.name.endswith("_count"))
    up_to_3 = next(s.value for s in family.samples if s.name.endswith("_bucket") and s.labels["le"] == "3.0")
    return count - up_to_3


def ask(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"question number {i}: what comes next?"}]


def test_concurrent_requests_share_a_batch_and_each_answers_as_alone(daemon, client):
    alone = [client.chat.completions.create(model=MODEL, messages=ask(i), **LONG) for i in range(4)]
    before = wide_batches(daemon)
    with ThreadPoolExecutor(4) as pool:
        together = list(
            pool.map(lambda i: client.chat.completions.create(model=MODEL, messages=ask(i), **LONG), range(4))
        )
    assert [c.choices[0].message.content for c in together] == [c.choices[0].message.content for c in alone]
    assert wide_batches(daemon) > before  # /metrics: the batch reached 4


def test_n_samples_are_sequences_of_one_batch(daemon, client):
    before = wide_batches(daemon)
    done = client.chat.completions.create(model=MODEL, messages=ask(9), n=4, **LONG)  # long: they overlap
    assert len(done.choices) == 4 and len({c.message.content for c in done.choices}) == 1  # greedy: n equal
    assert wide_batches(daemon) - before == 4  # all four decoded together


def test_the_second_turn_of_a_chat_reads_the_first_from_the_prompt_cache(daemon, client):
    question = [{"role": "user", "content": "tell me about finite-state machines, at some length"}]
    first = client.chat.completions.create(model=MODEL, messages=question, **GREEDY)
    assert first.usage.prompt_tokens_details.cached_tokens < first.usage.prompt_tokens  # the template's start, at most
    conversation = [
        *question,
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "and then?"},
    ]
    second = client.chat.completions.create(model=MODEL, messages=conversation, **GREEDY)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens <= cached < second.usage.prompt_tokens

    # the same in the other dialects: Anthropic counts cached input apart, the Responses API in its details
    claude = anthropic.Anthropic(base_url=daemon, api_key="unused", max_retries=0)
    turn = [{"role": "user", "content": "a third conversation, about caches"}]
    one = claude.messages.create(model=MODEL, max_tokens=24, messages=turn, extra_body={"temperature": 0})
    whole_first = one.usage.input_tokens + one.usage.cache_read_input_tokens
    turn += [
        {"role": "assistant", "content": one.content[0].text if one.content else ""},
        {"role": "user", "content": "more"},
    ]
    two = claude.messages.create(model=MODEL, max_tokens=24, messages=turn, extra_body={"temperature": 0})
    assert two.usage.cache_read_input_tokens >= whole_first and two.usage.input_tokens > 0
    r1 = client.responses.create(model=MODEL, input="a fourth one, about prompts", max_output_tokens=24, temperature=0)
    r2 = client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "a fourth one, about prompts"},
            {"role": "assistant", "content": r1.output_text},
            {"role": "user", "content": "go on"},
        ],
        max_output_tokens=24,
        temperature=0,
    )
    assert r1.usage.input_tokens <= r2.usage.input_tokens_details.cached_tokens < r2.usage.input_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_over_the_context_is_a_400_streaming_or_not(client, stream):
    huge = [{"role": "user", "content": "tokens " * 3000}]  # the tiny model's context is 2048 tokens
    with pytest.raises(openai.BadRequestError) as refused:
        answer = client.chat.completions.create(model=MODEL, messages=huge, max_tokens=4, stream=stream)
        list(answer) if stream else None
    error = refused.value.body
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    assert error["message"].startswith("This model's maximum context length is 2048 tokens. However, your messages")
    done = client.chat.completions.create(model=MODEL, messages=ask(1), **GREEDY)  # it serves on
    assert done.choices[0].finish_reason in ("stop", "length")


def test_a_prompt_over_the_context_is_refused_in_each_dialects_words(daemon, client):
    """#28: clients that trim a conversation and retry look for these: OpenAI's code and sentence, with the
    dialect's own parameter named; Anthropic's "prompt is too long"."""
    text = "tokens " * 3000
    with pytest.raises(openai.BadRequestError) as completions:
        client.completions.create(model=MODEL, prompt=text, max_tokens=4)
    with pytest.raises(openai.BadRequestError) as responses:
        client.responses.create(model=MODEL, input=text, max_output_tokens=16)
    for refused, param in ((completions, "prompt"), (responses, "input")):
        error = refused.value.body
        assert error["code"] == "context_length_exceeded" and error["param"] == param
        assert error["message"].startswith(f"This model's maximum context length is 2048 tokens. However, your {param}")
    messages = anthropic.Anthropic(base_url=daemon, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as refused:
        messages.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": text}])
    error = refused.value.body["error"]
    assert error["type"] == "invalid_request_error"
    from langchain_core.exceptions import ContextOverflowError
    from langchain_openai import ChatOpenAI

    agent = ChatOpenAI(model=MODEL, base_url=f"{daemon}/v1", api_key="unused", max_retries=0, max_tokens=4)
    with pytest.raises(ContextOverflowError):  # LangChain's agents trim the conversation on this one
        agent.invoke(text)
    tokens, maximum = re.fullmatch(r"prompt is too long: (\d+) tokens > (\d+) maximum", error["message"]).groups()
    assert int(tokens) > int(maximum) == 2047


def loopback_only(monkeypatch) -> list[object]:
    """Connections and name look-ups beyond 127.0.0.0/8 fail at once (no test waits on a network it may not
    have), and are listed: the caller asserts there were none."""
    tried: list[object] = []
    connect, resolve = socket.socket.connect, socket.getaddrinfo

    def local_connect(sock: socket.socket, address: Any) -> None:
        if sock.family in (socket.AF_INET, socket.AF_INET6) and not ipaddress.ip_address(address[0]).is_loopback:
            tried.append(address)
            raise OSError(f"this test reaches nothing beyond loopback, not {address}")
        connect(sock, address)

    def local_resolve(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host not in ("localhost", None) and not str(host).startswith(("127.", "::1")):
            tried.append(host)
            raise socket.gaierror(f"this test resolves no name beyond loopback, not {host}")
        return resolve(host, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", local_connect)
    monkeypatch.setattr(socket, "getaddrinfo", local_resolve)
    return tried


def test_litellm_reads_a_prompt_over_the_context_as_its_context_window_error(daemon, monkeypatch):
    """#28: litellm (routers, proxies, agent frameworks built on it) falls back to a longer-context model or trims
    on `ContextWindowExceededError`, which it finds by exod's sentence. Its cost map from the package, never
    fetched: nothing here reaches beyond loopback, at import or at the call."""
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    monkeypatch.setenv("LITELLM_OFFLINE_MODE", "true")
    tried = loopback_only(monkeypatch)
    import litellm

    with pytest.raises(litellm.ContextWindowExceededError) as refused:
        litellm.completion(
            model=f"openai/{MODEL}",
            api_base=f"{daemon}/v1",
            api_key="unused",
            messages=[{"role": "user", "content": "tokens " * 3000}],
            max_tokens=4,
            num_retries=0,
            timeout=60,
        )
    assert "maximum context length is 2048 tokens" in str(refused.value)
    fits = litellm.completion(
        model=f"openai/{MODEL}", api_base=f"{daemon}/v1", api_key="unused", messages=ask(1), max_tokens=2
    )
    assert fits.choices[0].finish_reason in ("stop", "length")
    assert tried == []


def test_tokens_are_counted_and_shown_by_the_runners_exactly_as_a_generation_reads_them(daemon, client):
    """#28: Anthropic's count_tokens, vLLM's /tokenize and /detokenize. Nothing is generated, on either rank;
    the counts are the ones a generation's usage reports, never an estimate."""
    claude = anthropic.Anthropic(base_url=daemon, api_key="unused", max_retries=0)
    said = [{"role": "user", "content": "How many tokens is this?"}]
    counted = claude.messages.count_tokens(model=MODEL, messages=said, system="Be brief.")
    generated = claude.messages.create(model=MODEL, messages=said, system="Be brief.", max_tokens=1)
    usage = generated.usage  # Anthropic counts what the prompt cache gave apart from input_tokens
    assert counted.input_tokens == usage.input_tokens + (usage.cache_read_input_tokens or 0) > 0
    chat = client.chat.completions.create(model=MODEL, messages=ask(3), max_tokens=1)
    tokenized = httpx.post(f"{daemon}/tokenize", json={"model": MODEL, "messages": ask(3)}).json()
    assert tokenized["count"] == len(tokenized["tokens"]) == chat.usage.prompt_tokens
    assert tokenized["max_model_len"] == 2048
    text = "The quick brown fox"
    raw = httpx.post(f"{daemon}/tokenize", json={"model": MODEL, "prompt": text}).json()
    assert raw["count"] == client.completions.create(model=MODEL, prompt=text, max_tokens=1).usage.prompt_tokens
    back = httpx.post(f"{daemon}/detokenize", json={"model": MODEL, "tokens": raw["tokens"]}).json()
    assert back == {"prompt": text}
    both = httpx.post(f"{daemon}/tokenize", json={"model": MODEL, "prompt": text, "messages": ask(3)})
    assert both.status_code == 400 and "exactly one" in both.json()["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as unknown:
        claude.messages.count_tokens(model="nobody/nothing", messages=said)
    assert unknown.value.body["type"] == "error"
    done = client.chat.completions.create(model=MODEL, messages=ask(1), **GREEDY)  # the batch serves on
    assert done.choices[0].finish_reason in ("stop", "length")


def reference_embedding(hf, text: str) -> list[float]:
    """What the embedding must be, computed here from the model's files: the last hidden states after the
    final norm, mean-pooled, L2-normalised, on one process (the daemon's instance has 2 ranks)."""
    import mlx.core as mx
    from mlx_lm.utils import load

    model, tokenizer = load(str(resolve_model(MODEL, hf_home=hf, offline=True)))
    hidden = model.model(mx.array([tokenizer.encode(text)]))[0].astype(mx.float32).mean(axis=0)
    return (hidden / mx.linalg.norm(hidden)).tolist()


def test_embeddings_are_the_models_pooled_states_from_every_rank_in_openais_and_ollamas_shapes(daemon, client, hf):
    """#28: `/v1/embeddings` and `/api/embed`, computed by the 2-rank instance (each rank its layers), equal
    to the model's own pooled hidden states computed in one process here."""
    import math

    import ollama

    texts = ["the quick brown fox", "state machines", "the quick brown fox"]
    done = client.embeddings.create(model=MODEL, input=texts)  # the SDK asks for base64, and decodes it
    vectors = [d.embedding for d in sorted(done.data, key=lambda d: d.index)]
    assert [d.index for d in done.data] == [0, 1, 2] and len(vectors[0]) == 64
    assert vectors[0] == vectors[2] and vectors[0] != vectors[1]
    assert all(abs(math.hypot(*v) - 1) < 1e-5 for v in vectors)
    expected = reference_embedding(hf, texts[0])
    assert max(abs(a - b) for a, b in zip(vectors[0], expected, strict=True)) < 1e-4
    counts = [httpx.post(f"{daemon}/tokenize", json={"model": MODEL, "prompt": t}).json() for t in texts]
    assert done.usage.prompt_tokens == sum(c["count"] for c in counts)
    tokens = counts[1]
    by_ids = client.embeddings.create(model=MODEL, input=tokens["tokens"], encoding_format="float")
    assert max(abs(a - b) for a, b in zip(by_ids.data[0].embedding, vectors[1], strict=True)) < 1e-5
    raw = httpx.post(f"{daemon}/v1/embeddings", json={"model": MODEL, "input": "x", "encoding_format": "float"})
    assert isinstance(raw.json()["data"][0]["embedding"][0], float)
    wrong = httpx.post(f"{daemon}/v1/embeddings", json={"model": MODEL, "input": "x", "dimensions": 16})
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "dimensions"
    assert httpx.post(f"{daemon}/v1/embeddings", json={"model": MODEL, "input": []}).status_code == 400
    too_long = httpx.post(f"{daemon}/v1/embeddings", json={"model": MODEL, "input": "tokens " * 3000})
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
    assert too_long.json()["error"]["param"] == "input"
    llama = ollama.Client(host=daemon, timeout=60).embed(model="tiny-qwen2", input=texts[:2])
    assert max(abs(a - b) for a, b in zip(llama.embeddings[1], vectors[1], strict=True)) < 1e-5
    metrics = httpx.get(f"{daemon}/metrics").text
    (family,) = [f for f in text_string_to_metric_families(metrics) if f.name == "exod_embedding_inputs"]
    assert sum(s.value for s in family.samples if s.name.endswith("_total")) >= 7


def histogram(url: str, name: str) -> tuple[float, float]:
    """A histogram's count and sum in `/metrics`, every label together."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == name]
    count = sum(s.value for s in family.samples if s.name.endswith("_count"))
    return count, sum(s.value for s in family.samples if s.name.endswith("_sum"))


def test_a_calls_inputs_share_forward_passes_and_metrics_count_them_apart_from_decoding(daemon, client):
    """One call's inputs reach the runners together and are embedded in shared forward passes:
    ``exod_embedding_batch_size`` counts each input with the number that shared its pass, and
    ``exod_batch_size`` (decoding) counts none of them."""
    decoded = histogram(daemon, "exod_batch_size")
    count, total = histogram(daemon, "exod_embedding_batch_size")
    inputs = [f"input number {i} " * (1 + i % 3) for i in range(6)]
    done = client.embeddings.create(model=MODEL, input=inputs, encoding_format="float")
    assert len(done.data) == 6
    after_count, after_total = histogram(daemon, "exod_embedding_batch_size")
    assert after_count - count == 6
    assert after_total - total > 6, "every input had a pass of its own"
    assert histogram(daemon, "exod_batch_size") == decoded


def reference_logprobs(hf, tokens: list[int]) -> list[float]:
    """Each token's log-probability given those before it (the first has none), from the model's files here."""
    import mlx.core as mx
    from mlx_lm.utils import load

    model, _ = load(str(resolve_model(MODEL, hf_home=hf, offline=True)))
    logits = model(mx.array([tokens]))[0].astype(mx.float32)
    rows = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return [rows[t - 1, tokens[t]].item() for t in range(1, len(tokens))]


def test_completions_serve_evaluation_harnesses_prompt_lists_echo_and_scoring(daemon, client, hf):
    """#28: lm-evaluation-harness's `local-completions` scores a continuation by sending context + continuation
    as token ids with ``echo``, ``logprobs`` and a token or none to generate, and summing the continuation's
    log-probabilities; it generates (``generate_until``) from token ids, greedy, until its stop strings. Here in
    its request shapes and its own arithmetic, against the model's log-probabilities computed in this process
    (the daemon's instance has 2 ranks).

    The shapes are lm-eval 0.4.13's (`lm_eval/models/openai_completions.py`, `LocalCompletionsAPI._create_payload`,
    with its default ``tokenized_requests``): lm-eval itself is not a test dependency, as it requires torch."""
    context = httpx.post(f"{daemon}/tokenize", json={"model": MODEL, "prompt": "The capital of France is"}).json()
    continuation = httpx.post(f"{daemon}/tokenize", json={"model": MODEL, "prompt": " Paris"}).json()["tokens"]
    whole = context["tokens"] + continuation
    # loglikelihood: exactly the payload `_create_payload(generate=False)` builds, a batch of two requests
    request = {
        "model": MODEL,
        "prompt": [whole, whole[:-1]],
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }
    answer = httpx.post(f"{daemon}/v1/completions", json=request).json()
    expected = reference_logprobs(hf, whole)
    (first, second) = sorted(answer["choices"], key=lambda c: c["index"])
    ctxlen = len(context["tokens"])
    scored = first["logprobs"]["token_logprobs"][ctxlen:-1]  # the harness's own slice: the generated one left out
    assert len(scored) == len(continuation)
    assert abs(sum(scored) - sum(expected[ctxlen - 1 :])) < 1e-3
    assert first["logprobs"]["token_logprobs"][0] is None and first["logprobs"]["top_logprobs"][0] is None
    tops = first["logprobs"]["top_logprobs"][ctxlen:-1]  # the harness's is_greedy: each against the likeliest
    assert len(tops) == len(scored) and all(
        max(top.values()) >= lp - 1e-6 for lp, top in zip(scored, tops, strict=True)
    )
    assert len(second["logprobs"]["tokens"]) == len(whole)  # one token shorter, one generated
    # generate_until: `_create_payload(generate=True)`'s payload, its stop strings the task's `until` (here a
    # piece of what the model says, so that it cuts) and the model's end token (`handle_stop_sequences`);
    # `parse_generations` puts each text at its choice's index
    prompts = [whole, context["tokens"]]
    free = [
        client.completions.create(model=MODEL, prompt=[p], max_tokens=16, temperature=0).choices[0].text
        for p in prompts
    ]
    until = [free[0][4:7], EOS_TOKEN]
    request = {"prompt": prompts, "model": MODEL, "max_tokens": 16, "temperature": 0, "stop": until, "seed": 1234}
    generated = httpx.post(f"{daemon}/v1/completions", json=request).json()
    texts: list[str | None] = [None] * len(generated["choices"])
    for choice in generated["choices"]:
        texts[choice["index"]] = choice["text"]
    assert texts == [f[: f.find(until[0])] if until[0] in f else f for f in free] and texts[0] != free[0]
    scoring = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=0, echo=True, logprobs=0
    )
    (choice,) = scoring.choices
    assert choice.text == "The capital of France is" and choice.finish_reason == "length"
    assert "".join(choice.logprobs.tokens) == choice.text and scoring.usage.completion_tokens == 0
    assert choice.logprobs.text_offset[0] == 0 and choice.logprobs.text_offset == sorted(choice.logprobs.text_offset)


def test_completions_take_a_list_of_prompts_n_choices_each_numbered_as_openai_does(client):
    prompts = ["one two three", "alpha beta"]
    both = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=6, temperature=0)
    assert [c.index for c in sorted(both.choices, key=lambda c: c.index)] == [0, 1, 2, 3]
    for i, prompt in enumerate(prompts):
        alone = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0).choices[0].text
        assert [c.text for c in both.choices if c.index // 2 == i] == [alone, alone]
    echoed = client.completions.create(model=MODEL, prompt=[[5, 6, 7]], max_tokens=2, echo=True, temperature=0)
    url = str(client.base_url).removesuffix("/v1/")
    tokens_text = httpx.post(f"{url}/detokenize", json={"model": MODEL, "tokens": [5, 6, 7]}).json()["prompt"]
    assert echoed.choices[0].text.startswith(tokens_text) and len(echoed.choices[0].text) > len(tokens_text)
    streamed = list(client.completions.create(model=MODEL, prompt=prompts, max_tokens=3, temperature=0, stream=True))
    assert {c.choices[0].index for c in streamed if c.choices} == {0, 1}


def test_a_long_list_of_inputs_or_prompts_waits_its_turn_instead_of_being_refused(client):
    """One call's inputs are requests of the instance, a few at a time: 40 inputs or 30 prompts are more than
    the instance's bound of requests at once (16 by default), and none is refused for it."""
    inputs = [f"sentence number {i}" for i in range(40)]
    embedded = client.embeddings.create(model=MODEL, input=inputs)
    assert sorted(d.index for d in embedded.data) == list(range(40))
    again = client.embeddings.create(model=MODEL, input=inputs[7])
    assert again.data[0].embedding == next(d.embedding for d in embedded.data if d.index == 7)
    prompts = [f"prompt {i}" for i in range(30)]
    completed = client.completions.create(model=MODEL, prompt=prompts, max_tokens=2, temperature=0)
    assert sorted(c.index for c in completed.choices) == list(range(30))
