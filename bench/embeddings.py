"""Inputs embedded per second by a runner's batch (`exod.runner.batch.Batch`), the inputs queued at a step in
shared forward passes, against one forward pass per input (what each input had before #28's batching).

    python bench/embeddings.py [--inputs N] [--repeats R] [--smoke]

In this process, no daemon and no HTTP: a generated qwen2 (structured_output.py's, random weights), N inputs of
4 to 40 tokens queued at once in the runner's `Batch`, stepped until every one is embedded; once with the runner's
limits (default: at most `max_sequences` inputs and `prefill_step` padded tokens a pass), once with one input
a pass (``max_sequences`` 1). R alternating repetitions after an untimed one of each; the medians reported,
and the ratio batched / one a pass. No goal is judged: the figure says what batching buys on this machine.
"""

from __future__ import annotations

import argparse
import queue
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import machine_info, parse_args, table, write_result  # type: ignore[import-not-found]

from exod.host.tiny_model import make_tiny_model
from exod.runner import protocol as p
from exod.runner.batch import Batch, BatchLimits, Lockstep

SHAPE = {"arch": "qwen2", "layers": 8, "hidden": 256, "heads": 4, "kv_heads": 2, "intermediate": 512}


def inputs(n: int) -> list[list[int]]:
    """N token lists of 4 to 40 tokens, the same every run."""
    return [[(13 * i + 7 * k) % 500 + 10 for k in range(4 + (i * 17) % 37)] for i in range(n)]


def embed_all(model: Any, tokenizer: Any, limits: BatchLimits, prompts: list[list[int]]) -> tuple[float, int]:
    """Seconds to embed every prompt, queued at once, and the passes it took."""
    dones: list[int] = []

    def said(cls: type[p.Report], **fields: Any) -> None:
        if cls is p.Done:
            dones.append(fields["batch_size"])

    batch = Batch(model, tokenizer, limits=limits, send=said, rank=0, lockstep=Lockstep(queue.Queue(), None, 0))
    for i, prompt in enumerate(prompts):
        batch.embed(p.Generate(f"e{i}", prompt_tokens=prompt, max_tokens=0, embed=True), prompt)
    start = time.perf_counter()
    while not batch.idle:
        batch.step()
    elapsed = time.perf_counter() - start
    assert len(dones) == len(prompts), dones
    return elapsed, round(sum(1 / size for size in dones))


def main() -> None:
    import mlx_lm

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parse_args(parser, smoke={"inputs": 16, "repeats": 1})
    with tempfile.TemporaryDirectory(prefix="exod-bench-") as scratch:
        path = make_tiny_model("exod/bench-embed", hf_home=Path(scratch), vocab_size=512, seed=1, **SHAPE)
        model, tokenizer = mlx_lm.load(str(path))
    prompts = inputs(args.inputs)
    ways = {"batched": BatchLimits(), "one a pass": BatchLimits(max_sequences=1)}
    times: dict[str, list[float]] = {way: [] for way in ways}
    passes: dict[str, int] = {}
    for limits in ways.values():  # untimed: MLX compiles its kernels for these shapes
        embed_all(model, tokenizer, limits, prompts)
    for _ in range(args.repeats):
        for way, limits in ways.items():
            seconds, passes[way] = embed_all(model, tokenizer, limits, prompts)
            times[way].append(seconds)
    rate = {way: args.inputs / statistics.median(seconds) for way, seconds in times.items()}
    ratio = rate["batched"] / rate["one a pass"]
    rows = [(way, str(passes[way]), f"{statistics.median(times[way]):.3f}", f"{rate[way]:.1f}") for way in ways]
    print(table([("way", "passes", "seconds (median)", "inputs/s"), *rows]))
    print(f"batched / one a pass: {ratio:.2f}×")
    result = {
        "machine": machine_info(),
        "shape": SHAPE,
        "inputs": args.inputs,
        "tokens": sum(len(prompt) for prompt in prompts),
        "repeats": args.repeats,
        "passes": passes,
        "seconds": times,
        "inputs_per_s": rate,
        "ratio": ratio,
    }
    write_result("embeddings", result, args)


if __name__ == "__main__":
    main()
