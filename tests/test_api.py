"""The HTTP API of a real `exod serve`, real runners, the tiny model — spoken to with the official `openai` client."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from urllib.parse import urlsplit

import h11
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from daemon_harness import ready_daemon, runner_pids, start_daemon, wait_instance
from exod.host.models import resolve_model

MODEL = "exod/tiny-qwen2"
MESSAGES = [{"role": "user", "content": "Tell me about state machines."}]
CONFIG = """
[daemon]
port = 0
offline = true

[retry]
initial = 0.2
cap = 1.0

[limits]
max_requests_per_instance = 3
max_tokens = 2048
max_body_bytes = 65536

[[place]]
model = "exod/tiny-qwen2"
ranks = 2
"""


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("api")
    with ready_daemon(tmp, CONFIG, {MODEL: 0, "exod/tiny-slow": 1}) as (url, hf):
        yield {"url": url, "hf": hf, "tmp": tmp}
    assert runner_pids() == []


@pytest.fixture
def client(daemon):
    return openai.OpenAI(base_url=f"{daemon['url']}/v1", api_key="unused", max_retries=0, timeout=60)


def reference(hf, **sampling) -> str:
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = mlx_lm.load(str(resolve_model(MODEL, hf_home=hf, offline=True)))
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    mx.random.seed(sampling["seed"])
    return mlx_lm.generate(model, tokenizer, prompt, max_tokens=10, sampler=make_sampler(temp=sampling["temperature"]))


def written_chunks(url: str, path: str, body: dict) -> list[bytes]:
    """The body of a streamed answer as the server wrote it: each chunk of its chunked encoding (h11 marks
    where each begins and ends, however the network splits them)."""
    address = urlsplit(url)
    raw = json.dumps(body).encode()
    connection = h11.Connection(h11.CLIENT)
    headers = [("host", address.netloc), ("content-type", "application/json"), ("content-length", str(len(raw)))]
    chunks, current = [], b""
    with socket.create_connection((address.hostname, address.port), timeout=60) as sock:
        request = h11.Request(method="POST", target=path, headers=headers)
        sock.sendall(
            connection.send(request) + connection.send(h11.Data(data=raw)) + connection.send(h11.EndOfMessage())
        )
        while not isinstance(event := connection.next_event(), h11.EndOfMessage):
            if event is h11.NEED_DATA:
                connection.receive_data(sock.recv(65536))
            elif isinstance(event, h11.Response):
                assert event.status_code == 200
            elif isinstance(event, h11.Data):
                current += event.data
                if event.chunk_end:
                    chunks.append(current)
                    current = b""
    return chunks


def test_a_streamed_chat_writes_what_is_ready_at_once_as_one_chunk(daemon):
    """The role goes out with the first token, the finish with the usage and ``[DONE]``: one write each,
    not one per event (each write is a trip through the HTTP stack and a system call). Tokens that arrive
    together share a write too, so how many each holds is the runner's timing (tests/test_stream_writes.py
    pins it on a mock clock); what holds here is that nothing waits alone for what follows it."""
    wait_instance(daemon["url"], lambda i: i["state"] == "ready")
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 6, "stream": True, "temperature": 1.0, "seed": 3}
    chunks = written_chunks(daemon["url"], "/v1/chat/completions", body | {"stream_options": {"include_usage": True}})
    events = [[e.removeprefix("data: ") for e in c.decode().split("\n\n") if e] for c in chunks]
    said = [[e if e == "[DONE]" else json.loads(e) for e in chunk] for chunk in events]
    role, *tokens, finish, usage, done = [e for chunk in said for e in chunk]
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert tokens and all("content" in e["choices"][0]["delta"] for e in tokens)  # a token's text may be empty
    assert all(e["choices"][0]["finish_reason"] is None for e in tokens)
    assert finish["choices"][0]["finish_reason"] == "length" and usage["usage"]["completion_tokens"] == 6
    assert done == "[DONE]"
    assert len(said[0]) >= 2 and said[-1][-3:] == [finish, usage, done]  # the role with a token; the end one write


def test_a_streamed_message_writes_what_is_ready_at_once_as_one_chunk(daemon):
    """Anthropic's Messages: the message's and the block's starts with the first text, the deltas as they come,
    the block's stop with the message's delta and stop."""
    wait_instance(daemon["url"], lambda i: i["state"] == "ready")
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 6, "stream": True, "temperature": 1.0, "seed": 3}
    chunks = written_chunks(daemon["url"], "/v1/messages", body)
    kinds = [
        [line.removeprefix("event: ") for line in c.decode().split("\n") if line.startswith("event: ")] for c in chunks
    ]
    start, end = ["message_start", "content_block_start"], ["content_block_stop", "message_delta", "message_stop"]
    deltas = [k for chunk in kinds for k in chunk][len(start) : -len(end)]
    assert deltas and set(deltas) == {"content_block_delta"}  # a token's text may be empty: not each is a delta
    assert kinds[0][:3] == [*start, "content_block_delta"] and kinds[-1][-3:] == end and all(kinds)


def test_openai_client_completion_and_stream_match_mlx_lm(daemon, client):
    sampling = {"temperature": 1.0, "seed": 11}
    expected = reference(daemon["hf"], **sampling)
    done = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, **sampling)
    assert done.object == "chat.completion"
    assert done.choices[0].message.content == expected
    assert done.choices[0].finish_reason in ("length", "stop")
    assert done.usage.completion_tokens == 10 and done.usage.prompt_tokens > 0
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=10,
            stream=True,
            stream_options={"include_usage": True},
            **sampling,
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("length", "stop")
    assert chunks[-1].usage.completion_tokens == 10


def test_models_lists_live_instances_with_their_context_and_when_they_came(daemon, client):
    (model,) = client.models.list().data
    config = resolve_model(MODEL, hf_home=daemon["hf"], offline=True) / "config.json"
    assert model.id == MODEL and model.created == int(config.stat().st_mtime) > 0  # it was 0 (#28)
    assert model.model_extra["context_length"] == model.model_extra["max_model_len"] == 2048
    assert client.models.retrieve(MODEL).model_extra["context_length"] == 2048


def test_unknown_model_is_404_with_a_hint_that_fits_the_name(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="nobody/nothing", messages=MESSAGES)
    assert err.value.body["code"] == "model_not_found"
    assert "exod place nobody/nothing" in err.value.body["message"]
    with pytest.raises(openai.NotFoundError) as err:  # a client's default: no model id, no `exod place` for it
        client.chat.completions.create(model="gpt-3.5-turbo", messages=MESSAGES)
    message = err.value.body["message"]
    assert "exod place gpt-3.5-turbo" not in message and f"the models served: {MODEL}" in message


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL}, "messages"),
        ({"model": MODEL, "messages": []}, "messages"),
        ({"model": MODEL, "messages": MESSAGES, "temperature": 7}, "temperature"),
        ({"model": MODEL, "messages": MESSAGES, "max_tokens": -1}, "max_tokens"),
        ({"model": MODEL, "messages": MESSAGES, "max_tokens": 10**6}, "max_tokens"),
        ({"model": MODEL, "messages": MESSAGES, "n": 0}, "n"),
        ({"model": MODEL, "messages": MESSAGES, "temperature": "hot"}, "temperature"),
        ({"model": MODEL, "messages": MESSAGES, "tools": "get_weather"}, "tools"),
        ({"model": MODEL, "messages": MESSAGES, "tools": [{"type": "function"}]}, "tools.0.function"),
        ({"model": MODEL, "messages": MESSAGES, "top_logprobs": 2}, None),  # needs logprobs: true
        ({"model": MODEL, "messages": MESSAGES, "logit_bias": {"fox": 1}}, "logit_bias"),
        ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ({"model": MODEL, "messages": [{"role": "user"}]}, "messages.0"),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages.0.content",
        ),
    ],
)
def test_invalid_payloads_get_400_in_openai_shape(daemon, body, param):
    response = httpx.post(f"{daemon['url']}/v1/chat/completions", json=body, timeout=10)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]


def test_malformed_json_invalid_utf8_and_huge_bodies(daemon):
    url = f"{daemon['url']}/v1/chat/completions"
    headers = {"content-type": "application/json"}
    malformed = httpx.post(url, content=b'{"model": "m",\n  "messages": [}', headers=headers)
    assert malformed.status_code == 400
    error = malformed.json()["error"]  # where, as an editor says it; no parameter (it was "param": "30", #28)
    assert error["param"] is None and error["message"].endswith("at line 2, column 16")
    assert httpx.post(url, content=b'{"model": "\xff\xfe"}', headers=headers).status_code == 400
    huge = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * 70_000}]})
    response = httpx.post(url, content=huge, headers=headers)
    assert response.status_code == 413 and "body" in response.json()["error"]["message"]


def raw_chat(content: str = "hi", model: str = MODEL, more: str = "") -> bytes:
    """A chat request as the bytes a client sends; JSON escapes such as ``\\ud800`` stay escapes."""
    return f'{{"model": "{model}", "messages": [{{"role": "user", "content": "{content}"}}]{more}}}'.encode()


@pytest.mark.parametrize(
    ("raw", "param"),
    [  # "\\ud800" is valid JSON and not valid Unicode: a lone surrogate
        (raw_chat(more=', "stop": "\\ud800"'), "stop"),
        (raw_chat(more=', "stop": ["ok", "\\udc00"]'), "stop"),
        (raw_chat(content="a\\ud800b"), "messages.0.content"),
        (raw_chat(model="exod/\\ud800"), "model"),
        (raw_chat(more=', "user": "\\udfff"'), "user"),
    ],
)
def test_lone_surrogates_are_a_400_naming_the_parameter(daemon, raw, param):
    url = daemon["url"]
    response = httpx.post(f"{url}/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]
    assert httpx.get(f"{url}/metrics").status_code == 200  # nothing unencodable reached a metric label


def test_an_error_echoing_a_lone_surrogate_still_encodes():
    from exod.api.errors import ApiError

    response = ApiError(400, "no such thing: \ud800", param="x\udc00").response()
    assert json.loads(response.body)["error"] == {
        "message": "no such thing: \\ud800",
        "type": "invalid_request_error",
        "param": "x\\udc00",
        "code": None,
    }


def test_a_lone_surrogate_in_a_placement_is_a_400(daemon):
    raw = rb'{"model": "exod/\ud800", "ranks": 1}'
    response = httpx.post(f"{daemon['url']}/instances", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "model"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/instances", {"model": MODEL, "ranks": True}, "ranks"),
        ("/instances", {"model": MODEL, "ranks": "2"}, "ranks"),
        ("/instances", {"model": MODEL, "ranks": 2.0}, "ranks"),
        ("/instances", {"model": MODEL, "retry": {"max_retries": True}}, "retry.max_retries"),
        ("/instances", {"model": MODEL, "retry": {"max_failures": True}}, "retry.max_failures"),
        ("/instances", {"model": MODEL, "retry": {"max_failures": 2, "max_retries": 2}}, "retry"),  # one name only
        ("/instances", {"model": MODEL, "retry": {"initial": "1.5"}}, "retry.initial"),
        ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": "5"}, "max_tokens"),
        ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": True}, "max_tokens"),
        ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "n": True}, "n"),
        ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "stream": 1}, "stream"),
        ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "stream": "true"}, "stream"),
        ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "temperature": "1"}, "temperature"),
        ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "seed": True}, "seed"),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": MESSAGES, "stream_options": {"include_usage": "yes"}},
            "stream_options.include_usage",
        ),
    ],
)
def test_numbers_and_booleans_are_not_coerced(daemon, path, body, param):
    """OpenAI refuses a string for a number and a boolean for an int; a coerced `"ranks": true` would place 1."""
    before = len(httpx.get(f"{daemon['url']}/instances").json()["instances"])
    response = httpx.post(f"{daemon['url']}{path}", json=body, timeout=10)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert len(httpx.get(f"{daemon['url']}/instances").json()["instances"]) == before  # nothing placed


def test_integral_floats_and_ints_for_floats_are_still_numbers(daemon, client):
    done = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1, temperature=0, top_p=1)
    assert done.usage.completion_tokens == 1


@pytest.mark.parametrize(
    ("headers", "params", "param"),
    [
        ({"Last-Event-ID": str(2**63)}, {}, "last-event-id"),
        ({"Last-Event-ID": "-1"}, {}, "last-event-id"),
        ({"Last-Event-ID": "seven"}, {}, "last-event-id"),
        ({}, {"after": str(2**63)}, "after"),
    ],
)
def test_event_ids_beyond_int64_are_a_400_before_the_stream(daemon, headers, params, param):
    response = httpx.get(f"{daemon['url']}/events", headers=headers, params=params, timeout=10)
    assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_an_event_id_beyond_the_newest_waits_for_newer_events(daemon):
    headers = {"Last-Event-ID": str(2**63 - 1)}
    with httpx.stream("GET", f"{daemon['url']}/events", headers=headers, timeout=3) as response:
        assert response.status_code == 200
        with pytest.raises(httpx.ReadTimeout):  # nothing to send: no error either, the stream stays open
            next(response.iter_lines())


def test_openapi_documents_the_statuses_the_api_sends(daemon):
    spec = httpx.get(f"{daemon['url']}/openapi.json").json()
    error = {"$ref": "#/components/schemas/ErrorBody"}
    anthropic = {"$ref": "#/components/schemas/AnthropicErrorBody"}
    ollama = {"$ref": "#/components/schemas/OllamaErrorBody"}
    assert "HTTPValidationError" not in spec["components"]["schemas"]
    assert set(spec["components"]["schemas"]["ErrorBody"]["properties"]) == {"error"}
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            answers = operation["responses"]
            assert "422" not in answers, (method, path)
            assert "401" not in answers, (method, path)  # this daemon has no API key
            assert {"408", "413"} <= set(answers), (method, path)
            shape = anthropic if path.startswith("/v1/messages") else ollama if path.startswith("/api/") else error
            if operation.get("parameters") or operation.get("requestBody"):
                assert answers["400"]["content"]["application/json"]["schema"] == shape, (method, path)
    paths = spec["paths"]
    assert {"400", "404", "429", "502", "503"} <= set(paths["/v1/chat/completions"]["post"]["responses"])
    assert "404" in paths["/instances/{instance_id}"]["get"]["responses"]
    assert "404" in paths["/instances/{instance_id}"]["delete"]["responses"]
    assert {"400", "404", "501"} <= set(paths["/diagrams/{machine}"]["get"]["responses"])
    assert "503" in paths["/ready"]["get"]["responses"]


KEYED_CONFIG = """
[daemon]
port = 0
offline = true
"""


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    """A daemon with an API key and nothing placed: the guard is all there is to test."""
    tmp = tmp_path_factory.mktemp("keyed")
    (tmp / "exod.toml").write_text(KEYED_CONFIG)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    process, url = start_daemon(tmp, env, "--no-place", "--api-key", "s3cret", "--cors-origin", "http://app.test")
    try:
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0


@pytest.mark.parametrize(
    "authorization",
    ["Bearer s3crét".encode(), b"Bearer \xff\xfe", "Bearer ключ".encode(), b"\x80"],
)
def test_a_non_ascii_authorization_is_a_401_in_openai_shape(keyed, authorization):
    response = httpx.get(f"{keyed}/instances", headers={"Authorization": authorization})
    assert response.status_code == 401, response.text
    assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{keyed}/instances", headers={"Authorization": "Bearer s3cret"}).status_code == 200


def test_with_an_api_key_openapi_documents_401_and_how_to_authenticate_everywhere_but_health(keyed):
    spec = httpx.get(f"{keyed}/openapi.json", headers={"Authorization": "Bearer s3cret"}).json()
    schemes = spec["components"]["securitySchemes"]
    assert schemes["bearer"] == {"type": "http", "scheme": "bearer"}
    assert schemes["apiKey"] == {"type": "apiKey", "in": "header", "name": "x-api-key"}
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            assert ("401" in operation["responses"]) == (path != "/health"), (method, path)
            expected = None if path == "/health" else [{"bearer": []}, {"apiKey": []}]
            assert operation.get("security") == expected, (method, path)


def test_the_dashboard_page_asks_for_the_key_and_its_assets_are_all_served_here(keyed, daemon):
    """The page holds no data (served without the key, it says a key is needed); every asset it names is the
    daemon's own, and its Content-Security-Policy lets it load nothing from elsewhere."""
    import re

    page = httpx.get(f"{keyed}/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<meta name="exod-auth" content="key">' in page.text
    assert '<meta name="exod-auth" content="none">' in httpx.get(f"{daemon['url']}/").text
    assert "default-src 'none'" in page.headers["content-security-policy"]
    assets = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert sorted(assets) == ["/ui/dashboard.css", "/ui/dashboard.js", "data:,"]
    for asset in (a for a in assets if a.startswith("/ui/")):
        served = httpx.get(f"{keyed}{asset}")
        assert served.status_code == 200 and served.content, asset
        assert not re.search(r"https?://", served.text), f"{asset} names another host"
    assert httpx.get(f"{keyed}/ui/missing.js").status_code == 404
    docs = httpx.get(f"{daemon['url']}/docs").text  # Swagger UI from the package too: /docs works offline
    assert not re.search(r'(?:src|href)="https?://', docs)
    for asset in re.findall(r"""['"](/ui/vendor/[^'"]+)['"]""", docs):
        assert httpx.get(f"{daemon['url']}{asset}").status_code == 200, asset
    assert httpx.get(f"{keyed}/instances").status_code == 401  # the data behind the page still needs the key


def test_a_browser_page_of_a_listed_origin_may_call_with_the_key_it_holds_and_no_other_page_may(keyed, daemon):
    """#28: CORS, opt-in (`--cors-origin`). The preflight is answered without the key (browsers send none with
    it); the call itself still needs the key, which no answer reflects; the default daemon allows no origin."""
    preflight = {"origin": "http://app.test", "access-control-request-method": "POST"}
    preflight["access-control-request-headers"] = "authorization,content-type"
    answered = httpx.options(f"{keyed}/v1/chat/completions", headers=preflight)
    assert answered.status_code == 200 and answered.headers["access-control-allow-origin"] == "http://app.test"
    assert "access-control-allow-credentials" not in answered.headers
    called = httpx.get(f"{keyed}/instances", headers={"origin": "http://app.test", "authorization": "Bearer s3cret"})
    assert called.status_code == 200 and called.headers["access-control-allow-origin"] == "http://app.test"
    assert "s3cret" not in str(called.headers) + called.text
    unkeyed = httpx.get(f"{keyed}/instances", headers={"origin": "http://app.test"})
    assert unkeyed.status_code == 401 and unkeyed.headers["access-control-allow-origin"] == "http://app.test"
    for url, origin in ((keyed, "http://evil.test"), (daemon["url"], "http://app.test")):
        refused = httpx.options(f"{url}/v1/chat/completions", headers={**preflight, "origin": origin})
        assert "access-control-allow-origin" not in refused.headers, url
        assert "access-control-allow-origin" not in httpx.get(f"{url}/health", headers={"origin": origin}).headers


def test_cors_origin_repeated_allows_each_origin_given_and_replaces_the_files(tmp_path):
    """#28: ``--cors-origin`` twice: both pages' preflights are answered, a third page's and the one the
    file's ``[api] cors_origins`` named are not (the flag replaces the file's list)."""
    (tmp_path / "exod.toml").write_text(KEYED_CONFIG + '\n[api]\ncors_origins = ["http://file.test"]\n')
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    flags = ("--cors-origin", "http://one.test", "--cors-origin", "https://two.test:8443")
    process, url = start_daemon(tmp_path, env, "--no-place", *flags)
    try:
        preflight = {"access-control-request-method": "POST", "access-control-request-headers": "content-type"}

        def allowed(origin: str) -> str | None:
            answer = httpx.options(f"{url}/v1/chat/completions", headers={**preflight, "origin": origin})
            return answer.headers.get("access-control-allow-origin") if answer.status_code == 200 else None

        assert allowed("http://one.test") == "http://one.test"
        assert allowed("https://two.test:8443") == "https://two.test:8443"
        assert allowed("http://three.test") is None and allowed("http://file.test") is None
        got = httpx.get(f"{url}/health", headers={"origin": "https://two.test:8443"})
        assert got.headers["access-control-allow-origin"] == "https://two.test:8443"
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0


def test_every_answer_names_its_request_and_head_is_answered_where_get_is(daemon, keyed):
    """#28: ``x-request-id`` on every response, the client's own echoed; HEAD as HTTP says (it was a 405)."""
    url = daemon["url"]
    given = httpx.get(f"{url}/v1/models", headers={"x-request-id": "trace-1"})
    assert given.headers["x-request-id"] == "trace-1"
    assert httpx.get(f"{keyed}/instances").headers["x-request-id"].startswith("req_")  # a 401 too
    for path in ("/", "/health", "/v1/models", "/metrics", "/events"):  # /events: an endless stream
        head = httpx.head(f"{url}{path}", timeout=10)
        assert head.status_code == 200 and head.content == b"", path
        if path != "/events":
            assert head.headers["content-type"] == httpx.get(f"{url}{path}").headers["content-type"], path


def test_instances_create_list_get_and_503_before_ready_then_delete(daemon, client):
    url = daemon["url"]
    created = httpx.post(f"{url}/instances", json={"model": "exod/tiny-slow", "ranks": 1})
    assert created.status_code == 201
    iid = created.json()["instance_id"]
    with pytest.raises(openai.InternalServerError) as err:  # placed, not Ready yet
        client.chat.completions.create(model="exod/tiny-slow", messages=MESSAGES)
    assert err.value.status_code == 503 and int(err.value.response.headers["retry-after"]) >= 1
    assert iid in [i["instance_id"] for i in httpx.get(f"{url}/instances").json()["instances"]]
    wait_instance_by_id(url, iid, "ready")
    assert client.chat.completions.create(model="exod/tiny-slow", messages=MESSAGES, max_tokens=3).choices
    deleted = httpx.delete(f"{url}/instances/{iid}")
    assert deleted.status_code == 200 and deleted.json()["delete_reason"] == "requested"
    assert httpx.delete(f"{url}/instances/nope").status_code == 404
    assert httpx.post(f"{url}/instances", json={"model": "../../etc/passwd"}).status_code == 400
    assert httpx.post(f"{url}/instances", json={"model": "/etc/passwd"}).status_code == 400


def wait_instance_by_id(url: str, iid: str, state: str, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        inst = httpx.get(f"{url}/instances/{iid}").json()
        if inst["state"] == state:
            return inst
        time.sleep(0.05)
    raise AssertionError(f"{iid} never reached {state}")


def test_past_the_queue_bound_is_429(daemon):
    url = f"{daemon['url']}/v1/chat/completions"
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2000, "temperature": 1.0, "seed": 1}
    statuses: list[int] = []

    def one() -> None:
        statuses.append(httpx.post(url, json=body, timeout=120).status_code)

    threads = [threading.Thread(target=one) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(150)
    assert sorted(statuses).count(200) >= 3 and 429 in statuses, statuses


def test_event_stream_shows_placement_transitions_and_resumes(daemon):
    def read(headers: dict[str, str], count: int) -> list[tuple[int, dict]]:
        events = []
        with httpx.stream("GET", f"{daemon['url']}/events", headers=headers, timeout=10) as response:
            seq = None
            for line in response.iter_lines():
                if line.startswith("id: "):
                    seq = int(line[4:])
                elif line.startswith("data: "):
                    events.append((seq, json.loads(line[6:])))
                    if len(events) == count:
                        break
        return events

    first = read({}, 12)
    moves = [(e["machine"], e["from"], e["to"]) for _, e in first]
    assert ("instance", "", "pending") in moves and ("instance", "pending", "starting") in moves
    assert any(m[0] == "runner" and m[2] == "joining" for m in moves)
    assert [s for s, _ in first] == list(range(1, 13))
    resumed = read({"Last-Event-ID": "5"}, 3)
    assert [s for s, _ in resumed] == [6, 7, 8]
    assert resumed[0][1] == first[5][1]


def test_metrics_parse_and_count(daemon, client):
    client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
    for n in range(20):  # made-up names, as a client may send: one series for all, not one each (issue #25)
        body = {"model": f"org/made-up-{n}", "messages": MESSAGES}
        assert httpx.post(f"{daemon['url']}/v1/chat/completions", json=body, timeout=10).status_code == 404
    text = httpx.get(f"{daemon['url']}/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    runners = {s.labels["state"]: s.value for s in families["exod_runners"].samples}
    assert runners["ready"] >= 2
    requests = [s for s in families["exod_requests"].samples if s.name == "exod_requests_total"]
    assert any(s.labels == {"model": MODEL, "outcome": "ok"} and s.value >= 1 for s in requests)
    assert not [s for s in requests if s.labels["model"].startswith("org/made-up")]  # no series of their own
    assert sum(s.value for s in requests if s.labels["model"] == "(not placed)") >= 20
    assert any(s.value >= 4 for s in families["exod_tokens_generated"].samples if s.name.endswith("_total"))
    assert "exod_request_seconds" in families and "exod_runner_failures" in families
    # what each instance decodes at once, sized from kv_cache_mib and the model, and why (issue #30)
    ready = [i for i in httpx.get(f"{daemon['url']}/instances").json()["instances"] if i["state"] == "ready"]
    assert ready and all(i["batch"]["max_sequences"] == 64 for i in ready)
    assert all("kv_cache_mib 2048 holds" in i["batch"]["why"] for i in ready)
    sized = {s.labels["instance"]: s.value for s in families["exod_max_sequences"].samples}
    assert all(sized[i["instance_id"]] == 64 for i in ready)


def test_health_ready_openapi_and_diagrams(daemon):
    url = daemon["url"]
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{url}/ready").status_code == 200
    spec = httpx.get(f"{url}/openapi.json").json()
    assert "/v1/chat/completions" in spec["paths"] and "/instances/{instance_id}" in spec["paths"]
    mermaid = httpx.get(f"{url}/diagrams/runner", params={"format": "mermaid", "state": "busy"})
    assert mermaid.status_code == 200 and "class busy current" in mermaid.text
    assert httpx.get(f"{url}/diagrams/runner", params={"state": "nope"}).status_code == 400
    assert httpx.get(f"{url}/diagrams/nope").status_code == 404
    iid = httpx.get(f"{url}/instances").json()["instances"][0]["instance_id"]
    live = httpx.get(f"{url}/instances/{iid}/diagram", params={"format": "dot"})
    assert live.status_code == 200 and "digraph" in live.text
    svg = httpx.get(f"{url}/diagrams/instance", params={"format": "svg"})
    if svg.status_code == 501:  # no Graphviz here: the error says how to get it
        assert "graphviz" in svg.json()["error"]["message"].lower()
    else:
        assert svg.status_code == 200 and svg.text.lstrip().startswith("<?xml") and "<svg" in svg.text


def test_runner_killed_mid_stream_ends_with_an_error_event_then_done(daemon):
    url = daemon["url"]
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2000, "stream": True, "temperature": 1.0, "seed": 3}
    lines: list[str] = []
    start = None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=30) as response:
        for line in response.iter_lines():
            if not line:
                continue
            lines.append(line)
            if len(lines) == 3 and start is None:  # tokens are flowing: kill rank 0
                start = time.monotonic()
                os.kill(runner_pids()[0], signal.SIGKILL)
    elapsed = time.monotonic() - start
    assert lines[-1] == "data: [DONE]"
    assert "error" in json.loads(lines[-2][6:]) and "failed" in lines[-2]
    assert elapsed < 5
    wait_instance(url, lambda i: i["state"] == "ready" and i["generation"] >= 2)


def test_schemathesis_finds_no_server_error_and_the_daemon_still_serves(daemon, client):
    """Random valid and invalid requests for every read-only and chat operation of /openapi.json."""
    import schemathesis

    url = daemon["url"]
    schema = schemathesis.openapi.from_dict(httpx.get(f"{url}/openapi.json").json())
    tried = []
    for result in schema.get_all_operations():
        operation = result.ok()
        if (operation.method.upper(), operation.path) in {
            ("POST", "/instances"),
            ("DELETE", "/instances/{instance_id}"),
        }:
            continue  # these start and stop real processes; they have their own tests above
        if operation.path == "/events":
            continue  # an endless stream by design

        fuzz = _no_server_error(operation, url)
        fuzz()
        tried.append(operation.path)
    assert "/v1/chat/completions" in tried and "/instances/{instance_id}" in tried
    assert client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2).choices  # still serving


def _no_server_error(operation, url: str):
    """No 5xx but the documented 501 (SVG without Graphviz), every status documented, every body as documented."""
    from hypothesis import HealthCheck, given, settings
    from schemathesis.checks import not_a_server_error, response_schema_conformance, status_code_conformance

    allowed = {501} if operation.path == "/diagrams/{machine}" else set()
    checks = [status_code_conformance, response_schema_conformance]

    @settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(case=operation.as_strategy())
    def fuzz(case) -> None:
        response = case.call(base_url=url, timeout=30)
        assert response.status_code < 500 or response.status_code in allowed, (
            f"{case.method} {case.formatted_path} -> {response.status_code}: {response.text[:300]}"
        )
        case.validate_response(response, checks=checks if allowed else [not_a_server_error, *checks])

    return fuzz


def test_openai_client_example_and_exod_chat_run_against_the_daemon(daemon):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "HF_HOME": str(daemon["hf"])}
    example = subprocess.run(
        [sys.executable, str(root / "examples" / "openai_client.py"), "--url", daemon["url"], "--model", MODEL],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert example.returncode == 0, example.stderr
    assert f"models: ['{MODEL}']" in example.stdout and "(16 tokens)" in example.stdout
    assert example.stdout.count("stream: ") == 1
    chat = subprocess.run(
        [
            sys.executable,
            "-m",
            "exod",
            "chat",
            MODEL,
            "hello",
            "--max-tokens",
            "5",
            "--seed",
            "2",
            "--temperature",
            "1",
            "--url",
            daemon["url"],
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout.strip()
    missing = subprocess.run(
        [sys.executable, "-m", "exod", "chat", "nobody/nothing", "hi", "--url", daemon["url"]],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert missing.returncode == 1 and "404" in missing.stderr


def test_runner_killed_during_a_non_streaming_request_is_a_502_not_a_hang(daemon):
    url = daemon["url"]
    wait_instance(url, lambda i: i["state"] == "ready")
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2000, "temperature": 1.0, "seed": 5}
    result: dict[str, httpx.Response] = {}
    worker = threading.Thread(
        target=lambda: result.update(r=httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60))
    )
    worker.start()
    time.sleep(0.5)  # generating by now
    killed_at = time.monotonic()
    os.kill(runner_pids()[-1], signal.SIGKILL)
    worker.join(30)
    assert not worker.is_alive()
    assert result["r"].status_code == 502 and result["r"].json()["error"]["type"] == "server_error"
    assert time.monotonic() - killed_at < 5
    wait_instance(url, lambda i: i["state"] == "ready")


def test_abandoned_streams_are_dropped_from_the_batch_and_their_slots_come_back(daemon):
    """A client that hangs up is dropped from its runner's batch on every rank (`Cancel`); its slot counts
    until the runners say so, then serves the next request (the exact step: tests/test_runner_process.py)."""
    url = f"{daemon['url']}/v1/chat/completions"
    wait_instance(daemon["url"], lambda i: i["state"] == "ready")
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2000, "stream": True, "temperature": 1.0, "seed": 9}
    for _ in range(3):  # the queue bound of this daemon
        with httpx.stream("POST", url, json=body, timeout=30) as response:
            assert response.status_code == 200
            next(response.iter_lines())  # one chunk, then hang up
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:  # once the runners are through, the slots are free again
        done = httpx.post(url, json={**body, "stream": False, "max_tokens": 4}, timeout=60)
        if done.status_code == 200:
            break
        time.sleep(0.5)
    assert done.status_code == 200
    text = httpx.get(f"{daemon['url']}/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    outcomes = {s.labels["outcome"]: s.value for s in families["exod_requests"].samples if s.name.endswith("_total")}
    assert outcomes.get("cancelled", 0) >= 3


# -- what real clients send (#14) ----------------------------------------------------------------------


def test_parameters_exod_has_no_use_for_are_ignored_and_nulls_mean_the_default(client):
    """What clients send routinely: OpenAI's server and mlx_lm.server accept all of it, so does exod."""
    done = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "developer", "content": "Answer briefly.", "name": "ops"},
            {"role": "user", "content": [{"type": "text", "text": "Tell me "}, {"type": "text", "text": "a story."}]},
        ],
        max_tokens=3,
        temperature=None,
        top_p=None,
        response_format={"type": "json_object"},
        presence_penalty=0.5,
        frequency_penalty=0.5,
        parallel_tool_calls=True,
        stream_options=None,
        extra_body={"store": False, "metadata": {"k": "v"}, "service_tier": "auto", "frobnicate": True},
    )
    assert 1 <= done.usage.completion_tokens <= 3 and done.choices[0].finish_reason in ("length", "stop")  # sampled


def test_n_choices_are_n_samples(client):
    done = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, n=3, temperature=1.0, seed=7)
    assert [c.index for c in done.choices] == [0, 1, 2]
    assert done.usage.prompt_tokens > 0 and done.usage.completion_tokens <= 24  # the prompt counted once
    assert all(c.finish_reason in ("length", "stop") for c in done.choices)
    assert len({c.message.content for c in done.choices}) > 1  # three samples, not one thrice


def test_logprobs_are_the_models_own_greedy_picks_its_likeliest(client):
    done = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    content = done.choices[0].logprobs.content
    assert len(content) == 6
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        ranked = [alt.logprob for alt in entry.top_logprobs]
        assert ranked == sorted(ranked, reverse=True)
        assert entry.token == entry.top_logprobs[0].token and entry.logprob == ranked[0]  # greedy: the top one
    assert "".join(e.token for e in content) == done.choices[0].message.content


def test_streamed_logprobs_come_with_their_tokens(client):
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True, stream=True
        )
    )
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(entries) == 4 and all(e.logprob <= 0 and e.top_logprobs == [] for e in entries)


def test_logit_bias_steers_sampling(daemon, client):
    first = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1, temperature=0, logprobs=True)
    token = first.choices[0].logprobs.content[0].token
    runner_up = (
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=1, temperature=0, logprobs=True, top_logprobs=2
        )
        .choices[0]
        .logprobs.content[0]
        .top_logprobs[1]
        .token
    )
    assert runner_up != token
    ids = tokenizer_ids(daemon["hf"], runner_up)
    forced = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=1, temperature=0, logit_bias={str(ids[0]): 100}
    )
    assert forced.choices[0].message.content == runner_up.lstrip()  # +100 on a logit: greedy picks it


def tokenizer_ids(hf, text: str) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(MODEL, hf_home=hf, offline=True)))
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == 1, (text, ids)
    return ids


def test_a_model_by_id_and_an_unknown_one(client):
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nobody/nothing")


def test_text_completions_with_echo_logprobs_and_a_token_prompt(daemon, client):
    done = client.completions.create(
        model=MODEL, prompt="The quick brown", max_tokens=4, temperature=0, logprobs=2, echo=True
    )
    choice = done.choices[0]
    prompt = httpx.post(f"{daemon['url']}/tokenize", json={"model": MODEL, "prompt": "The quick brown"}).json()
    assert choice.text.startswith("The quick brown")  # with echo, the prompt's tokens lead the log-probabilities
    assert len(choice.logprobs.tokens) == prompt["count"] + 4 and "".join(choice.logprobs.tokens) == choice.text
    assert choice.logprobs.text_offset[prompt["count"]] == len("The quick brown")
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None  # nothing before
    assert all(len(top) == 2 for top in choice.logprobs.top_logprobs[1:])
    by_tokens = client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=2, temperature=0)
    assert by_tokens.usage.prompt_tokens == 3 and by_tokens.usage.completion_tokens == 2
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=MODEL, prompt="The quick brown", max_tokens=4, temperature=0, stream=True
        )
    )
    again = client.completions.create(model=MODEL, prompt="The quick brown", max_tokens=4, temperature=0)
    assert streamed == again.choices[0].text == choice.text.removeprefix("The quick brown")


def test_an_anthropic_client_authenticates_with_x_api_key(keyed):
    assert httpx.get(f"{keyed}/v1/models", headers={"x-api-key": "s3cret"}).status_code == 200
    denied = httpx.post(f"{keyed}/v1/messages", headers={"x-api-key": "wrong"}, json={})
    assert denied.status_code == 401 and denied.json()["error"]["type"] == "authentication_error"  # its shape


def test_anthropic_top_k_of_one_is_greedy(daemon):
    """top_k reaches mlx-lm's sampler: keeping only the likeliest token, any temperature samples it."""
    import anthropic

    claude = anthropic.Anthropic(base_url=daemon["url"], api_key="unused", max_retries=0, timeout=60)
    ask = [{"role": "user", "content": "Tell me about state machines."}]
    greedy = claude.messages.create(model=MODEL, max_tokens=8, messages=ask, extra_body={"temperature": 0})
    sampled = {"temperature": 1, "top_k": 1}  # as raw fields: this client version no longer has the arguments
    hot = [claude.messages.create(model=MODEL, max_tokens=8, messages=ask, extra_body=sampled) for _ in range(3)]
    assert {m.content[0].text for m in hot} == {greedy.content[0].text}
