"""One ``attnexport.PagedAttention`` node in onnxruntime (CPU): its standard-op body against the
native kernel of :mod:`attnexport.ort_kernels`, float32.

Each configuration is one layer's attention step over a paged cache: decode (one query per
sequence) or prefill (``--prefill`` query tokens per sequence with no context). The two
sessions take turns, 50 runs per turn, and the fastest turn counts (the least disturbed on a
shared machine); the ratio is taken within the run.

    python benchmarks/ort_paged_attention.py [--threads 2] [--markdown]
"""

from __future__ import annotations

import argparse
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
    inputs = _inputs(*config)
    attributes = {"scale": config[2] ** -0.5, "causal": 1}
    bindings = {}
    for kernels in ("bodies", "native"):
        session = single_node_session(
            "PagedAttention", inputs, {"output": inputs["query"]}, kernels, threads, **attributes
        )
        bindings[kernels] = session.bind(inputs)
    best = dict.fromkeys(bindings, float("inf"))
    for _ in range(turns):
        for kernels, step in bindings.items():
            session, binding = step.session, step.binding
            session.run_with_iobinding(binding)
            start = time.perf_counter()
            for _ in range(runs):
                session.run_with_iobinding(binding)
            best[kernels] = min(best[kernels], (time.perf_counter() - start) / runs * 1e3)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--markdown", action="store_true", help="print docs/benchmarks.md's table")
    args = parser.parse_args()
    reason = ort_kernels.unavailable_reason()
    if reason is not None:
        sys.exit(f"native kernels: {reason}")
    rows = []
    for config in CONFIGS:
        best = measure(config, args.threads)
        rows.append((config, best))
        if not args.markdown:
            print(config, {k: round(v, 3) for k, v in best.items()}, flush=True)
    if args.markdown:
        print("| H/Hkv/D | batch | context | queries/seq | body ms | native ms | body / native |")
        print("|---|---|---|---|---|---|---|")
        for (h, kvh, d, batch, context, queries), best in rows:
            ratio = best["bodies"] / best["native"]
            print(
                f"| {h}/{kvh}/{d} | {batch} | {context} | {queries} | {best['bodies']:.3f} "
                f"| {best['native']:.3f} | {ratio:.2f} |"
            )


if __name__ == "__main__":
    main()
