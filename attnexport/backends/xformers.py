"""The ``xformers`` backend: xFormers' fused attention kernels on NVIDIA GPUs (sm80+).

How each case runs (operators and their limits: :mod:`.xformers_choice`; masks:
:mod:`.xformers_masks`):

* ``reshape_and_cache``: the sdpa backend's indexed write (plain CUDA tensor ops; no xFormers
  operator writes a cache).
* ``varlen_attention``: one ``memory_efficient_attention_forward`` call over the packed batch
  with a block-diagonal bottom-right mask, grouped-query heads in xFormers' 5-D ``BMGHK`` form
  (K/V broadcast over the heads of a group, no copy), on ``fa3`` (Hopper), ``fa2`` or
  ``cutlass`` (fp32). ALiBi runs one ``cutlass`` call per sequence with a dense tensor bias.
* ``paged_attention``: the batch's sequences go to one operator that reads the cache in place
  through a ``PagedBlockDiagonal*`` mask (``fa3`` on Hopper, else ``triton_splitk`` or ``fa2``
  where block size and query counts allow); where none can, multi-token sequences have their
  keys gathered from the cache and run as ``varlen_attention`` does, and decode-only batches
  are refused (``auto`` then runs them on sdpa). Windowed decode uses a gappy paged mask.

Host-side work (sequence lengths to Python, masks, index tensors) is done once per step and kept
in the executor's step plan (:mod:`attnexport.custom_ops.planning`), so every layer reuses it.
Logits soft-capping is not exposed by any xFormers operator and is refused.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import itertools
from dataclasses import dataclass

import torch

from attnexport.backends import xformers_choice as choice
from attnexport.backends import xformers_masks as masks
from attnexport.backends.sdpa import write_cache
from attnexport.custom_ops.backend import AttentionBackend
from attnexport.custom_ops.dispatch import AttentionCall, BackendCapabilities
from attnexport.custom_ops.paged_attention import PagedAttentionCall
from attnexport.custom_ops.planning import memoised
from attnexport.custom_ops.reshape_and_cache import CacheWriteCall
from attnexport.custom_ops.varlen_attention import VarlenAttentionCall


def environment() -> choice.Environment:
    """Gathers what decides availability. xFormers is imported only on a CUDA machine whose
    torch satisfies xFormers' requirement (the import takes seconds and a mismatched build can
    fail to load)."""
    torch_version = torch.__version__
    try:
        version = importlib.metadata.version("xformers")
        requires = tuple(importlib.metadata.requires("xformers") or ())
    except importlib.metadata.PackageNotFoundError:
        if importlib.util.find_spec("xformers") is None:
            return choice.Environment(torch_version, None)
        version, requires = "(unknown version)", ()
    if not torch.cuda.is_available():
        return choice.Environment(torch_version, version, requires)
    if choice.torch_requirement_problem(requires, torch_version, version):
        return choice.Environment(torch_version, version, requires, cuda_available=True)
    try:
        import xformers.ops.fmha  # noqa: F401
    except Exception as error:  # a broken build raises anything from OSError to RuntimeError
        return choice.Environment(
            torch_version, version, requires, True, import_error=f"{type(error).__name__}: {error}"
        )
    return choice.Environment(
        torch_version, version, requires, True, torch.cuda.get_device_capability()
    )


@functools.cache
def _unavailable_reason() -> str | None:
    return choice.unavailable_reason(environment())


@functools.cache
def device_facts(index: int) -> choice.DeviceFacts:
    """What xFormers offers on CUDA device ``index`` (requires an available backend)."""
    import xformers
    from xformers.ops.fmha import flash, flash3, triton_splitk

    fa2 = flash.FwOp.is_available()
    return choice.DeviceFacts(
        capability=torch.cuda.get_device_capability(index),
        fa3=flash3.FwOp.is_available() and flash3._C_flashattention3 is not None,
        fa2=fa2,
        # xformers falls back to PyTorch's FlashAttention-2 kernels, which take no block table.
        fa2_paged=fa2 and not flash._USE_PT_FLASH_ATTN,
        triton=bool(xformers._is_triton_available()) and triton_splitk.FwOp.is_available(),
    )


def _facts(device: torch.device) -> choice.DeviceFacts:
    return device_facts(device.index if device.index is not None else torch.cuda.current_device())


def _operator(name: str, paged: bool):
    """The xFormers forward operator class called ``name`` in :mod:`.xformers_choice`."""
    from xformers.ops.fmha import cutlass, flash, flash3, triton_splitk

    if name == "fa3":
        # The KV-split variant splits long decode contexts across SMs (plain FwOp never does).
        return flash3.FwOp_KVSplit if paged else flash3.FwOp
    return {"fa2": flash.FwOp, "triton_splitk": triton_splitk.FwOp, "cutlass": cutlass.FwOp}[name]


def _forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias, scale, op):
    """``xformers.ops.fmha.memory_efficient_attention_forward`` with an explicit operator (the
    one place the backend calls into xFormers' kernels)."""
    from xformers.ops import fmha

    return fmha.memory_efficient_attention_forward(
        query, key, value, attn_bias=bias, scale=scale, op=op
    )


def _attend(
    op: str,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bias,
    scale: float,
    paged: bool = False,
) -> torch.Tensor:
    """One xFormers call: query ``[n, H, D]`` over key/value ``[m, Hkv, D]`` (a paged cache as
    ``[num_blocks * block_size, Hkv, D]``), grouped heads as 5-D BMGHK; returns ``[n, H, D]``."""
    num_tokens, num_heads, head_size = query.shape
    num_keys, num_kv_heads = key.shape[:2]
    group = num_heads // num_kv_heads
    shape = (1, num_keys, num_kv_heads, group, head_size)
    out = _forward(
        query.reshape(1, num_tokens, num_kv_heads, group, head_size),
        key.unsqueeze(0).unsqueeze(3).expand(shape),
        value.unsqueeze(0).unsqueeze(3).expand(shape),
        bias,
        scale,
        _operator(op, paged),
    )
    return out.reshape(num_tokens, num_heads, head_size)


def _ranges(starts: list[int], stops: list[int], device: torch.device) -> torch.Tensor:
    """int64 indices of the concatenated ranges [starts[i], stops[i])."""
    pieces = [torch.arange(a, b) for a, b in zip(starts, stops, strict=True) if b > a]
    index = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)
    return index.to(device)


@dataclass(frozen=True)
class PlanKind:
    """What a plan depends on besides the lengths and the device: the mask (causal, window,
    ALiBi) and what picks the operators (dtype, head size)."""

    causal: bool
    sliding_window: int
    alibi: bool
    dtype: torch.dtype
    head_size: int

    @classmethod
    def of(cls, call: VarlenAttentionCall | PagedAttentionCall) -> PlanKind:
        query = call.query
        alibi = call.alibi_slopes is not None
        return cls(call.causal, call.sliding_window, alibi, query.dtype, query.shape[2])


@dataclass
class _VarlenPlan:
    """Packed attention of ragged sequences, planned once per step."""

    op: str
    keep: torch.Tensor | None
    """Query tokens that see at least one key (the others get zeros); None: all of them."""
    query_lens: list[int]
    """Kept queries per sequence."""
    key_lens: list[int]
    causal: bool
    sliding_window: int
    bias: object | None
    """The block-diagonal xFormers mask; None with ALiBi (dense biases are built per call)."""


def plan_varlen(
    query_lens: list[int],
    key_lens: list[int],
    kind: PlanKind,
    facts: choice.DeviceFacts,
    device: torch.device,
) -> _VarlenPlan:
    """Plans ragged attention: query i of a sequence with q queries and k keys at position
    k - q + i. A causal query before the first key (q > k) and any query of a sequence without
    keys sees nothing: it is dropped here and gets zeros, since xFormers' masks need every
    query row to see a key."""
    causal, sliding_window = kind.causal, kind.sliding_window
    kept = [
        (min(q, k) if causal else q) if k > 0 else 0
        for q, k in zip(query_lens, key_lens, strict=True)
    ]
    keep = None
    if kept != list(query_lens):
        starts = list(itertools.accumulate(query_lens, initial=0))
        keep = _ranges(
            [s + q - n for s, q, n in zip(starts[:-1], query_lens, kept, strict=True)],
            starts[1:],
            device,
        )
    bias = None
    if not kind.alibi:
        bias = masks.block_diagonal_bias(kept, key_lens, causal, sliding_window, device)
    return _VarlenPlan(
        op=choice.varlen_op(kind.dtype, kind.head_size, kind.alibi, facts),
        keep=keep,
        query_lens=kept,
        key_lens=list(key_lens),
        causal=causal,
        sliding_window=sliding_window,
        bias=bias,
    )


def _run_varlen(
    plan: _VarlenPlan,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    alibi_slopes: torch.Tensor | None,
) -> torch.Tensor:
    """Executes ``plan`` on query ``[Tq, H, D]``, packed key/value ``[Tk, Hkv, D]``."""
    q = query if plan.keep is None else query.index_select(0, plan.keep)
    if alibi_slopes is None:
        result = _attend(plan.op, q, key, value, plan.bias, scale)
    else:
        result = _attend_alibi(plan, q, key, value, scale, alibi_slopes)
    if plan.keep is None:
        return result
    out = torch.zeros_like(query)
    out.index_copy_(0, plan.keep, result)
    return out


def _attend_alibi(
    plan: _VarlenPlan,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    alibi_slopes: torch.Tensor,
) -> torch.Tensor:
    """ALiBi: one CUTLASS call per sequence with a dense ``[1, H, q, k]`` bias (ALiBi and the
    mask); K/V heads are repeated for the group because a tensor bias needs the 4-D layout."""
    group = query.shape[1] // key.shape[1]
    out = torch.empty_like(query)
    q_starts = list(itertools.accumulate(plan.query_lens, initial=0))[:-1]
    k_starts = list(itertools.accumulate(plan.key_lens, initial=0))[:-1]
    for q0, k0, nq, nk in zip(q_starts, k_starts, plan.query_lens, plan.key_lens, strict=True):
        if nq == 0:
            continue
        bias = masks.alibi_bias(alibi_slopes, nq, nk, plan.causal, plan.sliding_window, query.dtype)
        out[q0 : q0 + nq] = _forward(
            query[q0 : q0 + nq].unsqueeze(0),
            key[k0 : k0 + nk].repeat_interleave(group, dim=1).unsqueeze(0),
            value[k0 : k0 + nk].repeat_interleave(group, dim=1).unsqueeze(0),
            bias,
            scale,
            _operator("cutlass", paged=False),
        )[0]
    return out


@dataclass
class _PagedPart:
    """Sequences that one operator reads straight from the cache."""

    op: str
    tokens: torch.Tensor | None
    """Their query tokens; None when they are the whole batch."""
    bias: object


@dataclass
class _GatheredPart:
    """Sequences whose keys are gathered from the cache and attended as packed sequences."""

    tokens: torch.Tensor | None
    slots: torch.Tensor
    """int64 cache slots of their keys, sequence after sequence."""
    varlen: _VarlenPlan


@dataclass
class _PagedPlan:
    covers_all: bool
    """Every query token is computed (else the output starts as zeros)."""
    paged: _PagedPart | None
    gathered: _GatheredPart | None


def plan_paged(
    block_tables: torch.Tensor,
    seq_lens: list[int],
    query_start_loc: list[int],
    block_size: int,
    kind: PlanKind,
    facts: choice.DeviceFacts,
) -> _PagedPlan:
    """Plans a paged-attention batch (see :func:`.xformers_choice.route_paged`). Sequences
    without queries, or without keys (non-causal), contribute nothing and are left out."""
    device = block_tables.device
    query_lens = [b - a for a, b in itertools.pairwise(query_start_loc)]
    rows = [i for i, (q, n) in enumerate(zip(query_lens, seq_lens, strict=True)) if q > 0 and n > 0]
    route = choice.route_paged(
        [query_lens[i] for i in rows],
        kind.dtype,
        kind.head_size,
        block_size,
        kind.causal,
        kind.sliding_window >= 0,
        kind.alibi,
        facts,
    )
    covered = sum(query_lens[i] for i in rows)
    total = query_start_loc[-1]

    def tokens(selected: list[int]) -> torch.Tensor | None:
        if sum(query_lens[i] for i in selected) == total:
            return None
        starts = [query_start_loc[i] for i in selected]
        return _ranges(starts, [query_start_loc[i + 1] for i in selected], device)

    def tables(selected: list[int]) -> torch.Tensor:
        width = max(-(-seq_lens[i] // block_size) for i in selected)
        if len(selected) == block_tables.shape[0] and width == block_tables.shape[1]:
            return block_tables
        index = torch.tensor(selected, device=device)
        return block_tables.index_select(0, index)[:, :width].contiguous()

    paged = gathered = None
    paged_rows = [rows[r] for r in route.paged_rows]
    if paged_rows:
        bias = masks.paged_bias(
            [query_lens[i] for i in paged_rows],
            [seq_lens[i] for i in paged_rows],
            tables(paged_rows),
            block_size,
            kind.causal,
            kind.sliding_window,
        )
        paged = _PagedPart(route.paged_op, tokens(paged_rows), bias)
    gather_rows = [rows[r] for r in route.gather_rows]
    if gather_rows:
        lens = [seq_lens[i] for i in gather_rows]
        table = tables(gather_rows).to(torch.int64)
        positions = torch.arange(max(lens), device=device)
        slots = table[:, positions // block_size] * block_size + positions % block_size
        in_sequence = positions[None, :] < torch.tensor(lens, device=device)[:, None]
        gathered = _GatheredPart(
            tokens(gather_rows),
            slots[in_sequence],
            plan_varlen([query_lens[i] for i in gather_rows], lens, kind, facts, device),
        )
    return _PagedPlan(covered == total, paged, gathered)


class XformersBackend(AttentionBackend):
    """xFormers kernels on CUDA; ``auto`` prefers it and falls back to sdpa for what it refuses."""

    name = "xformers"
    priority = 20
    capabilities = BackendCapabilities(
        ops=frozenset({"reshape_and_cache", "paged_attention", "varlen_attention"}),
        devices=frozenset({"cuda"}),
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
        max_head_size=256,
        soft_cap=False,
        cache_dtype_reason=(
            "xFormers' attention kernels take keys and values of the query's dtype (there is "
            "no mixed-precision or int8 KV path to run)"
        ),
        notes=(
            "CUDA sm80+; float32 only through cutlass (packed keys, no paged kernel)",
            "paged decode needs fa3 (Hopper), triton_splitk (block_size % 64 == 0) or fa2 "
            "from flash_attn (block_size % 256 == 0); batches with prefill tokens always run",
            "ALiBi: prefill and mixed batches only (dense bias through cutlass)",
            "sliding window: causal only; paged only for decode (gappy mask) or via gathered keys",
        ),
    )

    def unavailable_reason(self) -> str | None:
        return _unavailable_reason()

    def not_supported_reasons(self, call: AttentionCall) -> list[str]:
        reasons = super().not_supported_reasons(call)
        if self.unavailable_reason() is not None or call.device_type != "cuda":
            return reasons
        return reasons + choice.call_reasons(call, device_facts(torch.cuda.current_device()))

    def reshape_and_cache(self, call: CacheWriteCall) -> None:
        write_cache(call)

    def varlen_attention(self, call: VarlenAttentionCall) -> torch.Tensor:
        query, kind = call.query, PlanKind.of(call)

        def build() -> _VarlenPlan:
            q_starts, k_starts = call.cu_seqlens_q.tolist(), call.cu_seqlens_k.tolist()
            return plan_varlen(
                [b - a for a, b in itertools.pairwise(q_starts)],
                [b - a for a, b in itertools.pairwise(k_starts)],
                kind,
                _facts(query.device),
                query.device,
            )

        plan = memoised("xformers-varlen", (call.cu_seqlens_q, call.cu_seqlens_k), (kind,), build)
        key, value = call.key.contiguous(), call.value.contiguous()
        return _run_varlen(plan, query.contiguous(), key, value, call.scale, call.alibi_slopes)

    def paged_attention(self, call: PagedAttentionCall) -> torch.Tensor:
        query, key_cache, block_size = call.query, call.key_cache, call.key_cache.shape[1]
        kind, scale = PlanKind.of(call), call.scale
        metadata = (call.block_tables, call.seq_lens, call.query_start_loc)
        plan = memoised(
            "xformers-paged",
            metadata,
            (kind, block_size),
            lambda: plan_paged(
                call.block_tables,
                call.seq_lens.tolist(),
                call.query_start_loc.tolist(),
                block_size,
                kind,
                _facts(query.device),
            ),
        )

        query = query.contiguous()
        num_kv_heads, head_size = key_cache.shape[2:]
        flat_keys = key_cache.view(-1, num_kv_heads, head_size)
        flat_values = call.value_cache.view(-1, num_kv_heads, head_size)
        part = plan.paged
        if plan.covers_all and plan.gathered is None and part.tokens is None:
            return _attend(part.op, query, flat_keys, flat_values, part.bias, scale, paged=True)
        out = torch.zeros_like(query) if not plan.covers_all else torch.empty_like(query)
        if part is not None:
            q = query if part.tokens is None else query.index_select(0, part.tokens)
            result = _attend(part.op, q, flat_keys, flat_values, part.bias, scale, paged=True)
            _put(out, part.tokens, result)
        gathered = plan.gathered
        if gathered is not None:
            q = query if gathered.tokens is None else query.index_select(0, gathered.tokens)
            result = _run_varlen(
                gathered.varlen,
                q,
                flat_keys.index_select(0, gathered.slots),
                flat_values.index_select(0, gathered.slots),
                scale,
                call.alibi_slopes,
            )
            _put(out, gathered.tokens, result)
        return out


def _put(out: torch.Tensor, tokens: torch.Tensor | None, result: torch.Tensor) -> None:
    if tokens is None:
        out.copy_(result)
    else:
        out.index_copy_(0, tokens, result)
