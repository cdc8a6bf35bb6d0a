"""#48: every body is read as JSON whatever its Content-Type says, as Ollama and mlx_lm.server read theirs — a real
`exod serve`, a real runner, the tiny model, raw HTTP and curl as their users type them.

Ollama's own documentation calls it with ``curl http://localhost:11434/api/chat -d '{…}'``, which curl sends as
``application/x-www-form-urlencoded``; exod answered 400 "Input should be a valid dictionary". A body that is not
JSON is a 400 that says so in the dialect's shape; a web page of another site may still not send one unasked.
"""

from __future__ import annotations

import json
import shutil
import subprocess

import httpx
import pytest

from daemon_harness import placing, ready_daemon, runner_pids, wait_instance

MODEL = "exod/tiny-qwen2"
CONFIG = placing(MODEL)
ASK = [{"role": "user", "content": "Tell me about state machines."}]
# Each dialect's request, and what its answer always holds; every one asks for a couple of tokens only.
DIALECTS = {
    "/v1/chat/completions": ({"model": MODEL, "messages": ASK, "max_tokens": 2}, lambda a: a["choices"][0]["message"]),
    "/api/chat": (
        {"model": MODEL, "messages": ASK, "stream": False, "options": {"num_predict": 2}},
        lambda a: a["message"]["role"] == "assistant" and a["done"],
    ),
    "/v1/messages": ({"model": MODEL, "messages": ASK, "max_tokens": 2}, lambda a: a["type"] == "message"),
}
# What the content type was: curl -d's form, text/plain (a browser's or a hand-written script's), none (a raw socket).
CONTENT_TYPES = {
    "form": {"content-type": "application/x-www-form-urlencoded"},
    "text": {"content-type": "text/plain; charset=utf-8"},
    "none": {},
}
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with ready_daemon(tmp_path_factory.mktemp("content-types"), CONFIG, {MODEL: 0}) as (url, _):
        yield url
    assert runner_pids() == []


def post(url: str, body: bytes, headers: dict[str, str]) -> httpx.Response:
    """``body`` sent as it is, with exactly ``headers`` (httpx adds no Content-Type to raw content)."""
    with httpx.Client(timeout=60) as client:
        request = client.build_request("POST", url, content=body, headers=headers)
        assert request.headers.get("content-type") == headers.get("content-type")
        return client.send(request)


@pytest.mark.parametrize("kind", CONTENT_TYPES)
@pytest.mark.parametrize("path", DIALECTS)
def test_a_json_body_is_read_whatever_its_content_type(daemon, path, kind):
    body, answered = DIALECTS[path]
    response = post(f"{daemon}{path}", json.dumps(body).encode(), CONTENT_TYPES[kind])
    assert response.status_code == 200, response.text
    assert answered(response.json())


def test_curl_d_as_ollamas_documentation_types_it_streams_a_generation(daemon):
    curl = shutil.which("curl")
    assert curl, "curl is not installed: this test is curl's documented use"
    body = json.dumps({"model": MODEL, "prompt": "Why is the sky blue?", "options": {"num_predict": 3}})
    done = subprocess.run([curl, "-sS", "-v", f"{daemon}/api/generate", "-d", body], capture_output=True, timeout=60)
    sent = done.stderr.decode()
    assert "Content-Type: application/x-www-form-urlencoded" in sent  # what curl -d sends, so what this test tries
    assert done.returncode == 0 and "< HTTP/1.1 200" in sent, sent
    lines = [json.loads(line) for line in done.stdout.decode().splitlines()]  # Ollama's stream: NDJSON by default
    assert lines[-1]["done"] is True and all(line["model"] == MODEL for line in lines)
    assert all(not line["done"] for line in lines[:-1]) and lines[-1]["eval_count"] >= 1


# The dialect's error shape, and its message, for each path.
SHAPES = {
    "/v1/chat/completions": lambda e: e["error"]["message"],
    "/api/chat": lambda e: e["error"],
    "/v1/messages": lambda e: (
        e["type"] == "error" and e["error"]["type"] == "invalid_request_error" and e["error"]["message"]
    ),
}


@pytest.mark.parametrize(
    ("kind", "body", "why"),
    [
        ("form", b"model=exod/tiny-qwen2&prompt=hi", "Expecting value at line 1, column 1"),
        ("text", b'{"model": "exod/tiny-qwen2",\n "messages": [}', "at line 2, column 15"),
        ("none", b'{"model": "\xc3\x28"}', "not UTF-8"),
    ],
)
@pytest.mark.parametrize("path", SHAPES)
def test_a_body_that_is_not_json_is_a_400_saying_so_and_the_daemon_goes_on(daemon, path, kind, body, why):
    response = post(f"{daemon}{path}", body, CONTENT_TYPES[kind])
    assert response.status_code == 400, response.text
    message = SHAPES[path](response.json())
    assert message.startswith("the request body must be JSON") and why in message, message
    declared = CONTENT_TYPES[kind].get("content-type")
    assert (f"Content-Type: {declared}" if declared else "no Content-Type") in message
    # nothing broke: the runner still serves, the same dialect answers a good request
    assert wait_instance(daemon, lambda i: i["state"] == "ready", timeout=5)
    good, answered = DIALECTS[path]
    assert answered(post(f"{daemon}{path}", json.dumps(good).encode(), CONTENT_TYPES[kind]).json())


def test_a_page_of_another_site_cannot_send_a_body_unasked(daemon):
    """A browser sends a form or text/plain body anywhere without a CORS preflight: read as JSON, it would let any
    page a user visits place models or run generations here. Such a request is refused, and changes nothing."""
    before = httpx.get(f"{daemon}/instances").json()["instances"]
    place = json.dumps({"model": MODEL, "ranks": 1}).encode()
    for headers in ({"content-type": "text/plain"}, {"content-type": "application/x-www-form-urlencoded"}, {}):
        refused = post(f"{daemon}/instances", place, {**headers, "origin": "https://attacker.example"})
        assert refused.status_code == 403, refused.text
        assert "application/json" in refused.json()["error"]["message"]
        park = post(f"{daemon}/instances/{before[0]['instance_id']}/park", b"", {"origin": "https://attacker.example"})
        assert park.status_code == 403  # no body at all: refused the same
    assert httpx.get(f"{daemon}/instances").json()["instances"] == before
    chat, answered = DIALECTS["/api/chat"]
    refused = post(f"{daemon}/api/chat", json.dumps(chat).encode(), {"origin": "null", **CONTENT_TYPES["text"]})
    assert refused.status_code == 403 and "Origin: null" in refused.json()["error"]  # Ollama's shape there too
    # the daemon's own pages (the dashboard: its origin is the address it calls) and JSON from anywhere still go
    own = post(f"{daemon}/api/chat", json.dumps(chat).encode(), {"origin": daemon, **CONTENT_TYPES["text"]})
    assert own.status_code == 200 and answered(own.json())
    declared = post(f"{daemon}/api/chat", json.dumps(chat).encode(), {"origin": "https://x.example", **JSON})
    assert declared.status_code == 200 and answered(declared.json())
