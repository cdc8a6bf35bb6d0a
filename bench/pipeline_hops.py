"""Tokens/s of a model split over 3 nodes (pipeline-parallel, one MLX ring across 127.0.0.1-3) against the
same model on one node: on loopback, what the hops between ranks cost.

    python bench/pipeline_hops.py [--requests N] [--max-tokens T] [--smoke]

A local cluster (`exod.cluster.devcluster`: an etcd and three `exod serve --cluster` nodes) serves three copies of
one generated qwen2 (same shape, same seed, so the same weights, under three names): on 3 ranks, one per
node; on 1 rank; and, as the reference that tells the hops' cost from the pipeline's own, on 3 ranks
pinned to one node (one ring over one host's loopback). After an untimed warm-up request to each, N greedy
streamed requests go to each, in turn, one at a time, through the same node's API. tokens/s = completion
tokens summed / wall time summed, per instance; reported as the ratio 3 nodes / 1 node (goal ≥ 0.8), and
3 nodes / 3 ranks on one node.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import httpx
from _common import machine_info, parse_args, table, verdict, write_result  # type: ignore[import-not-found]
from chat_throughput import body, chat_stream, prompts  # type: ignore[import-not-found]

from exod.cluster.devcluster import local_cluster, place
from exod.host.tiny_model import make_tiny_model

SHAPE = {"arch": "qwen2", "layers": 9, "hidden": 512, "heads": 8, "kv_heads": 4, "intermediate": 1024}
SPLIT, WHOLE, PINNED = "exod/bench-split", "exod/bench-whole", "exod/bench-pinned"
RANKS = {SPLIT: "3 ranks on 3 nodes", WHOLE: "1 rank", PINNED: "3 ranks on 1 node"}
GOAL_RATIO = 0.8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parse_args(parser, smoke={"requests": 1, "max_tokens": 8})
    with tempfile.TemporaryDirectory(prefix="exod-bench-") as scratch:
        root = Path(scratch)
        for repo in RANKS:
            make_tiny_model(repo, hf_home=root / "hf", vocab_size=512, seed=1, **SHAPE)
        with local_cluster(root, 3, root / "hf", announce=lambda line: None) as urls:
            split = place(urls[0], SPLIT, 3)
            assert len({r["node"] for r in split["runners"]}) == 3, split
            place(urls[0], WHOLE, 1)
            pinned = place(urls[0], PINNED, 3, nodes=["node-1"])
            assert {r["node"] for r in pinned["runners"]} == {"node-1"}, pinned
            totals = {model: [0, 0.0] for model in RANKS}
            with httpx.Client(timeout=120) as client:
                for model in RANKS:  # warm-up, untimed
                    chat_stream(client, urls[0], body(model, prompts(1)[0], args.max_tokens, "greedy", 0))
                for messages in prompts(args.requests):
                    for model in RANKS:
                        t0 = time.monotonic()
                        result = chat_stream(client, urls[0], body(model, messages, args.max_tokens, "greedy", 0))
                        totals[model][0] += result["completion_tokens"]
                        totals[model][1] += time.monotonic() - t0
    rate = {model: tokens / seconds for model, (tokens, seconds) in totals.items()}
    ratio, hops = rate[SPLIT] / rate[WHOLE], rate[SPLIT] / rate[PINNED]
    print(
        table(
            [
                ("instance", "tokens", "seconds", "tokens/s"),
                *[(RANKS[name], str(t), f"{s:.2f}", f"{rate[name]:.1f}") for name, (t, s) in totals.items()],
            ]
        )
    )
    judged = verdict(args, ratio >= GOAL_RATIO)
    print(f"3 nodes / 1 rank: {ratio:.3f}× (goal ≥ {GOAL_RATIO}×: {judged}); 3 nodes / 3 ranks on 1 node: {hops:.3f}×")
    result = {
        "machine": machine_info(),
        "shape": SHAPE,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "tokens_per_s": {RANKS[m]: r for m, r in rate.items()},
        "ratio": ratio,
        "ratio_to_3_ranks_on_1_node": hops,
        "goal": GOAL_RATIO,
    }
    write_result("pipeline_hops", result, args)


if __name__ == "__main__":
    main()
