"""Paged attention on a CUDA GPU: the xformers backend against the sdpa backend.

Decode (one query per sequence over its cached context) is memory-bound: the figure of merit is
the HBM bandwidth achieved reading the K/V cache, reported against this GPU's measured
device-to-device copy bandwidth. Prefill (whole prompts, no cached context) is compute-bound:
reported in TFLOP/s. Both run through the ``attnexport`` ops, as a model calls them, with the
step's metadata reused across iterations as across layers.

    python benchmarks/xformers_attention.py              # full grid, a table
    python benchmarks/xformers_attention.py --quick      # a minute or so
    python benchmarks/xformers_attention.py --json > results.json

Needs a CUDA GPU (xFormers has no CPU kernels); without one it exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass

import torch

QUICK = {"batches": [1, 8], "contexts": [1024, 4096], "warmup": 2, "iters": 5}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Benchmark decode and prefill attention: xformers vs sdpa backends (CUDA)."
    )
    parser.add_argument("--backends", default="xformers,sdpa", help="comma-separated")
    parser.add_argument("--modes", default="decode,prefill", help="decode and/or prefill")
    parser.add_argument("--batches", default="1,8,32,128", help="sequences per batch")
    parser.add_argument(
        "--contexts", default="1024,2048,4096,8192,16384", help="tokens per sequence"
    )
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument(
        "--block-sizes",
        default="16,64",
        help="cache block sizes (comma-separated): xFormers' paged decode operators differ by "
        "block size (fa3 any, triton_splitk multiples of 64, fa2 multiples of 256)",
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=65536,
        help="skip prefill points with more tokens than this (batch * context)",
    )
    parser.add_argument(
        "--no-cuda-graph",
        dest="cuda_graph",
        action="store_false",
        help="time only from Python (by default calls are also replayed from a CUDA graph: "
        "the device time, without the host's per-call overhead)",
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="batches 1,8; contexts 1k,4k")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    else:
        args.batches = [int(b) for b in args.batches.split(",")]
        args.contexts = [int(c) for c in args.contexts.split(",")]
    args.block_sizes = [int(b) for b in str(args.block_sizes).split(",")]
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for mode in args.modes:
        if mode not in ("decode", "prefill"):
            parser.error(f"--modes: expected decode and/or prefill, got {mode!r}")
    return args


@dataclass
class Result:
    mode: str
    backend: str
    batch: int
    context: int
    block_size: int
    ms: float | None
    """Per call from Python, with the step's plan open (host-side planning done once, as for
    every layer after the first): host overhead included where it exceeds the kernels."""
    graph_ms: float | None = None
    """Per call replayed from a CUDA graph of calls (the device's time, as a decode step
    captured in a CUDA graph sees it); None when the call cannot be captured."""
    gbs: float | None = None
    """Achieved bandwidth reading K/V (decode), from ``graph_ms`` when there is one."""
    fraction_of_copy: float | None = None
    eager_fraction_of_copy: float | None = None
    """The same from ``ms``."""
    tflops: float | None = None
    """Attention matmul throughput (prefill, causal half counted), from ``graph_ms`` when
    there is one."""
    plan_ms: float | None = None
    """The first call of a step (checks, plan, masks: host work once per step), wall time."""
    operator: str = ""
    """The xFormers operator(s) that ran (empty for sdpa)."""
    note: str = ""


def copy_bandwidth_gbs(nbytes: int = 2**30) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read and written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    ms = _time(lambda: dst.copy_(src), warmup=1, iters=10)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def _time(fn, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def _graph_time(fn, calls: int = 10, replays: int = 5) -> float | None:
    """Milliseconds per call of ``fn`` replayed from a CUDA graph holding ``calls`` calls;
    None when ``fn`` cannot be captured (a host synchronisation inside, say)."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        return _time(graph.replay, warmup=1, iters=replays) / calls
    except Exception as error:  # capture refuses many things; the eager time stands alone
        print(f"  (no CUDA graph: {type(error).__name__}: {error})", file=sys.stderr)
        torch.cuda.synchronize()
        return None


def _decode_inputs(args, batch: int, context: int, dtype: torch.dtype, bs: int):
    import attnexport

    blocks_per_seq = -(-context // bs)
    num_blocks = batch * blocks_per_seq
    perm = torch.randperm(num_blocks).tolist()  # scattered blocks, as after many steps
    sequences = [
        attnexport.ScheduledSequence(
            context - 1, 1, perm[i * blocks_per_seq : (i + 1) * blocks_per_seq]
        )
        for i in range(batch)
    ]
    step = attnexport.build_attention_metadata(sequences, bs, device="cuda")
    shape = (num_blocks, bs, args.kv_heads, args.head_size)
    caches = [torch.randn(shape, device="cuda", dtype=dtype) for _ in range(2)]
    query = torch.randn(batch, args.heads, args.head_size, device="cuda", dtype=dtype)
    return query, caches, step


def _prefill_inputs(args, batch: int, context: int, dtype: torch.dtype, bs: int):
    import attnexport

    blocks_per_seq = -(-context // bs)
    sequences = [
        attnexport.ScheduledSequence(
            0, context, list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
        )
        for i in range(batch)
    ]
    step = attnexport.build_attention_metadata(sequences, bs, device="cuda")
    shape = (batch * blocks_per_seq, bs, args.kv_heads, args.head_size)
    caches = [torch.randn(shape, device="cuda", dtype=dtype) for _ in range(2)]
    query = torch.randn(batch * context, args.heads, args.head_size, device="cuda", dtype=dtype)
    return query, caches, step


def _operators_used(fn) -> str:
    """Runs ``fn`` once, recording the xFormers operator classes it calls."""
    from attnexport.backends import xformers as backend

    used: list[str] = []
    real = backend._forward

    def spy(query, key, value, bias, scale, op):
        used.append(op.NAME)
        return real(query, key, value, bias, scale, op)

    backend._forward = spy
    try:
        fn()
    finally:
        backend._forward = real
    return ",".join(sorted(set(used)))


def run_point(args, mode, backend, batch, context, block_size, copy_gbs) -> Result:
    import time

    import attnexport
    from attnexport.custom_ops.planning import step_plan

    dtype = getattr(torch, args.dtype)
    make = _decode_inputs if mode == "decode" else _prefill_inputs
    point = (mode, backend, batch, context, block_size)
    try:
        query, (key_cache, value_cache), step = make(args, batch, context, dtype, block_size)
        metadata = (step.block_tables, step.seq_lens, step.query_start_loc)

        def call():
            return attnexport.paged_attention(
                query, key_cache, value_cache, *metadata, scale=args.head_size**-0.5
            )

        with attnexport.use_backend(backend), step_plan(metadata):
            torch.cuda.synchronize()
            start = time.perf_counter()
            call()
            torch.cuda.synchronize()
            plan_ms = (time.perf_counter() - start) * 1e3
            ms = _time(call, args.warmup, args.iters)
            operator = _operators_used(call) if backend == "xformers" else ""
            graph_ms = _graph_time(call) if args.cuda_graph else None
    except attnexport.BackendUnsupportedError as error:
        return Result(*point, None, note=f"refused: {error}")
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return Result(*point, None, note="out of GPU memory")
    element = torch.finfo(dtype).bits // 8
    kv_bytes = 2 * batch * context * args.kv_heads * args.head_size * element
    device_ms = graph_ms or ms
    times = dict(graph_ms=graph_ms, plan_ms=plan_ms, operator=operator)
    if mode == "decode":
        gbs = kv_bytes / (device_ms * 1e-3) / 1e9
        eager = kv_bytes / (ms * 1e-3) / 1e9 / copy_gbs
        return Result(
            *point,
            ms,
            gbs=gbs,
            fraction_of_copy=gbs / copy_gbs,
            eager_fraction_of_copy=eager,
            **times,
        )
    # q.k and p.v over the causal half: 2 matmuls * 2 flops * H * D * context^2 / 2
    flops = 2 * batch * args.heads * args.head_size * context * context
    return Result(*point, ms, tflops=flops / (device_ms * 1e-3) / 1e12, **times)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "error: this benchmark needs a CUDA GPU (torch.cuda.is_available() is False); "
            "xFormers has no CPU kernels. Run it on a GPU machine, e.g. via scripts/gpu_suite.sh.",
            file=sys.stderr,
        )
        return 2
    import attnexport
    from attnexport.custom_ops import get_backend

    for name in args.backends:
        reason = get_backend(name).unavailable_reason()
        if reason:
            print(f"error: backend {name!r} is unavailable: {reason}", file=sys.stderr)
            return 2
    torch.manual_seed(0)
    copy_gbs = copy_bandwidth_gbs()
    results = []
    for mode in args.modes:
        for batch in args.batches:
            for context in args.contexts:
                if mode == "prefill" and batch * context > args.max_prefill_tokens:
                    continue
                for block_size in args.block_sizes:
                    for backend in args.backends:
                        result = run_point(
                            args, mode, backend, batch, context, block_size, copy_gbs
                        )
                        results.append(result)
                        print(_line(result), file=sys.stderr if args.json else sys.stdout)
                        torch.cuda.empty_cache()
    report = {
        "device": torch.cuda.get_device_name(),
        "capability": list(torch.cuda.get_device_capability()),
        "torch": torch.__version__,
        "attnexport": attnexport.__version__,
        "xformers": _xformers_version(),
        "dtype": args.dtype,
        "heads": [args.heads, args.kv_heads, args.head_size],
        "block_sizes": args.block_sizes,
        "copy_bandwidth_gbs": round(copy_gbs, 1),
        "results": [asdict(r) for r in results],
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"device copy bandwidth: {copy_gbs:.0f} GB/s ({report['device']})")
    return 0


def _xformers_version() -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version("xformers")
    except importlib.metadata.PackageNotFoundError:
        return None


def _line(r: Result) -> str:
    head = (
        f"{r.mode:7s} {r.backend:8s} batch={r.batch:<4d} ctx={r.context:<6d} "
        f"block={r.block_size:<4d}"
    )
    if r.ms is None:
        return f"{head} {r.note}"
    graph = "   n/a" if r.graph_ms is None else f"{r.graph_ms:6.3f}"
    tail = f" plan {r.plan_ms:6.2f} ms {r.operator}"
    times = f"{r.ms:7.3f} ms (graph {graph} ms)"
    if r.mode == "decode":
        share = f"({100 * r.fraction_of_copy:4.1f}% of copy)"
        return f"{head} {times} {r.gbs:7.0f} GB/s {share}{tail}"
    return f"{head} {times} {r.tflops:7.1f} TFLOP/s{tail}"


if __name__ == "__main__":
    sys.exit(main())
