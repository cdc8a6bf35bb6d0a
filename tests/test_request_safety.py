"""No request can hurt a runner, nor anyone else's request (issue #45).

Token ids beyond the model's vocabulary (read out of bounds: the runner died of SIGSEGV) and constraints built to
blow the engine's limits (a schema that requires itself, a pattern repeated 10^9 times: "Too many items") are
refused as the caller's 400 before any runner sees them, through every dialect that takes them; a constraint
that still fails mid-decode fails its own sequence, and the batch goes on; and a request that was in the batch
at two deaths of its instance's runners is a poison: refused from then on, those deaths not charged.

Watched from outside: the runner's process (its pid, alive or not) and the instance's generation and budget as
the API reports them.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from reliability_report import attack
from test_batch import start
from test_runner_process import model_dir, spawn  # noqa: F401 - fixtures shared with that file

from daemon_harness import runner_pids, start_daemon, wait_instance
from exod.host.tiny_model import make_tiny_model
from exod.runner import protocol as p
from exod.runner.grammar import PROBE_BYTES, GrammarError, vet

MODEL = "exod/tiny-qwen2"
VOCABULARY = 512  # the tiny model's (`make_tiny_model`'s default)
HUGE = 1_000_000_000
# a schema that requires itself: no finite value matches, and the engine's forced prefix never ends
RECURSIVE = {
    "$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}},
    "$ref": "#/$defs/n",
}
REPEATED = "a{1000}{1000}{1000}"  # 10^9 a's: the lexer's expressions run out
# the same bomb, past a string longer than the admission's walk: admitted, it fails mid-decode
DEEP = {
    "$defs": RECURSIVE["$defs"],
    "type": "object",
    "properties": {
        "a": {"type": "string", "minLength": PROBE_BYTES + 44, "maxLength": PROBE_BYTES + 44},
        "b": {"$ref": "#/$defs/n"},
    },
    "required": ["a", "b"],
}


def command(**fields: object) -> p.Generate:
    return p.Generate(request_id="r", **({"prompt_text": "hi"} | fields))  # type: ignore[arg-type]


# -- the checks themselves -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "field", "named"),
    [
        ({"prompt_tokens": [1, 2, HUGE]}, "prompt_tokens", f"token id {HUGE}"),
        ({"prompt_tokens": [3, -1]}, "prompt_tokens", "token id -1"),
        ({"prompt_tokens": [VOCABULARY]}, "prompt_tokens", f"token id {VOCABULARY}"),
        ({"logit_bias": {str(HUGE): 5.0}}, "logit_bias", f"logit_bias key '{HUGE}'"),
        ({"logit_bias": {"-3": 5.0}}, "logit_bias", "logit_bias key '-3'"),
        ({"logit_bias": {"x": 5.0}}, "logit_bias", "logit_bias key 'x'"),
    ],
)
def test_a_token_id_outside_the_vocabulary_is_named_with_its_field_and_the_bound(fields, field, named) -> None:
    prompt = {} if "prompt_tokens" in fields else {"prompt_text": "hi"}
    got = p.Generate(request_id="r", **prompt, **fields).outside(VOCABULARY)  # type: ignore[arg-type]
    assert got is not None
    assert got[0] == field
    assert named in got[1] and f"0 to {VOCABULARY - 1}" in got[1]


def test_ids_within_the_vocabulary_pass() -> None:
    assert command(prompt_text=None, prompt_tokens=[0, VOCABULARY - 1]).outside(VOCABULARY) is None
    assert command(logit_bias={"0": 1.0, str(VOCABULARY - 1): -1.0}).outside(VOCABULARY) is None


@pytest.mark.parametrize(
    ("grammar", "said"),
    [
        ({"json_schema": RECURSIVE}, "Too many items"),
        ({"regex": REPEATED}, "too many expressions"),
        ({"lark": "start: x\nx: x"}, "lark"),
        ({"regex": "(("}, "unclosed group"),
    ],
)
def test_a_constraint_beyond_the_engine_is_refused_by_its_sizing(grammar, said) -> None:
    with pytest.raises(GrammarError, match=said):
        vet(command(grammar=grammar))


def test_a_forced_tool_call_is_sized_by_the_schema_of_each_tool_it_may_take() -> None:
    bomb = {"type": "function", "function": {"name": "loop", "parameters": RECURSIVE}}
    fine = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    with pytest.raises(GrammarError, match="tool 'loop'"):
        vet(command(tools=[fine, bomb], tool_choice=p.REQUIRED))
    with pytest.raises(GrammarError, match="tool 'loop'"):
        vet(command(tools=[fine, bomb], tool_choice="loop"))
    vet(command(tools=[fine, bomb], tool_choice="add"))  # the one it must call is fine
    vet(command(tools=[fine, bomb]))  # nothing forced: nothing constrained


@pytest.mark.parametrize(
    "grammar",
    [
        {"json_schema": {"type": "object"}},
        {"json_schema": {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}}}},
        {"json_schema": {"enum": [f"v{i}" for i in range(2000)]}},
        {"json_schema": DEEP},  # its bomb is beyond the walk: the runner's own guard is what holds it
        {"regex": "[ab]{3}"},
        {"regex": "(a|b){1,100000}"},
        {"lark": 'start: "yes" | "no"'},
    ],
)
def test_constraints_of_a_sane_size_pass(grammar) -> None:
    vet(command(grammar=grammar))


# -- a runner: what fails a sequence fails it alone -----------------------------------------------------------


@pytest.mark.usefixtures("no_runner_left_behind")
def test_a_runner_refuses_ids_beyond_its_vocabulary_and_a_constraint_failing_mid_decode_alone(
    spawn,  # noqa: F811
    model_dir,  # noqa: F811
    tmp_path,
) -> None:
    """Commands straight to a runner (no daemon's admission): out-of-vocabulary ids are the request's error;
    a constraint that blows a limit mid-decode ends its own sequence with an error while the sequence beside it
    finishes; the runner serves on."""
    (runner,) = start(spawn, model_dir, 1, tmp_path)
    assert [b.vocabulary for b in runner.batching] == [VOCABULARY]
    for bad in (
        p.Generate("ids", prompt_tokens=[5, HUGE], max_tokens=4),
        p.Generate("bias", prompt_tokens=[5, 6], max_tokens=4, logit_bias={str(HUGE): 5.0}),
        p.Generate("echo", prompt_tokens=[HUGE], max_tokens=0, echo_prompt=True),
        p.Generate("embed", prompt_tokens=[HUGE], max_tokens=0, embed=True),
    ):
        runner.send(bad)
        refused = runner.recv_until(p.RequestError)[-1]
        assert refused.request_id == bad.request_id and refused.invalid
        assert f"0 to {VOCABULARY - 1}" in refused.message
    beside = p.Generate("beside", prompt_tokens=[5, 6, 7], max_tokens=200, temperature=0.0)
    bomb = p.Generate("bomb", prompt_tokens=[5, 6, 7], max_tokens=PROBE_BYTES + 200, grammar={"json_schema": DEEP})
    runner.send(beside)
    runner.send(bomb)
    said: list[p.Message] = []
    while not {"beside", "bomb"} <= {m.request_id for m in said if isinstance(m, p.Done | p.RequestError)}:
        said += runner.recv_until(p.Report)
    failed = [m for m in said if isinstance(m, p.RequestError)]
    assert [m.request_id for m in failed] == ["bomb"]
    assert failed[0].invalid and "constraint failed" in failed[0].message
    bomb_tokens = [m for m in said if isinstance(m, p.Token) and m.request_id == "bomb"]
    assert len(bomb_tokens) > PROBE_BYTES // 8  # it failed deep in its output, not at admission
    (done,) = [m for m in said if isinstance(m, p.Done)]
    assert done.request_id == "beside" and done.completion_tokens > 0
    runner.send(p.Generate("after", prompt_tokens=[5, 6, 7], max_tokens=4))
    assert runner.recv_until(p.Done)[-1].request_id == "after"
    runner.send(p.Shutdown())
    assert runner.wait() == 0


# -- a real daemon, through every dialect ---------------------------------------------------------------------

CONFIG = f"""
[daemon]
host = "127.0.0.1"
port = 0
offline = true

[retry]
initial = 0.2
cap = 1.0
max_failures = 3

[[place]]
model = "{MODEL}"
ranks = 1
"""


@contextmanager
def serving(tmp: Path, config: str) -> Iterator[str]:
    """`exod serve` with ``config`` and the tiny model, once its instance is Ready; SIGTERM ends it, and it
    leaves no runner behind."""
    hf = tmp / "hf"
    make_tiny_model(MODEL, layers=2, hf_home=hf)
    (tmp / "exod.toml").write_text(config)
    process, url = start_daemon(tmp, {**os.environ, "HF_HOME": str(hf), "HF_HUB_OFFLINE": "1"})
    try:
        wait_instance(url, lambda i: i["state"] == "ready")
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        assert runner_pids() == [], "a runner process outlived the daemon"


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[str]:
    with serving(tmp_path, CONFIG) as url:
        yield url


def untouched(url: str, pids: list[int]) -> dict:
    """The runner is the one it was, and the instance's budget is whole: nothing was charged."""
    assert runner_pids() == pids
    (instance,) = httpx.get(f"{url}/instances", timeout=10).json()["instances"]
    assert (instance["state"], instance["generation"], instance["attempts"], instance["uncharged"]) == (
        "ready",
        1,
        0,
        0,
    ), instance
    return instance


def refused(response: httpx.Response, *said: str) -> str:
    assert response.status_code == 400, response.text
    text = response.text
    for part in said:
        assert part in text, text
    return text


def test_token_ids_outside_the_vocabulary_are_400_in_each_dialect_and_hurt_no_runner(daemon) -> None:
    pids = runner_pids()
    bound = f"0 to {VOCABULARY - 1}"
    sent = [
        ("/v1/completions", {"model": MODEL, "prompt": [HUGE], "max_tokens": 4}, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": [[5, 6], [-1]], "max_tokens": 4}, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": [HUGE], "max_tokens": 0, "echo": True}, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {str(HUGE): 5}}, "logit_bias"),
        ("/v1/embeddings", {"model": MODEL, "input": [HUGE]}, "input"),
        ("/v1/embeddings", {"model": MODEL, "input": [[5], [HUGE]]}, "input"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                  "logit_bias": {str(HUGE): 5}}, "logit_bias"),
    ]  # fmt: skip
    for path, body, param in sent:
        text = refused(httpx.post(f"{daemon}{path}", json=body, timeout=60), bound)
        assert json.loads(text)["error"]["param"] == param, (path, text)
    untouched(daemon, pids)
    ok = httpx.post(f"{daemon}/v1/completions", json={"model": MODEL, "prompt": [5, 6], "max_tokens": 4}, timeout=60)
    assert ok.status_code == 200, ok.text
    attack(
        "token ids outside the vocabulary",
        f"{len(sent)} requests (prompt ids {HUGE} and -1, with echo, embedding inputs, logit_bias keys) through "
        f"completions, embeddings and chat: each 400 naming its field and 'ids are {bound}'; the runner's pid "
        "unchanged, generation 1, 0 retries charged; the next request 200",
    )


def test_constraint_bombs_are_400_at_admission_in_each_dialect_and_hurt_no_runner(daemon) -> None:
    pids = runner_pids()
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    loop_tool = {"name": "loop", "description": "loops", "input_schema": RECURSIVE}
    sent = [
        ("/v1/chat/completions", chat | {"response_format": {"type": "json_schema",
            "json_schema": {"name": "n", "schema": RECURSIVE}}}, "Too many items"),
        ("/v1/chat/completions", chat | {"guided_regex": REPEATED}, "too many expressions"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "guided_regex": REPEATED}, "too many expressions"),
        ("/api/chat", {"model": MODEL, "messages": chat["messages"], "format": RECURSIVE, "stream": False},
         "Too many items"),
        ("/api/generate", {"model": MODEL, "prompt": "hi", "format": RECURSIVE, "stream": False}, "Too many items"),
        ("/v1/messages", {"model": MODEL, "max_tokens": 8, "messages": chat["messages"], "tools": [loop_tool],
                          "tool_choice": {"type": "any"}}, "Too many items"),
    ]  # fmt: skip
    started = time.monotonic()
    for path, body, said in sent:
        refused(httpx.post(f"{daemon}{path}", json=body, timeout=60), said)
    took = time.monotonic() - started
    untouched(daemon, pids)
    ok = httpx.post(f"{daemon}/v1/chat/completions", json=chat | {"guided_regex": "[ab]{3}"}, timeout=60)
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["message"]["content"]) == 3, ok.text
    attack(
        "constraint bombs",
        f"{len(sent)} requests (the recursive required $ref and {REPEATED!r}) through OpenAI's response_format and "
        f"guided_regex, Ollama's format (chat and generate) and Anthropic's tool_choice any: each 400 at admission "
        f"naming the engine's limit, {took:.1f} s for all; the runner's pid unchanged, 0 retries charged; a "
        "constraint past the admission's walk fails its own sequence mid-decode while the one beside it finishes "
        "(tests/test_request_safety.py)",
    )


# -- a poison request -----------------------------------------------------------------------------------------

POISON_CONFIG = (
    CONFIG
    + """
[[fault]]  # every generation's runner dies mid-generation: whatever it is generating kills it
phase = "busy"
kind = "sigkill"
"""
)


@pytest.mark.usefixtures("no_runner_left_behind")
def test_a_request_present_at_two_runner_deaths_is_refused_and_those_deaths_are_not_charged(tmp_path: Path) -> None:
    body = {"model": MODEL, "prompt": "the same request, sent again", "max_tokens": 16}
    with serving(tmp_path, POISON_CONFIG) as url:
        deaths = []
        for generation in (1, 2):
            wait_instance(url, lambda i, g=generation: i["state"] == "ready" and i["generation"] == g)
            (pid,) = runner_pids()
            answer = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert answer.status_code == 502 and "SIGKILL" in answer.text, answer.text
            deadline = time.monotonic() + 30
            while pid in runner_pids():  # from outside: the process itself is gone
                assert time.monotonic() < deadline, f"runner {pid} outlived its fault"
                time.sleep(0.02)
            deaths.append(pid)
        instance = wait_instance(url, lambda i: i["state"] == "ready" and i["generation"] == 3)
        assert (instance["attempts"], instance["uncharged"]) == (0, 2), instance
        assert "poison request" in json.dumps(instance), instance
        third = runner_pids()
        again = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        text = refused(again, "poison_request", "2 times")
        assert runner_pids() == third  # refused before it reached the runner
        (instance,) = httpx.get(f"{url}/instances", timeout=10).json()["instances"]
        assert (instance["generation"], instance["attempts"]) == (3, 0), instance
    attack(
        "poison request",
        f"every runner SIGKILLs itself mid-generation: the same completion sent twice killed generations 1 and 2 "
        f"(pids {deaths[0]}, {deaths[1]}, each 502); generation 3 Ready with attempts 0, uncharged 2; the third "
        f"send 400: {json.loads(text)['error']['message'][:90]}…, the runner untouched",
    )
