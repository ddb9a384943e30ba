"""One ``attnexport.PagedAttention`` node in onnxruntime (CPU): its standard-op body against the
native kernel of :mod:`attnexport.ort_kernels`, float32.

Each configuration is one layer's attention step over a paged cache: decode (one query per
sequence), prefill (as many queries as keys) or a prefill chunk (the second 2048-token chunk of a
4096-token prompt). The two sessions take turns, up to 50 runs per turn (fewer for long steps:
about 0.3 s of runs), and the fastest turn counts (the least disturbed on a shared machine);
the ratio body / native is also taken turn by turn (both sessions ran back to back) and its
median over the turns is printed beside.

    python benchmarks/ort_paged_attention.py [--threads 2] [--turns 7] [--prefill] [--markdown]

``--prefill`` runs only the prefill rows of SmolLM2-135M's geometry (9/3/64, prompts of 128 to
4096 tokens and the chunk), the ones docs/benchmarks.md's prefill section shows.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from attnexport import ort_kernels
from attnexport.lowering.single_node import single_node_session

BLOCK_SIZE = 16
# (heads, kv heads, head size, batch, context, queries per sequence)
CONFIGS = [
    (12, 4, 64, 1, 256, 1),
    (12, 4, 64, 8, 256, 1),
    (32, 8, 128, 1, 1024, 1),
    (32, 8, 128, 8, 1024, 1),
    (12, 4, 64, 1, 128, 128),
    (12, 4, 64, 8, 128, 128),
    (32, 8, 128, 1, 1024, 1024),
]
# SmolLM2-135M (9 heads over 3 KV heads of 64): whole prompts, and the second chunk of a
# 4096-token prompt prefilled in chunks of 2048 (the engine's default budget).
PREFILL_CONFIGS = [(9, 3, 64, 1, n, n) for n in (128, 512, 1024, 2048, 4096)] + [
    (9, 3, 64, 1, 4096, 2048)
]


def _inputs(heads, kv_heads, head_size, batch, context, queries) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    blocks = -(-context // BLOCK_SIZE)
    order = torch.randperm(batch * blocks, generator=generator).to(torch.int32)
    shape = (batch * blocks, BLOCK_SIZE, kv_heads, head_size)
    return {
        "query": torch.randn(batch * queries, heads, head_size, generator=generator),
        "key_cache": torch.randn(shape, generator=generator),
        "value_cache": torch.randn(shape, generator=generator),
        "block_tables": order.reshape(batch, blocks),
        "seq_lens": torch.full((batch,), context, dtype=torch.int32),
        "query_start_loc": torch.arange(0, batch * queries + 1, queries, dtype=torch.int32),
        "alibi_slopes": torch.zeros(heads),
    }


def measure(config, threads: int, turns: int = 7, runs: int = 50) -> dict[str, float]:
    """Best ms per run of each session, ``ratio``: body / native of those, and
    ``ratio_median``: the median over the turns of body / native within the turn."""
    inputs = _inputs(*config)
    attributes = {"scale": config[2] ** -0.5, "causal": 1}
    bindings = {}
    for kernels in ("bodies", "native"):
        session = single_node_session(
            "PagedAttention", inputs, {"output": inputs["query"]}, kernels, threads, **attributes
        )
        bindings[kernels] = session.bind(inputs)
    start = time.perf_counter()
    for step in bindings.values():
        step.session.run_with_iobinding(step.binding)
    runs = max(1, min(runs, round(0.3 / max(time.perf_counter() - start, 1e-6))))
    times: dict[str, list[float]] = {kernels: [] for kernels in bindings}
    for _ in range(turns):
        for kernels, step in bindings.items():
            session, binding = step.session, step.binding
            session.run_with_iobinding(binding)
            start = time.perf_counter()
            for _ in range(runs):
                session.run_with_iobinding(binding)
            times[kernels].append((time.perf_counter() - start) / runs * 1e3)
    best = {k: min(v) for k, v in times.items()}
    ratios = [b / n for b, n in zip(times["bodies"], times["native"], strict=True)]
    return best | {
        "ratio": best["bodies"] / best["native"],
        "ratio_median": statistics.median(ratios),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--turns", type=int, default=7)
    parser.add_argument("--prefill", action="store_true", help="only SmolLM2's prefill rows")
    parser.add_argument("--markdown", action="store_true", help="print docs/benchmarks.md's table")
    args = parser.parse_args()
    reason = ort_kernels.unavailable_reason()
    if reason is not None:
        sys.exit(f"native kernels: {reason}")
    rows = []
    for config in PREFILL_CONFIGS if args.prefill else CONFIGS + PREFILL_CONFIGS:
        best = measure(config, args.threads, args.turns)
        rows.append((config, best))
        if not args.markdown:
            print(config, {k: round(v, 3) for k, v in best.items()}, flush=True)
    if args.markdown:
        print(
            "| H/Hkv/D | batch | context | queries/seq | body ms | native ms | body / native "
            "(best times) | body / native (median turn) |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for (h, kvh, d, batch, context, queries), best in rows:
            print(
                f"| {h}/{kvh}/{d} | {batch} | {context} | {queries} | {best['bodies']:.3f} "
                f"| {best['native']:.3f} | {best['ratio']:.2f} | {best['ratio_median']:.2f} |"
            )


if __name__ == "__main__":
    main()
