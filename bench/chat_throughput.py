"""Chat throughput and latency: exod's OpenAI API against ``mlx_lm.server``, same model, same prompts.

    python bench/chat_throughput.py [--hidden 256|512] [--prompts fresh|repeated] [--runs 5]
                                    [--requests N] [--max-tokens T] [--concurrency 1,4,8,16] [--ranks 1] [--smoke]

Both servers run at once on loopback and serve the same generated qwen2 (8 layers, ``--hidden`` wide):
``exod serve`` with the model placed on ``--ranks`` ranks, and ``python -m mlx_lm.server --model <snapshot>``.
Every request is greedy (temperature 0, seed 0), ``max_tokens`` fixed, ``stream=True`` with
``stream_options.include_usage``. Prompts are *fresh* (every request its own) or *repeated* (four prompts sent
again and again, as chat clients resend a conversation: the prompt caches of both servers get their chance).
After one untimed warm-up request to each, each run sends, for each concurrency level ``c``, the N requests of
the level as rounds of ``c`` concurrent requests, the rounds alternating between exod and mlx_lm. Per server,
level and run: tokens/s = completion tokens summed / the level's summed round wall time; time to first token
(send → first chunk with content), median. Each run also times a *second turn*: a conversation's first turn,
then the same conversation with the answer and a new question, alternating servers; the second turn's time to
first token is what a prompt cache saves. Reported as exod/mlx_lm ratios, each the median over the runs (goal:
tokens/s ≥ 1.0 at every level, time to first token ≤ 1.05, second-turn time to first token ≤ 1.0).
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

from exod.host.models import resolve_model
from exod.host.tiny_model import make_tiny_model

MODEL = "exod/tiny-chat-bench"
SHAPES = {  # --hidden: the generator's 8 layers, narrow and wide
    256: {"arch": "qwen2", "layers": 8, "hidden": 256, "heads": 4, "kv_heads": 2, "intermediate": 512},
    512: {"arch": "qwen2", "layers": 8, "hidden": 512, "heads": 8, "kv_heads": 4, "intermediate": 1024},
}
REPEATED = 4  # --prompts repeated: this many prompts, sent again and again
VOCAB = 512
SEED = 1  # seed 0 greedily repeats a byte token that never decodes to text, so no content chunk would stream
GOAL_RATIO = 1.0
GOAL_TTFT = 1.05
GOAL_SECOND_TURN = 1.0
TOPICS = (
    "the quick brown fox",
    "finite-state machines",
    "restarting failed runners",
    "the capital of France",
    "pipeline parallelism",
    "numbers from 0 to 42",
    "a little model",
    "plain error messages",
    "the HF cache layout",
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


def prompts(n: int) -> list[list[dict[str, str]]]:
    return [
        [{"role": "user", "content": f"Request {i}: tell me a long story about {TOPICS[i % len(TOPICS)]}."}]
        for i in range(n)
    ]


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


def exod_ready(state: Path) -> str | None:
    url = json.loads((state / "daemon.json").read_text())["url"]
    instances = httpx.get(f"{url}/instances", timeout=5).json()["instances"]
    return url if any(i["state"] == "ready" for i in instances) else None


def mlx_ready(url: str) -> bool:
    return httpx.get(f"{url}/health", timeout=5).status_code == 200


def chat_stream(client: httpx.Client, url: str, model: str, messages: list[dict[str, str]], max_tokens: int) -> dict:
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "seed": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.monotonic()
    first = None
    chunks = 0
    usage = None
    text: list[str] = []
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
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
        "usage_reported": usage is not None,
        "cached_tokens": ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens"),
        "text": "".join(text),
    }


def round_of(url: str, model: str, batch: list[list[dict[str, str]]], max_tokens: int) -> tuple[float, list[dict]]:
    """Send ``batch`` concurrently (one thread and connection each); returns the round's wall time and results."""
    results: list[Any] = [None] * len(batch)

    def one(i: int) -> None:
        try:
            with httpx.Client(timeout=120) as client:
                results[i] = chat_stream(client, url, model, batch[i], max_tokens)
        except Exception as exc:  # re-raised in the caller
            results[i] = exc

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(batch))]
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


def level_stats(walls: list[float], results: list[dict]) -> dict[str, Any]:
    lat = [r["latency_ms"] for r in results]
    ttft = [r["ttft_ms"] for r in results if r["ttft_ms"] is not None]
    tokens = sum(r["completion_tokens"] for r in results)
    return {
        "requests": len(results),
        "completion_tokens": tokens,
        "wall_s": round(sum(walls), 3),
        "tokens_per_s": round(tokens / sum(walls), 2),
        "latency_median_ms": round(statistics.median(lat), 1),
        "latency_p90_ms": round(percentile(lat, 90), 1),
        "ttft_median_ms": round(statistics.median(ttft), 1) if ttft else None,
        "ttft_p90_ms": round(percentile(ttft, 90), 1) if ttft else None,
        "ms_per_token_median": round(
            statistics.median(r["latency_ms"] / max(1, r["completion_tokens"]) for r in results), 2
        ),
        "usage_reported": all(r["usage_reported"] for r in results),
        "min_completion_tokens": min(r["completion_tokens"] for r in results),
    }


def reference(snapshot: Path, msgs: list[list[dict[str, str]]], max_tokens: int) -> dict[str, Any]:
    argv = [sys.executable, "-c", REFERENCE, str(snapshot), json.dumps(msgs), str(max_tokens)]
    with reaped(subprocess.Popen(argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)) as proc:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        if not line.startswith("done "):
            raise RuntimeError(f"reference did not finish: {line!r}")
    runs = json.loads(line[5:])
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
    """A conversation's first turn, then the same conversation with its answer and a new question."""
    first = [{"role": "user", "content": f"A conversation about {topic}: tell me a long story about it."}]
    _, (answer,) = round_of(url, model, [first], max_tokens)
    again = [*first, {"role": "assistant", "content": answer["text"]}, {"role": "user", "content": "And then?"}]
    _, (second,) = round_of(url, model, [again], max_tokens)
    return second


def widest_batch(metrics: str) -> float:
    """The upper bound of the smallest `exod_batch_size` bucket that holds every request: the widest batch."""
    (family,) = [f for f in text_string_to_metric_families(metrics) if f.name == "exod_batch_size"]
    buckets = sorted((float(s.labels["le"]), s.value) for s in family.samples if s.name.endswith("_bucket"))
    return next(le for le, count in buckets if count == buckets[-1][1])


def median_ratio(runs: list[dict[str, Any]], level: str, key: str) -> float:
    return round(statistics.median(r["exod"][level][key] / r["mlx_lm"][level][key] for r in runs), 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, choices=sorted(SHAPES), default=512, help="model width (default 512)")
    parser.add_argument("--prompts", choices=("fresh", "repeated"), default="fresh")
    parser.add_argument("--runs", type=int, default=5, help="alternating runs; ratios are their medians (default 5)")
    parser.add_argument("--requests", type=int, default=16, help="requests per server, level and run (default 16)")
    parser.add_argument("--max-tokens", type=int, default=64, help="max_tokens of every request (default 64)")
    parser.add_argument("--concurrency", default="1,4,8,16", help="comma-separated levels (default 1,4,8,16)")
    parser.add_argument("--ranks", type=int, default=1, help="exod's ranks for the model (default 1)")
    smoke = {"hidden": 256, "runs": 1, "requests": 2, "max_tokens": 8, "concurrency": "1,2"}
    args = parse_args(parser, smoke=smoke)
    levels = [int(c) for c in args.concurrency.split(",")]
    if any(args.requests % c for c in levels):
        parser.error("--requests must be a multiple of every concurrency level")
    shape = SHAPES[args.hidden]
    msgs = (
        prompts(args.requests)
        if args.prompts == "fresh"
        else [prompts(REPEATED)[i % REPEATED] for i in range(args.requests)]
    )

    with tempfile.TemporaryDirectory(prefix="exod-bench-chat-") as tmp_name:
        tmp = Path(tmp_name)
        hf_home = tmp / "hf"
        make_tiny_model(MODEL, **shape, vocab_size=VOCAB, seed=SEED, hf_home=hf_home)
        snapshot = resolve_model(MODEL, hf_home=hf_home, offline=True)
        env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        (tmp / "exod.toml").write_text(
            f'[daemon]\nhost = "127.0.0.1"\nport = 0\n\n[limits]\nmax_requests_per_instance = 64\n'
            f'queue_timeout = 120.0\nmax_sequences = 32\n\n[[place]]\nmodel = "{MODEL}"\nranks = {args.ranks}\n'
        )
        exod_argv = [sys.executable, "-m", "exod", "serve", "--config", str(tmp / "exod.toml")]
        exod_argv += ["--state-dir", str(tmp / "state"), "--port", "0"]
        mlx_port = free_port()
        mlx_argv = [sys.executable, "-m", "mlx_lm.server", "--model", str(snapshot), "--port", str(mlx_port)]
        mlx_argv += ["--log-level", "WARNING"]
        exod_log, mlx_log = tmp / "exod.log", tmp / "mlx_lm.log"

        runs: list[dict[str, Any]] = []
        with started(exod_argv, env, exod_log) as exod_proc, started(mlx_argv, env, mlx_log) as mlx_proc:
            exod_url = wait_until(lambda: exod_ready(tmp / "state"), exod_proc, exod_log, "exod serve")
            mlx_url = f"http://127.0.0.1:{mlx_port}"
            wait_until(lambda: mlx_ready(mlx_url), mlx_proc, mlx_log, "mlx_lm.server")
            servers = {"exod": (exod_url, MODEL), "mlx_lm": (mlx_url, "default_model")}
            warm = prompts(1)[0]
            for url, model in servers.values():  # untimed: first request compiles/allocates
                round_of(url, model, [warm], args.max_tokens)

            for run in range(args.runs):
                measured: dict[str, dict[str, Any]] = {name: {} for name in servers}
                for c in levels:
                    walls: dict[str, list[float]] = {name: [] for name in servers}
                    results: dict[str, list[dict]] = {name: [] for name in servers}
                    for start in range(0, args.requests, c):
                        batch = msgs[start : start + c]
                        for name, (url, model) in servers.items():
                            wall, res = round_of(url, model, batch, args.max_tokens)
                            walls[name].append(wall)
                            results[name].extend(res)
                    for name in servers:
                        measured[name][f"c{c}"] = level_stats(walls[name], results[name])
                        if measured[name][f"c{c}"]["min_completion_tokens"] <= 0:
                            raise RuntimeError(f"{name}: a request with no completion tokens at concurrency {c}")
                turns: dict[str, list[dict]] = {name: [] for name in servers}
                for i in range(3):
                    topic = f"{TOPICS[(run * 3 + i) % len(TOPICS)]} (run {run}, conversation {i})"
                    for name, (url, model) in servers.items():
                        turns[name].append(second_turn(url, model, topic, args.max_tokens))
                for name in servers:
                    ttft = [t["ttft_ms"] for t in turns[name] if t["ttft_ms"] is not None]
                    measured[name]["second_turn"] = {
                        "ttft_median_ms": round(statistics.median(ttft), 1),
                        "cached_tokens": [t["cached_tokens"] for t in turns[name]],
                    }
                runs.append(measured)
                print(f"run {run + 1}/{args.runs} done", flush=True)
            metrics = httpx.get(f"{exod_url}/metrics", timeout=10).text
        ref = reference(snapshot, msgs, args.max_tokens)

    ratios: dict[str, dict[str, float]] = {}
    for c in levels:
        level = f"c{c}"
        ratios[level] = {
            "tokens_per_s": median_ratio(runs, level, "tokens_per_s"),
            "latency_median": median_ratio(runs, level, "latency_median_ms"),
            "ttft_median": median_ratio(runs, level, "ttft_median_ms"),
        }
    ratios["second_turn"] = {"ttft_median": median_ratio(runs, "second_turn", "ttft_median_ms")}
    widest = widest_batch(metrics)
    meets = {
        "tokens_per_s": all(ratios[f"c{c}"]["tokens_per_s"] >= GOAL_RATIO for c in levels),
        "ttft_c1": "c1" not in ratios or ratios["c1"]["ttft_median"] <= GOAL_TTFT,
        "second_turn": ratios["second_turn"]["ttft_median"] <= GOAL_SECOND_TURN,
    }
    result = {
        "benchmark": "chat_throughput",
        "model": {**shape, "vocab_size": VOCAB, "seed": SEED, "ranks": args.ranks},
        "prompts": args.prompts,
        "runs": args.runs,
        "max_tokens": args.max_tokens,
        "requests_per_level": args.requests,
        "sampling": "greedy (temperature 0, seed 0), stream=True with include_usage",
        "goal": f"exod/mlx_lm tokens/s >= {GOAL_RATIO} at every level, TTFT <= {GOAL_TTFT} at c=1, "
        f"second-turn TTFT <= {GOAL_SECOND_TURN}; each the median of the runs' ratios",
        "runs_measured": runs,
        "reference_stream_generate_sequential": ref,
        "ratio_exod_over_mlx_lm": ratios,
        "exod_batch_size_bucket_reached": widest,
        "meets_goal": meets,
        "machine": machine_info(),
    }

    rows: list[tuple[str, ...]] = [("exod/mlx_lm (median of runs)", "tok/s", "lat p50", "TTFT p50")]
    for c in levels:
        r = ratios[f"c{c}"]
        rows.append((f"c={c}", f"{r['tokens_per_s']:.3f}", f"{r['latency_median']:.3f}", f"{r['ttft_median']:.3f}"))
    rows.append(("second turn, c=1", "", "", f"{ratios['second_turn']['ttft_median']:.3f}"))
    last = runs[-1]
    for c in levels:
        for name in servers:
            s_ = last[name][f"c{c}"]
            rows.append(
                (
                    f"last run: {name}, c={c}",
                    f"{s_['tokens_per_s']:.1f}",
                    f"{s_['latency_median_ms']:.1f}",
                    f"{s_['ttft_median_ms']:.1f}",
                )
            )
    rows.append(
        (
            "reference: stream_generate, c=1",
            f"{ref['tokens_per_s']:.1f}",
            f"{ref['latency_median_ms']:.1f}",
            f"{ref['ttft_median_ms']:.1f}",
        )
    )
    print(table(rows))
    goals = ", ".join(f"{goal}: {verdict(args, met)}" for goal, met in meets.items())
    print(f"exod's batch reached the bucket le={widest:g}; goals: {goals}")
    write_result(f"chat_throughput_h{args.hidden}_{args.prompts}_r{args.ranks}", result, args)


if __name__ == "__main__":
    main()
