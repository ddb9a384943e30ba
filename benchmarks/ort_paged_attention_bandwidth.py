"""Native ``attnexport.PagedAttention`` decode against the machine's read bandwidth.

One decode token per sequence over a paged cache (16-token blocks, shuffled block table) of
float32, bfloat16, float16 or int8 keys and values (int8 with its float32 scale caches), one
node in onnxruntime with the native kernels (a model of the node alone,
:func:`~attnexport.ort_kernels.node_model.node_model`). The queries are float32 (a float32 model
over a reduced-precision cache) or, with ``--query-dtype same``, of the cache's dtype (float
caches; what kernels before mixed dtypes took). Reports time per call and the cache bytes read
per second (every visible key and value row once, and the int8 rows' scales), next to the read
bandwidth of ``torch.sum`` over a 1 GiB float32 array on the same threads, measured in the same
run. ``--library`` names further builds of the kernel library (e.g. a baseline copy,
``OUTPUT=base.so bash scripts/build_ort_kernels.sh``, which writes its ISA variants
``base_avx2.so`` and ``base_avx512.so`` beside it): each
configuration then runs every library in turn, round by round; the table shows each library's
best round and, per other library, the median over rounds of its time over this tree's in the
same round (a ratio taken under the same machine load). The cache dtypes of one geometry, batch
and context run in the same rounds too: "float32 cache / this" is the median ratio of the
float32 cache's time to this dtype's (> 1: the cache is faster per token than float32). A
library that cannot run a configuration (an older build and an int8 cache) shows "-".

    python benchmarks/ort_paged_attention_bandwidth.py [--threads 2] [--library base.so ...]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from attnexport import ort_kernels
from attnexport.lowering.ort_session import PagedOrtSession
from attnexport.ort_kernels.node_model import node_model

BLOCK_SIZE = 16
GEOMETRIES = [(32, 8, 128), (12, 4, 64)]  # heads, kv heads, head size
DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int8": torch.int8,
}


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


def _inputs(heads, kv_heads, head_size, batch, context, dtype, query_dtype):
    generator = torch.Generator().manual_seed(0)
    blocks = -(-context // BLOCK_SIZE)
    order = torch.randperm(batch * blocks, generator=generator).to(torch.int32)
    shape = (batch * blocks, BLOCK_SIZE, kv_heads, head_size)

    def cache() -> torch.Tensor:
        if dtype == torch.int8:
            return torch.randint(-127, 128, shape, generator=generator, dtype=torch.int8)
        return torch.randn(shape, generator=generator).to(dtype)

    inputs = {
        "query": torch.randn(batch, heads, head_size, generator=generator).to(query_dtype),
        "key_cache": cache(),
        "value_cache": cache(),
        "block_tables": order.reshape(batch, blocks),
        "seq_lens": torch.full((batch,), context, dtype=torch.int32),
        "query_start_loc": torch.arange(0, batch + 1, dtype=torch.int32),
        "alibi_slopes": torch.zeros(heads),
    }
    if dtype == torch.int8:
        for name in ("key_scale_cache", "value_scale_cache"):
            inputs[name] = torch.rand(shape[:3], generator=generator) / 64
    return inputs


def _steps(config, libraries: list[Path], threads: int) -> list:
    """One bound step per library for (geometry, batch, context, dtype, query dtype); None
    where a library refuses the configuration (an older build and an int8 cache)."""
    import onnxruntime as ort

    heads, kv_heads, head_size, batch, context, dtype, query_dtype = config
    inputs = _inputs(heads, kv_heads, head_size, batch, context, dtype, query_dtype)
    model = node_model(
        "PagedAttention",
        inputs,
        {"output": inputs["query"]},
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_size=head_size,
        block_size=BLOCK_SIZE,
        scale=head_size**-0.5,
        causal=1,
    )
    steps = []
    for library in libraries:
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.log_severity_level = 4  # an older build's refusal is expected, not news
        options.register_custom_ops_library(str(library))
        try:
            step = PagedOrtSession(model, session_options=options).bind(inputs)
            step.session.run_with_iobinding(step.binding)
        except Exception:  # an older build refuses the dtype: no measurement
            step = None
        steps.append(step)
    return steps


def measure(
    configs, libraries: list[Path], threads: int, turns: int = 5
) -> list[list[list[float]]]:
    """Seconds per call of each library for each configuration in each of ``turns`` rounds:
    ``times[config][library][round]`` (NaN where a library refuses the configuration). Every
    configuration and library runs once per round, so that ratios between them are taken
    under the same machine load."""
    steps = [_steps(config, libraries, threads) for config in configs]
    runs = []
    for row in steps:
        first = next((s for s in row if s is not None), None)
        start = time.perf_counter()
        if first is not None:
            first.session.run_with_iobinding(first.binding)
        runs.append(max(3, min(50, int(0.05 / max(time.perf_counter() - start, 1e-6)))))
    times = [[[] for _ in libraries] for _ in configs]
    for _ in range(turns):
        for c, row in enumerate(steps):
            for i, step in enumerate(row):
                if step is None:
                    times[c][i].append(math.nan)
                    continue
                step.session.run_with_iobinding(step.binding)
                start = time.perf_counter()
                for _ in range(runs[c]):
                    step.session.run_with_iobinding(step.binding)
                times[c][i].append((time.perf_counter() - start) / runs[c])
    return times


def _median_ratio(numerator: list[float], denominator: list[float]) -> str:
    ratio = statistics.median(n / d for n, d in zip(numerator, denominator, strict=True))
    return "-" if math.isnan(ratio) else f"{ratio:.2f}"


def _cell(seconds: float, read: int, bandwidth: float) -> str:
    if math.isnan(seconds):
        return "- | -"
    rate = read / seconds / 1e9
    return f"{seconds * 1e3:.3f} | {rate:.1f} ({rate / bandwidth:.2f})"


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
    parser.add_argument(
        "--query-dtype",
        choices=["float32", "same"],
        default="float32",
        help="float32 queries over every cache (default), or the cache's own dtype",
    )
    parser.add_argument(
        "--geometries",
        nargs="+",
        default=[f"{h}/{k}/{d}" for h, k, d in GEOMETRIES],
        help="heads/kv_heads/head_size, e.g. 12/4/64",
    )
    parser.add_argument("--turns", type=int, default=5, help="rounds per configuration")
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
    header = "| H/Hkv/D | query | cache | batch | context | " + " | ".join(
        f"{n} ms | {n} GB/s (of read)" for n in names
    )
    ratios = [f"{n} / this tree" for n in names[1:]]
    per_token = "float32" in args.dtypes
    if per_token:
        ratios.append("float32 cache / this (per token)")
    print(header + "".join(f" | {r}" for r in ratios) + " |")
    print("|---" * (5 + 2 * len(names) + len(ratios)) + "|")
    for heads, kv_heads, head_size in (map(int, g.split("/")) for g in args.geometries):
        for batch in args.batches:
            for context in args.contexts:
                configs = []
                for name in args.dtypes:
                    dtype = DTYPES[name]
                    same = args.query_dtype == "same" and dtype.is_floating_point
                    query_dtype = dtype if same else torch.float32
                    configs.append((heads, kv_heads, head_size, batch, context, dtype, query_dtype))
                times = measure(configs, libraries, args.threads, args.turns)
                float32_times = times[args.dtypes.index("float32")][0] if per_token else None
                for name, config, row_times in zip(args.dtypes, configs, times, strict=True):
                    dtype, query_dtype = config[5], config[6]
                    size = dtype.itemsize + (4 / head_size if dtype == torch.int8 else 0)
                    read = round(2 * batch * context * kv_heads * head_size * size)
                    cells = [_cell(min(t), read, bandwidth) for t in row_times]
                    query_name = str(query_dtype).removeprefix("torch.")
                    row = f"| {heads}/{kv_heads}/{head_size} | {query_name} | {name} | {batch} | "
                    row += f"{context} | " + " | ".join(cells)
                    for other in row_times[1:]:
                        row += f" | {_median_ratio(other, row_times[0])}"
                    if per_token:
                        row += f" | {_median_ratio(float32_times, row_times[0])}"
                    print(row + " |", flush=True)


if __name__ == "__main__":
    main()
