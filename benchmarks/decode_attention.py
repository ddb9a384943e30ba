"""Decode attention on CPU: the ipex and sdpa backends and IPEX's raw kernel, against this
machine's DRAM bandwidth measured in the same run.

Each configuration is a decode step (one query token per sequence, all sequences at the same
context) over a paged cache with randomly permuted blocks. Every implementation cycles through
several layers' caches, as a model does, so reads come from DRAM rather than from a cache that
an earlier call left warm. Reported per implementation:

* ms per call (the fastest of the repetitions, the least disturbed on a shared machine),
* decode tokens per second of one layer (batch / time),
* KV bytes read per second (batch * context * Hkv * D * 2 tensors * element size / time),
* that rate as a fraction of the DRAM copy bandwidth (bytes read + written per second by a
  large ``Tensor.copy_``).

Implementations: ``ipex`` (``attnexport.paged_attention`` on the ipex backend: the public op,
with validation and dispatch), ``ipex-backend`` (the backend's method, without the op layer),
``ipex-raw`` (``torch.ops.torch_ipex.single_query_cached_kv_attention`` with everything prepared)
and ``sdpa`` (the public op on the sdpa backend). IPEX columns are skipped without IPEX.

Usage (from the repository root, with attnexport importable)::

    python benchmarks/decode_attention.py            # the full grid (a few minutes)
    python benchmarks/decode_attention.py --quick    # a smoke test (seconds)
    python benchmarks/decode_attention.py --json     # one JSON object on stdout
    python benchmarks/decode_attention.py --passes 2 --markdown   # docs/benchmarks.md's table
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass

import torch

import attnexport
from attnexport.custom_ops import get_backend, use_backend
from attnexport.custom_ops.paged_attention import PagedAttentionCall

SHAPES = ((32, 8, 128), (8, 2, 64))
"""(query heads, KV heads, head size)."""
BLOCK_SIZE = 16


@dataclass(frozen=True)
class Config:
    num_heads: int
    num_kv_heads: int
    head_size: int
    batch: int
    context: int
    dtype: str

    @property
    def kv_bytes(self) -> int:
        """Bytes of keys and values one call reads."""
        element = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        return 2 * self.batch * self.context * self.num_kv_heads * self.head_size * element


@dataclass(frozen=True)
class Result:
    config: Config
    implementation: str
    ms_per_call: float
    tokens_per_s: float
    kv_gb_per_s: float
    dram_fraction: float


def dram_bandwidth_gb_per_s(megabytes: int, repeats: int) -> float:
    """Copy bandwidth (bytes read + written per second) of a ``megabytes`` float32 copy."""
    source = torch.rand(megabytes * 2**20 // 4)
    target = torch.empty_like(source)
    target.copy_(source)
    best = min(_timed(lambda: target.copy_(source)) for _ in range(repeats))
    return 2 * source.numel() * 4 / best / 1e9


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _fill(tensor: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Random values without generating one random number per element (fast for GiBs)."""
    flat = tensor.view(-1)
    tile = torch.randn(min(flat.numel(), 2**20), generator=generator).to(tensor.dtype)
    for start in range(0, flat.numel(), tile.numel()):
        chunk = flat[start : start + tile.numel()]
        chunk.copy_(tile[: chunk.numel()])
    return tensor


class _Step:
    """One configuration's inputs: ``layers`` caches and the step's metadata."""

    def __init__(self, config: Config, cache_budget_bytes: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        dtype = getattr(torch, config.dtype)
        blocks_per_seq = -(-config.context // BLOCK_SIZE)
        num_blocks = config.batch * blocks_per_seq
        self.layers = max(1, min(16, cache_budget_bytes // config.kv_bytes))
        shape = (num_blocks, BLOCK_SIZE, config.num_kv_heads, config.head_size)
        self.caches = [
            (_fill(torch.empty(shape, dtype=dtype), g), _fill(torch.empty(shape, dtype=dtype), g))
            for _ in range(self.layers)
        ]
        self.query = torch.randn(config.batch, config.num_heads, config.head_size, generator=g)
        self.query = self.query.to(dtype)
        perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
        self.block_tables = perm.view(config.batch, blocks_per_seq).contiguous()
        self.seq_lens = torch.full((config.batch,), config.context, dtype=torch.int32)
        self.query_start_loc = torch.arange(config.batch + 1, dtype=torch.int32)
        self.scale = config.head_size**-0.5

    def paged_args(self, layer: int) -> tuple:
        key_cache, value_cache = self.caches[layer]
        return (
            self.query,
            key_cache,
            value_cache,
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
        )


def _implementations(step: _Step, config: Config, with_ipex: bool) -> dict:
    """name -> fn(layer) running one call on that layer's caches."""

    def public_op(backend: str):
        def run(layer: int):
            with use_backend(backend):
                attnexport.paged_attention(*step.paged_args(layer), step.scale)

        return run

    impls = {"sdpa": public_op("sdpa")}
    if not with_ipex:
        return impls
    from attnexport.backends import ipex_kernels

    raw = ipex_kernels.load_ipex().single_query_cached_kv_attention
    backend = get_backend("ipex")
    out = torch.empty_like(step.query)
    head_mapping = torch.arange(config.num_heads, dtype=torch.int32) // (
        config.num_heads // config.num_kv_heads
    )
    transposed = [(k.transpose(1, 2), v.transpose(1, 2)) for k, v in step.caches]

    def ipex_raw(layer: int):
        key_cache, value_cache = transposed[layer]
        raw(
            out,
            step.query,
            key_cache,
            value_cache,
            head_mapping,
            step.scale,
            step.block_tables,
            step.seq_lens,
            BLOCK_SIZE,
            config.context,
            None,
            -1,
            1.0,
            1.0,
            -1.0,
        )

    def ipex_backend(layer: int):
        backend.paged_attention(PagedAttentionCall(*step.paged_args(layer), step.scale))

    return {
        "ipex": public_op("ipex"),
        "ipex-backend": ipex_backend,
        "ipex-raw": ipex_raw,
        **impls,
    }


def _measure(impls: dict, layers: int, min_time: float, min_rounds: int) -> dict[str, float]:
    """Seconds per call of each implementation: the fastest of its rounds (a round is one call
    per layer). Implementations take turns round by round, so a burst of load from other
    processes hits them alike."""
    for fn in impls.values():  # warm-up: plans, workspaces, first touch of outputs
        for layer in range(layers):
            fn(layer)
    best = dict.fromkeys(impls, float("inf"))
    rounds, start = 0, time.perf_counter()
    while rounds < min_rounds or time.perf_counter() - start < min_time * len(impls):
        for name, fn in impls.items():
            round_start = time.perf_counter()
            for layer in range(layers):
                fn(layer)
            best[name] = min(best[name], (time.perf_counter() - round_start) / layers)
        rounds += 1
    return best


def run(
    configs: list[Config],
    with_ipex: bool,
    min_time: float,
    min_rounds: int,
    cache_budget_bytes: int,
    progress=None,
) -> dict[tuple[Config, str], float]:
    """Seconds per call of every implementation on every configuration."""
    seconds = {}
    for config in configs:
        step = _Step(config, cache_budget_bytes)
        impls = _implementations(step, config, with_ipex)
        for name, value in _measure(impls, step.layers, min_time, min_rounds).items():
            seconds[config, name] = value
            if progress is not None:
                progress(config, name, value)
        del step, impls
    return seconds


def results(seconds: dict[tuple[Config, str], float], dram: float) -> list[Result]:
    """The reported figures of each (configuration, implementation) time."""
    rows = []
    for (config, name), value in seconds.items():
        gb_per_s = config.kv_bytes / value / 1e9
        rows.append(
            Result(config, name, value * 1e3, config.batch / value, gb_per_s, gb_per_s / dram)
        )
    return rows


def grid(quick: bool) -> list[Config]:
    """The configurations measured: the full grid, or a tiny one for a smoke test."""
    if quick:
        return [Config(8, 2, 64, batch, 256, dtype) for batch in (1, 4) for dtype in ("float32",)]
    return [
        Config(*shape, batch, context, dtype)
        for shape, dtype, batch, context in itertools.product(
            SHAPES, ("float32", "bfloat16"), (1, 8, 32), (512, 1024, 2048, 4096)
        )
    ]


def environment(dram: float) -> dict:
    """Machine, versions and settings of this run."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next(line.split(":", 1)[1].strip() for line in info if "model name" in line)
    except (OSError, StopIteration):
        pass
    ipex_reason = get_backend("ipex").unavailable_reason()
    ipex_version = None
    if ipex_reason is None:
        import intel_extension_for_pytorch

        ipex_version = intel_extension_for_pytorch.__version__
    return {
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "intel_extension_for_pytorch": ipex_version,
        "ipex_unavailable_reason": ipex_reason,
        "attnexport": attnexport.__version__,
        "dram_copy_gb_per_s": dram,
        "block_size": BLOCK_SIZE,
    }


def _row(result: Result) -> str:
    c = result.config
    return (
        f"| {c.num_heads}/{c.num_kv_heads}/{c.head_size} | {c.dtype} | {c.batch} | {c.context} "
        f"| {result.implementation} | {result.ms_per_call:.3f} | {result.tokens_per_s:,.0f} "
        f"| {result.kv_gb_per_s:.2f} | {result.dram_fraction:.2f} |"
    )


TABLE_HEADER = (
    "| H/Hkv/D | dtype | batch | context | implementation | ms/call | tokens/s | KV GB/s "
    "| of DRAM |\n|---|---|---|---|---|---|---|---|---|"
)


def summary_table(rows: list[Result]) -> str:
    """One markdown row per configuration: each implementation's ms per call, the ratios, and
    the ipex backend's tokens/s, KV GB/s and fraction of DRAM bandwidth."""
    by_config: dict[Config, dict[str, Result]] = {}
    for r in rows:
        by_config.setdefault(r.config, {})[r.implementation] = r
    lines = [
        "| H/Hkv/D | dtype | batch | context | ipex-raw ms | ipex-backend ms | ipex ms | sdpa ms "
        "| ipex / raw | sdpa / ipex | ipex tokens/s | ipex KV GB/s (of DRAM) | sdpa KV GB/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c, r in by_config.items():
        if "ipex-raw" not in r:
            continue
        ipex, sdpa = r["ipex"], r["sdpa"]
        lines.append(
            f"| {c.num_heads}/{c.num_kv_heads}/{c.head_size} | {c.dtype} | {c.batch} "
            f"| {c.context} | {r['ipex-raw'].ms_per_call:.3f} "
            f"| {r['ipex-backend'].ms_per_call:.3f} | {ipex.ms_per_call:.3f} "
            f"| {sdpa.ms_per_call:.3f} | {ipex.ms_per_call / r['ipex-raw'].ms_per_call:.2f} "
            f"| {sdpa.ms_per_call / ipex.ms_per_call:.2f} | {ipex.tokens_per_s:,.0f} "
            f"| {ipex.kv_gb_per_s:.2f} ({ipex.dram_fraction:.2f}) | {sdpa.kv_gb_per_s:.2f} |"
        )
    return "\n".join(lines)


def ratios(results: list[Result]) -> list[dict]:
    """Per configuration: ipex op / raw, ipex backend / raw and sdpa / ipex op time ratios."""
    by_config: dict[Config, dict[str, float]] = {}
    for r in results:
        by_config.setdefault(r.config, {})[r.implementation] = r.ms_per_call
    rows = []
    for config, times in by_config.items():
        if "ipex-raw" not in times:
            continue
        rows.append(
            {
                "config": asdict(config),
                "ipex_over_raw": times["ipex"] / times["ipex-raw"],
                "ipex_backend_over_raw": times["ipex-backend"] / times["ipex-raw"],
                "sdpa_over_ipex": times["sdpa"] / times["ipex"],
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few tiny configurations")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--markdown", action="store_true", help="end with one markdown row per configuration"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--min-time", type=float, default=None, help="seconds per measurement")
    parser.add_argument(
        "--passes",
        type=int,
        default=1,
        help="run the grid this many times and keep each best time (on a shared machine)",
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    with_ipex = get_backend("ipex").unavailable_reason() is None
    min_time = args.min_time if args.min_time is not None else (0.02 if args.quick else 0.5)
    cache_budget = (16 if args.quick else 1024) * 2**20

    def progress(config: Config, name: str, seconds: float) -> None:
        c = config
        print(
            f"{c.num_heads}/{c.num_kv_heads}/{c.head_size} {c.dtype} b{c.batch} "
            f"ctx{c.context} {name}: {seconds * 1e3:.3f} ms",
            file=sys.stderr,
            flush=True,
        )

    dram, best = 0.0, {}
    for _ in range(max(1, args.passes)):
        dram = max(
            dram, dram_bandwidth_gb_per_s(64 if args.quick else 1024, 3 if args.quick else 8)
        )
        seconds = run(
            grid(args.quick),
            with_ipex,
            min_time,
            min_rounds=2 if args.quick else 5,
            cache_budget_bytes=cache_budget,
            progress=None if args.json else progress,
        )
        for key, value in seconds.items():
            best[key] = min(best.get(key, float("inf")), value)
    rows = results(best, dram)
    env = environment(dram) | {"passes": max(1, args.passes)}
    if args.json:
        payload = {
            "environment": env,
            "results": [asdict(r) for r in rows],
            "ratios": ratios(rows),
        }
        print(json.dumps(payload, indent=2))
        return 0
    print(json.dumps(env, indent=2))
    if args.markdown:
        print(summary_table(rows))
    else:
        print(TABLE_HEADER)
        for row in rows:
            print(_row(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
