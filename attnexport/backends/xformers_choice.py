"""Which xFormers operator runs which attention case, and why a case cannot run.

Pure Python over two small fact records, so every choice and every reason is testable without a
GPU or xFormers:

* :class:`Environment` — what is installed (torch, xFormers and its torch requirement) and whether
  a CUDA device is there; :func:`unavailable_reason` turns it into the backend's verdict.
* :class:`DeviceFacts` — what the GPU and the installed xFormers build offer (compute capability,
  FlashAttention-3, FlashAttention-2 with or without paged KV, Triton).

The operators (names used throughout the backend, docs and tests):

``fa3``
    FlashAttention-3 (``xformers.ops.fmha.flash3``): Hopper (sm90) only, fp16/bf16, head sizes
    32..256 in multiples of 8, paged KV with any block size, block-diagonal and local masks.
``fa2``
    FlashAttention-2 (``xformers.ops.fmha.flash``): sm80+, fp16/bf16, head sizes up to 256 in
    multiples of 8. Paged KV only with the kernels of the ``flash_attn`` package (2.7.1..2.8.2)
    and block sizes that are multiples of 256; the PyTorch kernels xFormers falls back to take
    no block table.
``triton_splitk``
    xFormers' Triton split-K decoder (``xformers.ops.fmha.triton_splitk``): sm80+, fp16/bf16,
    head sizes 16..512 (powers of two), block sizes that are multiples of 64; causal paged masks
    only when every sequence has the same number of queries, at most 16.
``cutlass``
    The CUTLASS kernel that PyTorch ships (``xformers.ops.fmha.cutlass``): fp32/fp16/bf16, any
    head size aligned to 16 bytes, block-diagonal masks and dense tensor biases (ALiBi), no
    paged KV.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from attnexport.custom_ops.dispatch import AttentionCall

HALF_DTYPES = (torch.float16, torch.bfloat16)
MIN_CAPABILITY = (8, 0)
PAGED_OPS = ("fa3", "triton_splitk", "fa2")
"""Operators that read the paged cache directly, in order of preference."""
TRITON_HEAD_SIZES = (16, 32, 64, 128, 256, 512)
TRITON_BLOCK_MULTIPLE = 64
TRITON_MAX_CAUSAL_QUERIES = 16
FA2_PAGED_BLOCK_MULTIPLE = 256
INSTALL_HINT = 'pip install "attnexport[xformers]"'


# --------------------------------------------------------------------------- availability


@dataclass(frozen=True)
class Environment:
    """What the machine offers the backend, gathered cheaply (xFormers is imported only when a
    CUDA device is present)."""

    torch_version: str
    xformers_version: str | None
    """None when xFormers is not installed."""
    xformers_requires: tuple[str, ...] = ()
    """xFormers' declared requirements (``Requires-Dist`` lines)."""
    cuda_available: bool = False
    capability: tuple[int, int] | None = None
    import_error: str | None = None
    """Why ``import xformers.ops.fmha`` failed, if it was tried and failed."""


def _release(version: str) -> tuple[int, ...]:
    """(2, 8, 0) from '2.8.0+cu128' or '2.10.0a0'."""
    numbers = re.match(r"\d+(\.\d+)*", version)
    return tuple(int(n) for n in numbers.group(0).split(".")) if numbers else ()


def torch_requirement_problem(
    requires: Sequence[str], torch_version: str, xformers_version: str
) -> str | None:
    """Why the running torch does not satisfy xFormers' ``torch`` requirement (None if it does).

    Understands the specifiers xFormers wheels use (``torch==2.8.0``, ``torch>=2.10``) and
    comma-separated combinations of ``==``, ``>=``, ``<=``, ``>``, ``<``.
    """
    have = _release(torch_version)
    for line in requires:
        requirement = line.split(";")[0].strip()
        match = re.fullmatch(r"torch\s*\(?\s*([^)]*)\)?", requirement)
        if not match or not match.group(1):
            continue
        for spec in match.group(1).split(","):
            op_match = re.fullmatch(r"\s*(==|>=|<=|>|<)\s*([\w.+*]+)\s*", spec)
            if not op_match:
                continue
            op, version = op_match.groups()
            want = _release(version)
            if op == "==" and version.endswith(".*"):
                ok = have[: len(want)] == want
            else:
                padded = have[: len(want)] + (0,) * max(0, len(want) - len(have))
                ok = {
                    "==": padded == want,
                    ">=": padded >= want,
                    "<=": padded <= want,
                    ">": padded > want,
                    "<": padded < want,
                }[op]
            if not ok:
                return (
                    f"torch/xformers version mismatch: xformers {xformers_version} requires "
                    f"{requirement} but torch {torch_version} is installed; install the xformers "
                    f"release built for this torch (see docs/backends.md)"
                )
    return None


def capability_problem(capability: tuple[int, int]) -> str | None:
    """Why a GPU of compute ``capability`` cannot run the backend (None if it can)."""
    if capability < MIN_CAPABILITY:
        return (
            f"GPU compute capability sm{capability[0]}{capability[1]} is too old: the xformers "
            f"backend needs sm80 or newer (Ampere, Hopper, ...)"
        )
    return None


def unavailable_reason(env: Environment) -> str | None:
    """Why the xFormers backend cannot run on this machine at all; None when it can."""
    if env.xformers_version is None:
        return f"xformers is not installed; install it with: {INSTALL_HINT}"
    mismatch = torch_requirement_problem(
        env.xformers_requires, env.torch_version, env.xformers_version
    )
    if mismatch:
        return mismatch
    if not env.cuda_available:
        return (
            "no CUDA device (torch.cuda.is_available() is False): xFormers has no CPU kernels; "
            "the sdpa backend runs on CPU"
        )
    if env.import_error:
        return f"xformers {env.xformers_version} failed to import: {env.import_error}"
    if env.capability is not None:
        return capability_problem(env.capability)
    return None


# --------------------------------------------------------------------------- operators


@dataclass(frozen=True)
class DeviceFacts:
    """What the current GPU and the installed xFormers build offer."""

    capability: tuple[int, int]
    fa3: bool
    """xFormers' FlashAttention-3 operator is loaded (bundled or the flash_attn_3 package)."""
    fa2: bool
    """A FlashAttention-2 operator is loaded (PyTorch's kernels or the flash_attn package's)."""
    fa2_paged: bool
    """... and it takes a block table (only the flash_attn package's kernels do)."""
    triton: bool
    """Triton runs here, so xFormers' split-K decoder does."""


@dataclass(frozen=True)
class PagedCase:
    """The facts of a paged-attention batch that decide which operator can read the cache."""

    dtype: torch.dtype
    head_size: int
    block_size: int
    causal: bool = True
    sliding_window: bool = False
    query_len: int | None = 1
    """The query count shared by every sequence; None when the counts differ."""


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _half_reason(op: str, dtype: torch.dtype) -> list[str]:
    if dtype in HALF_DTYPES:
        return []
    return [f"{op}: dtype={_name(dtype)} (supported: float16, bfloat16)"]


def _fa3_device_reasons(facts: DeviceFacts) -> list[str]:
    major, minor = facts.capability
    if major != 9:
        return [f"fa3: needs a Hopper GPU (sm90), this GPU is sm{major}{minor}"]
    if not facts.fa3:
        return ["fa3: the FlashAttention-3 kernels are not in this xformers installation"]
    return []


def _fa3_reasons(dtype: torch.dtype, head_size: int, facts: DeviceFacts) -> list[str]:
    reasons = _fa3_device_reasons(facts) + _half_reason("fa3", dtype)
    if not (32 <= head_size <= 256 and head_size % 8 == 0):
        reasons.append(f"fa3: head_size={head_size} (supported: 32..256, multiples of 8)")
    return reasons


def _fa2_shape_reasons(dtype: torch.dtype, head_size: int) -> list[str]:
    reasons = _half_reason("fa2", dtype)
    if not (head_size <= 256 and head_size % 8 == 0):
        reasons.append(f"fa2: head_size={head_size} (supported: up to 256, multiples of 8)")
    return reasons


def _fa2_reasons(dtype: torch.dtype, head_size: int, facts: DeviceFacts) -> list[str]:
    reasons = [] if facts.fa2 else ["fa2: no FlashAttention-2 kernels in this installation"]
    return reasons + _fa2_shape_reasons(dtype, head_size)


def paged_op_reasons(op: str, case: PagedCase, facts: DeviceFacts) -> list[str]:
    """Why operator ``op`` (one of :data:`PAGED_OPS`) cannot run ``case`` from the paged cache."""
    windowed_chunk = case.sliding_window and case.query_len != 1
    if op == "fa3":
        reasons = _fa3_reasons(case.dtype, case.head_size, facts)
        if windowed_chunk:
            reasons.append(
                "fa3: xformers has no paged mask with a sliding window for several queries "
                "per sequence (windowed decode uses a gappy paged mask)"
            )
        return reasons
    if op == "triton_splitk":
        reasons = [] if facts.triton else ["triton_splitk: Triton is not available"]
        reasons += _half_reason("triton_splitk", case.dtype)
        if case.head_size not in TRITON_HEAD_SIZES:
            reasons.append(
                f"triton_splitk: head_size={case.head_size} (supported: "
                f"{', '.join(map(str, TRITON_HEAD_SIZES))})"
            )
        if case.block_size % TRITON_BLOCK_MULTIPLE:
            reasons.append(
                f"triton_splitk: block_size={case.block_size} (must be a multiple of "
                f"{TRITON_BLOCK_MULTIPLE})"
            )
        if case.causal and (case.query_len is None or case.query_len > TRITON_MAX_CAUSAL_QUERIES):
            reasons.append(
                "triton_splitk: causal paged attention needs the same query count in every "
                f"sequence, at most {TRITON_MAX_CAUSAL_QUERIES}"
            )
        if windowed_chunk:
            reasons.append(
                "triton_splitk: no paged sliding-window mask for several queries per sequence"
            )
        return reasons
    if op == "fa2":
        reasons = []
        if not facts.fa2_paged:
            reasons.append(
                "fa2: paged KV needs the flash_attn package (2.7.1..2.8.2); the PyTorch "
                "FlashAttention-2 kernels that xformers uses otherwise take no block table"
            )
        reasons += _fa2_shape_reasons(case.dtype, case.head_size)
        if case.block_size % FA2_PAGED_BLOCK_MULTIPLE:
            reasons.append(
                f"fa2: block_size={case.block_size} (paged KV needs a multiple of "
                f"{FA2_PAGED_BLOCK_MULTIPLE})"
            )
        if case.sliding_window:
            reasons.append("fa2: xformers has no FlashAttention-2 paged sliding-window mask")
        return reasons
    raise ValueError(f"op: expected one of {PAGED_OPS}, got {op!r}")


def choose_paged_op(case: PagedCase, facts: DeviceFacts) -> str | None:
    """The preferred operator that reads the paged cache for ``case``, or None."""
    for op in PAGED_OPS:
        if not paged_op_reasons(op, case, facts):
            return op
    return None


def varlen_op(dtype: torch.dtype, head_size: int, alibi: bool, facts: DeviceFacts) -> str:
    """The operator for attention over packed (not paged) keys: ``fa3``, ``fa2`` or ``cutlass``.

    ALiBi needs a dense tensor bias, which only ``cutlass`` takes; fp32 runs on ``cutlass``.
    """
    if alibi:
        return "cutlass"
    if not _fa3_reasons(dtype, head_size, facts):
        return "fa3"
    if not _fa2_reasons(dtype, head_size, facts):
        return "fa2"
    return "cutlass"


@dataclass(frozen=True)
class PagedRoute:
    """How one paged-attention batch runs. Rows index the sequences given to :func:`route_paged`.

    ``paged_rows`` run in one call of ``paged_op`` straight from the cache; ``gather_rows`` have
    their keys/values gathered from the cache into packed tensors and run on ``gather_op`` with a
    block-diagonal mask (or one dense ALiBi bias per sequence).
    """

    paged_op: str | None
    paged_rows: tuple[int, ...]
    gather_op: str
    gather_rows: tuple[int, ...]


def route_paged(
    query_lens: Sequence[int],
    dtype: torch.dtype,
    head_size: int,
    block_size: int,
    causal: bool,
    sliding_window: bool,
    alibi: bool,
    facts: DeviceFacts,
) -> PagedRoute:
    """Splits a batch (sequences with at least one query) between a paged operator and the
    gather path: ALiBi always gathers; otherwise one paged operator takes the whole batch if it
    can, else single-query rows go to a paged operator and the others are gathered."""
    rows = tuple(range(len(query_lens)))
    gather_op = varlen_op(dtype, head_size, alibi, facts)
    if alibi:
        return PagedRoute(None, (), gather_op, rows)
    shared = query_lens[0] if query_lens and len(set(query_lens)) == 1 else None
    base = PagedCase(dtype, head_size, block_size, causal, sliding_window, shared)
    op = choose_paged_op(base, facts)
    if op is not None:
        return PagedRoute(op, rows, gather_op, ())
    singles = tuple(r for r in rows if query_lens[r] == 1)
    others = tuple(r for r in rows if query_lens[r] != 1)
    single_op = choose_paged_op(
        PagedCase(dtype, head_size, block_size, causal, sliding_window, 1), facts
    )
    if singles and single_op is not None:
        return PagedRoute(single_op, singles, gather_op, others)
    return PagedRoute(None, (), gather_op, rows)


# --------------------------------------------------------------------------- per-call reasons


def call_reasons(call: AttentionCall, facts: DeviceFacts) -> list[str]:
    """Reasons beyond the backend's static capabilities why ``call`` cannot run on this GPU."""
    reasons = []
    alignment = 4 if call.dtype == torch.float32 else 8
    if call.op != "reshape_and_cache" and call.head_size % alignment:
        reasons.append(
            f"head_size={call.head_size} (must be a multiple of 8 for float16/bfloat16, "
            f"4 for float32)"
        )
    if call.op != "reshape_and_cache" and not call.causal and call.sliding_window:
        reasons.append("sliding window with non-causal attention: no xformers mask for it")
    if call.op != "paged_attention":
        return reasons
    if not call.cache_contiguous:
        reasons.append(
            "the caches must be contiguous [num_blocks, block_size, num_kv_heads, head_size] "
            "tensors"
        )
    if call.decode_only and call.alibi:
        reasons.append(
            "ALiBi in a decode-only batch: no paged xformers operator takes a tensor bias "
            "(ALiBi runs in prefill, through cutlass)"
        )
    elif call.decode_only:
        case = PagedCase(
            call.dtype, call.head_size, call.block_size or 0, call.causal, call.sliding_window, 1
        )
        if choose_paged_op(case, facts) is None:
            every = [r for op in PAGED_OPS for r in paged_op_reasons(op, case, facts)]
            reasons.append("no paged xformers operator for this decode batch: " + "; ".join(every))
    return reasons
