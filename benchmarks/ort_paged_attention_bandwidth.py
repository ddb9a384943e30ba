"""Native ``attnexport.PagedAttention`` decode against the machine's read bandwidth.

One decode token per sequence over a paged cache (16-token blocks, shuffled block table) of
float32, bfloat16 and float16 keys and values, one node in onnxruntime with the native kernels
(:func:`~attnexport.lowering.single_node.single_node_session`, ``kernels="native"``). Reports
time per call and the cache bytes read per second (every visible key and value row once), next
to the read bandwidth of ``torch.sum`` over a 1 GiB float32 array on the same threads, measured
in the same run. ``--library`` names further builds of the kernel library (e.g. a baseline
copy): each configuration then runs every library in turn, round by round, and the best round
of each counts, so their ratio is taken under the same machine load.

    python benchmarks/ort_paged_attention_bandwidth.py [--threads 2] [--library base.so ...]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from attnexport import ort_kernels
from attnexport.lowering.single_node import single_node_session

BLOCK_SIZE = 16
GEOMETRIES = [(32, 8, 128), (12, 4, 64)]  # heads, kv heads, head size
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def read_bandwidth(threads: int, gib: float = 1.0, rounds: int = 5) -> float:
    """Bytes per second ``torch.sum`` reads from a ``gib``-GiB float32 array (best round)."""
    torch.set_num_threads(threads)
    data = torch.ones(int(gib * 2**30) // 4)
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best


def _inputs(heads, kv_heads, head_size, batch, context, dtype) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    blocks = -(-context // BLOCK_SIZE)
    order = torch.randperm(batch * blocks, generator=generator).to(torch.int32)
    shape = (batch * blocks, BLOCK_SIZE, kv_heads, head_size)
    return {
        "query": torch.randn(batch, heads, head_size, generator=generator).to(dtype),
        "key_cache": torch.randn(shape, generator=generator).to(dtype),
        "value_cache": torch.randn(shape, generator=generator).to(dtype),
        "block_tables": order.reshape(batch, blocks),
        "seq_lens": torch.full((batch,), context, dtype=torch.int32),
        "query_start_loc": torch.arange(0, batch + 1, dtype=torch.int32),
        "alibi_slopes": torch.zeros(heads),
    }


def measure(config, libraries: list[Path], threads: int, turns: int = 5) -> list[float]:
    """Best seconds per call of each library for one (geometry, batch, context, dtype)."""
    heads, kv_heads, head_size, batch, context, dtype = config
    inputs = _inputs(heads, kv_heads, head_size, batch, context, dtype)
    steps = []
    for library in libraries:
        ort_kernels.LIBRARY = library  # register() loads the library this names
        session = single_node_session(
            "PagedAttention",
            inputs,
            {"output": inputs["query"]},
            "native",
            threads,
            scale=head_size**-0.5,
            causal=1,
        )
        steps.append(session.bind(inputs))
    first = steps[0]
    start = time.perf_counter()
    first.session.run_with_iobinding(first.binding)
    runs = max(3, min(50, int(0.05 / max(time.perf_counter() - start, 1e-6))))
    best = [float("inf")] * len(steps)
    for _ in range(turns):
        for i, step in enumerate(steps):
            step.session.run_with_iobinding(step.binding)
            start = time.perf_counter()
            for _ in range(runs):
                step.session.run_with_iobinding(step.binding)
            best[i] = min(best[i], (time.perf_counter() - start) / runs)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--library",
        type=Path,
        action="append",
        default=[],
        help="another build of libattnexport_ort.so to compare (repeatable)",
    )
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    args = parser.parse_args()
    reason = ort_kernels.unavailable_reason()
    if reason is not None:
        sys.exit(f"native kernels: {reason}")
    libraries = [ort_kernels.LIBRARY, *args.library]
    bandwidth = read_bandwidth(args.threads) / 1e9
    print(
        f"read bandwidth (torch.sum, 1 GiB float32, {args.threads} threads): {bandwidth:.1f} GB/s"
    )
    names = ["this tree", *(str(p) for p in args.library)]
    header = "| H/Hkv/D | dtype | batch | context | " + " | ".join(
        f"{n} ms | {n} GB/s (of read)" for n in names
    )
    ratios = [f"{n} / this tree" for n in names[1:]]
    print(header + "".join(f" | {r}" for r in ratios) + " |")
    print("|---" * (4 + 2 * len(names) + len(ratios)) + "|")
    for heads, kv_heads, head_size in GEOMETRIES:
        for batch in args.batches:
            for context in args.contexts:
                for name in args.dtypes:
                    dtype = DTYPES[name]
                    config = (heads, kv_heads, head_size, batch, context, dtype)
                    best = measure(config, libraries, args.threads)
                    size = torch.finfo(dtype).bits // 8
                    read = 2 * batch * context * kv_heads * head_size * size
                    cells = [
                        f"{t * 1e3:.3f} | {read / t / 1e9:.1f} ({read / t / 1e9 / bandwidth:.2f})"
                        for t in best
                    ]
                    row = f"| {heads}/{kv_heads}/{head_size} | {name} | {batch} | {context} | "
                    row += " | ".join(cells)
                    row += "".join(f" | {t / best[0]:.2f}" for t in best[1:])
                    print(row + " |", flush=True)


if __name__ == "__main__":
    main()
