"""Ollama's model management (#48), through the official ``ollama`` client against a real `exod serve`: pull (with
progress) then chat, delete, copy then chat by the new name, create from a GGUF then chat, push refused; the legacy
``embeddings()``, ``ps()``'s ``expires_at`` for a model kept forever, and ``generate()``'s ``context``; Open WebUI's
model list.

Nothing is downloaded here: a pull fetches what exod can fetch offline, a model of its cache (made by the test
before the daemon starts), as `exod model pull` does with ``HF_HUB_OFFLINE``. Requests for a model not placed place
it (``[models] on_demand``), as Ollama loads a model at its first request.
"""

from __future__ import annotations

import os
import signal
import time
from datetime import UTC, datetime

import httpx
import ollama
import pytest

from daemon_harness import runner_pids, start_daemon, wait_instance
from exod.host.tiny_model import make_tiny_model
from gguf_files import gguf_from_tiny_model

MODEL = "exod/tiny-qwen2"  # placed by the configuration, kept loaded forever
PULLED = "exod/tiny-pulled"  # in the cache, not placed: what a pull finds
HALF = "exod/tiny-half"  # in the cache with a weight file missing: half a download
CONFIG = f"""
[daemon]
port = 0
offline = true

[models]
on_demand = true
keep_alive = "10m"  # those placed on demand make room for one another

[limits]
runners_per_node = 2

[[place]]
model = "{MODEL}"
ranks = 1
keep_alive = -1
"""
HI = [{"role": "user", "content": "hi"}]
FEW = {"num_predict": 3}
GREEDY = FEW | {"temperature": 0}  # the same answer each time
LOAD_S = 120.0  # a tiny model placed on demand loads in a few seconds on a busy 2-core machine: a generous bound


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`exod serve` with the tiny models in its own cache; yields its URL, the cache and a scratch folder."""
    tmp = tmp_path_factory.mktemp("ollama-models")
    hf = tmp / "hf"
    for seed, model in enumerate((MODEL, PULLED, HALF)):
        make_tiny_model(model, layers=2, hf_home=hf, seed=seed)
    next((hf / "hub" / "models--exod--tiny-half" / "snapshots").glob("*/*.safetensors")).unlink()  # not come yet
    (tmp / "exod.toml").write_text(CONFIG)
    process, url = start_daemon(tmp, {**os.environ, "HF_HOME": str(hf), "HF_HUB_OFFLINE": "1"})
    try:
        wait_instance(url, lambda i: i["state"] == "ready", timeout=LOAD_S)
        yield url, hf, tmp
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0, (tmp / "serve.log").read_text()
    assert runner_pids() == []


@pytest.fixture
def llama(served):
    return ollama.Client(host=served[0], timeout=LOAD_S)


def listed(llama: ollama.Client) -> list[str]:
    return [m.model for m in llama.list().models]


def answers(llama: ollama.Client, model: str) -> ollama.ChatResponse:
    answered = llama.chat(model=model, messages=HI, stream=False, options=FEW)
    assert answered.done and 1 <= answered.eval_count <= 3 and answered.message.role == "assistant"
    return answered


def test_a_pull_streams_ollamas_progress_then_the_model_answers_by_its_short_name(llama, served):
    url = served[0]
    assert PULLED in listed(llama)  # a whole model of the cache is a local model, as Ollama lists its own
    parts = list(llama.pull(PULLED, stream=True))
    statuses = [p.status for p in parts]
    assert statuses[0] == "pulling manifest" and statuses[-2:] == ["verifying sha256 digest", "success"]
    progress = [p for p in parts if p.digest]
    assert progress and all(p.status == f"pulling {p.digest[7:19]}" for p in progress)
    assert progress[-1].total > 0 and progress[-1].completed == progress[-1].total  # the model's bytes, all here
    assert llama.pull(PULLED).status == "success"  # not streamed: one object
    answers(llama, "tiny-pulled")  # placed at its first request, as Ollama loads a model
    assert any(m.model == PULLED for m in llama.ps().models)
    raw = httpx.post(f"{url}/api/pull", json={"model": PULLED}, timeout=LOAD_S)  # no "stream": a stream
    assert raw.headers["content-type"].startswith("application/x-ndjson") and raw.text.endswith('"success"}\n')


def test_a_pull_of_what_exod_cannot_fetch_is_ollamas_error_and_half_a_model_is_never_listed(llama):
    with pytest.raises(ollama.ResponseError) as library:
        list(llama.pull("llama3.2", stream=True))  # Ollama's library: refused before anything streams
    assert library.value.status_code == 404 and "Hugging Face hub" in library.value.error
    with pytest.raises(ollama.ResponseError) as absent:  # a hub id, offline and not cached: said in the stream
        list(llama.pull("org/not-in-the-cache", stream=True))
    assert "org/not-in-the-cache" in absent.value.error
    with pytest.raises(ollama.ResponseError) as whole:
        llama.pull("org/not-in-the-cache")
    assert whole.value.status_code == 404
    assert HALF not in listed(llama)  # a weight file missing: not a model
    with pytest.raises(ollama.ResponseError) as half:
        llama.pull(HALF)
    assert "missing" in half.value.error and HALF not in listed(llama)


def test_copy_makes_a_new_name_listed_and_served_and_delete_removes_it_and_unloads_it(llama, served):
    _url, hf, _tmp = served
    assert llama.copy(MODEL, "tiny-copy").status == "success"
    assert "library/tiny-copy" in listed(llama) and MODEL in listed(llama)
    answers(llama, "tiny-copy")
    assert any(m.model == "library/tiny-copy" for m in llama.ps().models)
    with pytest.raises(ollama.ResponseError) as missing:
        llama.copy("nothing-here", "tiny-other")
    assert missing.value.status_code == 404

    assert llama.delete("tiny-copy").status == "success"  # served: Ollama unloads it and deletes it, so does exod
    assert "library/tiny-copy" not in listed(llama)
    assert not any(m.model == "library/tiny-copy" for m in llama.ps().models)
    assert not (hf / "hub" / "models--library--tiny-copy").exists()
    assert MODEL in listed(llama)  # the source is untouched
    answers(llama, MODEL)
    with pytest.raises(ollama.ResponseError) as again:
        llama.delete("tiny-copy")
    assert again.value.status_code == 404 and "tiny-copy" in again.value.error


def test_create_from_a_gguf_file_then_chat_and_what_cannot_be_kept_is_refused(llama, served):
    url, hf, tmp = served
    source = next((hf / "hub" / "models--exod--tiny-pulled" / "snapshots").iterdir())
    gguf = gguf_from_tiny_model(source, tmp / "tiny.gguf")
    parts = list(llama.create(model="tiny-gguf", from_=str(gguf), stream=True))
    assert parts[0].status == "parsing GGUF" and parts[-1].status == "success"
    assert any(p.status == "converting model" and p.total for p in parts)
    assert "library/tiny-gguf" in listed(llama)
    answers(llama, "tiny-gguf")

    older = {"model": "tiny-modelfile", "modelfile": f"# made here\nFROM {gguf}\n", "stream": False}
    made = httpx.post(f"{url}/api/create", json=older, timeout=LOAD_S)  # the Modelfile form, as older clients send
    assert made.status_code == 200 and made.json() == {"status": "success"}, made.text
    assert "library/tiny-modelfile" in listed(llama)
    copied = list(llama.create(model="tiny-from-dir", from_=str(source), stream=True))  # a model directory
    assert copied[-1].status == "success" and "library/tiny-from-dir" in listed(llama)
    assert llama.create(model="tiny-from-dir", from_=MODEL).status == "success"  # made again: the new model only
    [snapshot] = (hf / "hub" / "models--library--tiny-from-dir" / "snapshots").iterdir()
    assert (snapshot / "model.safetensors").read_bytes() == next(
        (hf / "hub" / "models--exod--tiny-qwen2" / "snapshots").glob("*/model.safetensors")
    ).read_bytes()

    with pytest.raises(ollama.ResponseError) as system:
        llama.create(model="mario", from_=MODEL, system="You are Mario.")
    assert system.value.status_code == 400 and "system" in system.value.error
    with pytest.raises(ollama.ResponseError) as blobs:
        llama.create(model="tiny-blob", files={"model.gguf": "sha256:" + "0" * 64})
    assert blobs.value.status_code == 400 and "/path/to/model.gguf" in blobs.value.error
    with pytest.raises(ollama.ResponseError) as nowhere:
        llama.create(model="tiny-nowhere", from_=str(tmp / "absent.gguf"))
    assert nowhere.value.status_code == 400
    assert not [m for m in listed(llama) if "nowhere" in m or "blob" in m or "mario" in m]


def test_push_is_refused_saying_what_to_do_instead(llama):
    with pytest.raises(ollama.ResponseError) as refused:
        llama.push(MODEL)
    assert refused.value.status_code == 400 and "exod does not push" in refused.value.error
    assert "huggingface-cli upload" in refused.value.error


def test_the_legacy_embeddings_give_the_embedding_of_one_prompt(llama):
    legacy = llama.embeddings(model=MODEL, prompt="Why is the sky blue?").embedding
    current = llama.embed(model=MODEL, input="Why is the sky blue?").embeddings[0]
    assert len(legacy) == len(current) == 64 and legacy == pytest.approx(current, abs=1e-6)
    assert llama.embeddings(model=MODEL, prompt="").embedding == []  # Ollama's way to load the model


def test_embed_dimensions_it_cannot_honour_are_refused_naming_the_one_it_can(llama):
    with pytest.raises(ollama.ResponseError) as refused:
        llama.embed(model=MODEL, input="Why is the sky blue?", dimensions=32)
    assert refused.value.status_code == 400 and "the only value dimensions can take is 64" in refused.value.error
    assert len(llama.embed(model=MODEL, input="Why is the sky blue?", dimensions=64).embeddings[0]) == 64


def test_ps_says_a_model_kept_forever_expires_as_ollama_writes_it(llama):
    [kept] = [m for m in llama.ps().models if m.model == MODEL]  # placed by the configuration: kept forever
    assert kept.expires_at.year - datetime.now(UTC).year in (292, 293)  # now + Go's longest duration


def test_generate_returns_its_context_and_takes_it_back_to_continue(llama):
    first = llama.generate(model=MODEL, prompt="Hello", stream=False, options=GREEDY)
    context = list(first.context)
    assert all(isinstance(t, int) for t in context)
    assert len(context) == first.prompt_eval_count + first.eval_count  # the prompt's ids, then the answer's
    parts = list(llama.generate(model=MODEL, prompt="Hello", stream=True, options=GREEDY))
    assert parts[-1].done and list(parts[-1].context) == context  # streamed: on the last object
    again = llama.generate(model=MODEL, prompt="And then?", context=context, stream=False, options=GREEDY)
    alone = llama.generate(model=MODEL, prompt="And then?", stream=False, options=GREEDY)
    assert again.prompt_eval_count == len(context) + alone.prompt_eval_count  # the talk so far, then this turn
    assert list(again.context[: len(context)]) == context
    raw = llama.generate(model=MODEL, prompt="Hello", raw=True, stream=False, options=GREEDY)
    assert raw.context is None  # as Ollama: raw mode returns no context


def test_open_webui_lists_models_then_pulls_and_chats(served, llama):
    """Open WebUI's calls, in its order: the version, the local models, what is loaded, OpenAI's list; then a
    pull and a chat (streamed, as it chats) on the pulled model."""
    url = served[0]
    assert httpx.get(f"{url}/api/version", timeout=10).json()["version"]
    tags = httpx.get(f"{url}/api/tags", timeout=10).json()["models"]
    assert {MODEL, PULLED} <= {m["model"] for m in tags} and all(m["name"] and m["details"] for m in tags)
    assert all(datetime.fromisoformat(m["modified_at"].replace("Z", "+00:00")) for m in tags)
    assert httpx.get(f"{url}/api/ps", timeout=10).status_code == 200
    assert MODEL in [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]]
    with httpx.stream("POST", f"{url}/api/pull", json={"name": PULLED}, timeout=LOAD_S) as pulling:
        last = [line for line in pulling.iter_lines() if line][-1]
    assert last == '{"status": "success"}'
    started = time.monotonic()
    body = {"model": "tiny-pulled:latest", "messages": HI, "options": FEW}
    with httpx.stream("POST", f"{url}/api/chat", json=body, timeout=LOAD_S) as chatting:
        lines = [line for line in chatting.iter_lines() if line]
    assert '"done": true' in lines[-1] and time.monotonic() - started < LOAD_S


def test_model_files_are_never_half_there_after_a_create_whose_client_went_away(served, llama):
    """A client that goes away mid-create: the model is whole or absent, and nothing of the import is left."""
    url, hf, tmp = served
    source = next((hf / "hub" / "models--exod--tiny-pulled" / "snapshots").iterdir())
    gguf = gguf_from_tiny_model(source, tmp / "gone.gguf")
    with httpx.stream("POST", f"{url}/api/create", json={"model": "tiny-gone", "from": str(gguf)}, timeout=60) as r:
        next(r.iter_lines())  # "parsing GGUF": then the client goes away
    deadline = time.monotonic() + 60
    while list((hf / "hub").glob(".exod-*")):  # the import's staging, until it ended or was given up
        assert time.monotonic() < deadline, list((hf / "hub").glob(".exod-*"))
        time.sleep(0.05)
    if "library/tiny-gone" in listed(llama):  # it finished before the client went: whole
        answers(llama, "tiny-gone")
    else:  # given up: nothing of it in the cache
        assert not (hf / "hub" / "models--library--tiny-gone").exists()


def test_the_command_line_removes_a_model_from_the_same_store(tmp_path):
    """`exod model rm`: what /api/delete does to the files, from the command line."""
    from click.testing import CliRunner

    from exod.cli import main

    make_tiny_model("exod/tiny-rm", layers=1, hf_home=tmp_path)
    home = ["--hf-home", str(tmp_path)]
    assert "exod/tiny-rm" in CliRunner().invoke(main, ["model", "list", *home]).output
    removed = CliRunner().invoke(main, ["model", "rm", "exod/tiny-rm", *home])
    assert removed.exit_code == 0 and removed.output.strip() == "removed exod/tiny-rm", removed.output
    assert "exod/tiny-rm" not in CliRunner().invoke(main, ["model", "list", *home]).output
    again = CliRunner().invoke(main, ["model", "rm", "exod/tiny-rm", *home])
    assert again.exit_code != 0 and "not in the cache" in again.output


@pytest.mark.parametrize(("client", "read"), [("127.0.0.1", True), ("::1", True), ("192.0.2.7", False), (None, False)])
def test_a_create_from_a_path_reads_the_hosts_files_only_for_a_client_on_that_host(client, read):
    """An API key must not let a remote client make the daemon read its host's files (or learn which exist)."""
    from starlette.requests import Request

    from exod.api.errors import ApiError
    from exod.api.ollama_models import _refuse_remote_paths

    scope = {"type": "http", "headers": [], "client": None if client is None else (client, 40000)}
    if read:
        _refuse_remote_paths(Request(scope), "/srv/models/m.gguf")
        return
    with pytest.raises(ApiError) as refused:
        _refuse_remote_paths(Request(scope), "/srv/models/m.gguf")
    assert refused.value.status == 403 and "exod model import" in str(refused.value)
