"""When a streamed answer is written: what is said goes out as soon as the next part must be waited for, and
what is here at once goes out as one write (`exod.requests.RequestStream.ready`).

Each write is a trip through the HTTP stack and a system call (bench/request_cost.py); holding one part for
the next makes the client wait. The app is called as hypercorn calls it, so each ``http.response.body``
message is one write, on trio's MockClock with fake runners (tests/fake_runners.py) that say a token every
`Timing.token` seconds and their `Done` with the last: every time asserted exactly.
"""

from __future__ import annotations

import json
from typing import Any

import trio
from fake_runners import TOKENS, Timing
from test_controller_clock import MODEL, Sim, simulate, until

from daemon_harness import instance
from exod.api.app import create_app

TOKEN_S = Timing().token
N = 4  # tokens asked for: the last comes with its Done


async def writes(app: Any, path: str, body: dict[str, Any]) -> list[tuple[float, bytes]]:
    """What the app wrote as the body of its answer to ``body``, each write with its (virtual) time since the
    request was sent."""
    raw = json.dumps(body).encode()
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())],
        "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2), "state": {},
    }  # fmt: skip
    sent = False
    written: list[tuple[float, bytes]] = []
    start = trio.current_time()

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await trio.sleep_forever()  # the client stays until the answer ends
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            assert message["status"] == 200, message
        elif message["body"] or not message.get("more_body", False):
            written.append((trio.current_time() - start, message["body"]))

    await app(scope, receive, send)
    assert written[-1][1] == b"", "the body's end is its own message (hypercorn writes the last chunk)"
    return written[:-1]


def serve(tmp_path, path: str, body: dict[str, Any]) -> list[tuple[float, bytes]]:
    async def run(sim: Sim) -> list[tuple[float, bytes]]:
        iid = await sim.controller.place(MODEL, 1)
        await until(sim.controller, lambda s: instance(s, iid)["state"] == "ready")
        return await writes(create_app(sim.controller), path, body)

    return simulate(tmp_path, run)


def events(chunk: bytes) -> list[Any]:
    data = [line.removeprefix(b"data: ") for line in chunk.split(b"\n") if line.startswith(b"data: ")]
    return [d.decode() if d == b"[DONE]" else json.loads(d) for d in data]


def test_a_chat_writes_each_token_when_it_comes_and_the_last_with_its_finish_usage_and_done(tmp_path):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": N, "stream": True}
    written = serve(tmp_path, "/v1/chat/completions", body | {"stream_options": {"include_usage": True}})
    times = [t for t, _ in written]
    assert times == [times[0] + k * TOKEN_S for k in range(N)]  # each token at once: none held for the next
    said = [events(chunk) for _, chunk in written]
    role, first = said[0]  # the role with the first token, not alone a token's time before it
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [[e["choices"][0]["delta"] for e in chunk] for chunk in said[1:-1]] == [
        [{"content": text}] for text in TOKENS[1 : N - 1]
    ]
    last, finish, usage, done = said[-1]  # the last token came with its Done: one write
    assert first["choices"][0]["delta"] == {"content": TOKENS[0]}
    assert last["choices"][0]["delta"] == {"content": TOKENS[N - 1]} and last["choices"][0]["finish_reason"] is None
    assert finish["choices"][0]["finish_reason"] == "length" and usage["usage"]["completion_tokens"] == N
    assert done == "[DONE]"


def test_a_message_writes_each_token_when_it_comes_and_the_last_with_the_message_s_end(tmp_path):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": N, "stream": True}
    written = serve(tmp_path, "/v1/messages", body)
    times = [t for t, _ in written]
    assert times == [times[0] + k * TOKEN_S for k in range(N)]
    kinds = [[line.removeprefix(b"event: ").decode() for line in c.split(b"\n") if line.startswith(b"event: ")]
             for _, c in written]  # fmt: skip
    assert kinds[0] == ["message_start", "content_block_start", "content_block_delta"]
    assert kinds[1:-1] == [["content_block_delta"]] * (N - 2)
    assert kinds[-1] == ["content_block_delta", "content_block_stop", "message_delta", "message_stop"]


def test_a_text_completion_writes_each_token_when_it_comes_and_the_last_with_its_finish_and_done(tmp_path):
    body = {"model": MODEL, "prompt": "Once", "max_tokens": N, "stream": True}
    written = serve(tmp_path, "/v1/completions", body)
    times = [t for t, _ in written]
    assert times == [times[0] + k * TOKEN_S for k in range(N)]
    said = [events(chunk) for _, chunk in written]
    assert [[e["choices"][0]["text"] for e in chunk] for chunk in said[:-1]] == [[t] for t in TOKENS[: N - 1]]
    last, finish, done = said[-1]
    assert last["choices"][0]["text"] == TOKENS[N - 1] and finish["choices"][0]["finish_reason"] == "length"
    assert done == "[DONE]"


def test_a_response_writes_each_token_when_it_comes_the_first_with_the_starts_the_last_with_the_end(tmp_path):
    """OpenAI's Responses: the response's and the message's starts go out with the first delta, then a delta a
    write, the last with every event that closes the message and the response."""
    body = {"model": MODEL, "input": "hi", "max_output_tokens": N, "stream": True}
    written = serve(tmp_path, "/v1/responses", body)
    times = [t for t, _ in written]
    assert times == [times[0] + k * TOKEN_S for k in range(N)]
    kinds = [[e["type"] for e in events(chunk)] for _, chunk in written]
    starts = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    assert kinds[0] == [*starts, "response.output_text.delta"]
    assert kinds[1:-1] == [["response.output_text.delta"]] * (N - 2)
    ends = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] == ["response.output_text.delta", *ends, "response.completed"]
    numbers = [e["sequence_number"] for _, chunk in written for e in events(chunk)]
    assert numbers == list(range(len(numbers)))


def test_an_ollama_chat_writes_each_token_when_it_comes_and_the_last_with_the_counts(tmp_path):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "options": {"num_predict": N}}
    written = serve(tmp_path, "/api/chat", body)
    times = [t for t, _ in written]
    assert times == [times[0] + k * TOKEN_S for k in range(N)]
    said = [[json.loads(line) for line in chunk.splitlines()] for _, chunk in written]
    assert [[m["message"]["content"] for m in chunk] for chunk in said[:-1]] == [[t] for t in TOKENS[: N - 1]]
    last, final = said[-1]
    assert last["message"]["content"] == TOKENS[N - 1] and not last["done"]
    assert final["done"] and final["eval_count"] == N
