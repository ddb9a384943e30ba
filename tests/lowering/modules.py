"""Small modules on the attnexport ops for the lowering tests, and a step planner that builds
each step's inputs (ragged batches, shuffled blocks, padding slots) from per-sequence state."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from attnexport.custom_ops import ScheduledSequence, build_attention_metadata
from attnexport.custom_ops.alibi import alibi_slopes

ops = torch.ops.attnexport


@dataclass(frozen=True)
class LayerOptions:
    causal: bool = True
    alibi: bool = False
    sliding_window: int = -1
    logits_soft_cap: float = 0.0


def write_and_attend(q, k, v, caches, slot_mapping, metadata, scale: float, **mask) -> torch.Tensor:
    """What every module here runs per layer: ``reshape_and_cache`` of ``k``/``v`` into
    ``caches`` (key, value) at ``slot_mapping``, then ``paged_attention`` of ``q`` over them;
    ``metadata`` is (block_tables, seq_lens, query_start_loc)."""
    key_cache, value_cache = caches
    ops.reshape_and_cache(k, v, key_cache, value_cache, slot_mapping)
    return ops.paged_attention(q, key_cache, value_cache, *metadata, scale, **mask)


class _Projections(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_size: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_size = heads, kv_heads, head_size
        self.q = nn.Linear(hidden, heads * head_size)
        self.k = nn.Linear(hidden, kv_heads * head_size)
        self.v = nn.Linear(hidden, kv_heads * head_size)
        self.o = nn.Linear(heads * head_size, hidden)

    def qkv(self, hidden: torch.Tensor, key_states: torch.Tensor):
        q = self.q(hidden).view(-1, self.heads, self.head_size)
        k = self.k(key_states).view(-1, self.kv_heads, self.head_size)
        v = self.v(key_states).view(-1, self.kv_heads, self.head_size)
        return q, k, v

    def out(self, attention: torch.Tensor) -> torch.Tensor:
        return self.o(attention.reshape(attention.shape[0], -1))


def _seeded(module: nn.Module, seed: int) -> nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in sorted(module.named_parameters()):
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return module.eval()


class AttentionStack(nn.Module):
    """A decoder-like stack: layer l projects ``hidden`` [T, E] to queries and ``key_states``
    [Tk, E] (the new tokens plus padding rows, slot -1) to keys/values, writes them into
    ``kv_caches[2l], kv_caches[2l+1]``, attends with its own options and adds the result."""

    def __init__(
        self,
        layers: Sequence[LayerOptions],
        hidden: int = 24,
        heads: int = 4,
        kv_heads: int = 2,
        head_size: int = 8,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.options = list(layers)
        self.layers = nn.ModuleList(
            _Projections(hidden, heads, kv_heads, head_size) for _ in self.options
        )
        self.register_buffer("slopes", alibi_slopes(heads))
        self.scale = head_size**-0.5
        _seeded(self, seed)

    def forward(
        self,
        hidden: torch.Tensor,
        key_states: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        for i, (layer, opt) in enumerate(zip(self.layers, self.options, strict=True)):
            q, k, v = layer.qkv(hidden, key_states)
            out = write_and_attend(
                q,
                k,
                v,
                kv_caches[2 * i : 2 * i + 2],
                slot_mapping,
                (block_tables, seq_lens, query_start_loc),
                self.scale,
                causal=opt.causal,
                alibi_slopes=self.slopes if opt.alibi else None,
                sliding_window=opt.sliding_window,
                logits_soft_cap=opt.logits_soft_cap,
            )
            hidden = hidden + layer.out(out)
            key_states = key_states + 0.5  # keys of the next layer differ from this one's
        return hidden


class CrossAttention(nn.Module):
    """Decoder queries attend (causal=False, ALiBi, window) over encoder keys/values kept in a
    paged cache. ``encoder_states`` [Te, E] are written at ``cross_slot_mapping`` when a
    sequence's encoder output arrives (Te = 0 on later steps). Caches are named tensors."""

    def __init__(self, hidden: int = 24, heads: int = 4, kv_heads: int = 1, head_size: int = 8):
        super().__init__()
        self.proj = _Projections(hidden, heads, kv_heads, head_size)
        self.register_buffer("slopes", alibi_slopes(heads))
        _seeded(self, 1)

    def forward(
        self,
        hidden: torch.Tensor,
        encoder_states: torch.Tensor,
        cross_slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
    ) -> torch.Tensor:
        q, k, v = self.proj.qkv(hidden, encoder_states)
        metadata = (block_tables, seq_lens, query_start_loc)
        caches = (key_cache, value_cache)
        out = write_and_attend(
            q,
            k,
            v,
            caches,
            cross_slot_mapping,
            metadata,
            0.3,
            causal=False,
            alibi_slopes=self.slopes,
            sliding_window=6,
        )
        return self.proj.out(out)


class VarlenEncoder(nn.Module):
    """Varlen self-attention (non-causal, ALiBi) then varlen attention over a packed memory
    (causal bottom-right, window, soft cap, GQA); no cache."""

    def __init__(self, hidden: int = 24, heads: int = 4, kv_heads: int = 2, head_size: int = 8):
        super().__init__()
        self.self_attn = _Projections(hidden, heads, heads, head_size)
        self.cross_attn = _Projections(hidden, heads, kv_heads, head_size)
        self.register_buffer("slopes", alibi_slopes(heads))
        _seeded(self, 2)

    def forward(self, hidden, cu_seqlens, memory, cu_seqlens_memory) -> torch.Tensor:
        q, k, v = self.self_attn.qkv(hidden, hidden)
        out = ops.varlen_attention(
            q, k, v, cu_seqlens, cu_seqlens, 0.35, causal=False, alibi_slopes=self.slopes
        )
        hidden = hidden + self.self_attn.out(out)
        q, k, v = self.cross_attn.qkv(hidden, memory)
        out = ops.varlen_attention(
            q,
            k,
            v,
            cu_seqlens,
            cu_seqlens_memory,
            0.35,
            causal=True,
            sliding_window=4,
            logits_soft_cap=5.0,
        )
        return hidden + self.cross_attn.out(out)


class PagedAttentionOnly(nn.Module):
    """The two ops and nothing else (no weights): any dtype onnxruntime's CPU kernels take."""

    def __init__(
        self,
        scale: float = 0.3,
        sliding_window: int = -1,
        soft_cap: float = 0.0,
        after: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ):
        """``after(attention output, key cache)``: what the module returns instead of the
        attention output, when given."""
        super().__init__()
        self.scale, self.sliding_window, self.soft_cap = scale, sliding_window, soft_cap
        self.after = after

    def forward(
        self,
        query,
        key,
        value,
        slot_mapping,
        block_tables,
        seq_lens,
        query_start_loc,
        key_cache,
        value_cache,
    ):
        metadata = (block_tables, seq_lens, query_start_loc)
        caches = (key_cache, value_cache)
        mask = {"sliding_window": self.sliding_window, "logits_soft_cap": self.soft_cap}
        out = write_and_attend(
            query, key, value, caches, slot_mapping, metadata, self.scale, **mask
        )
        return out if self.after is None else self.after(out, key_cache)


# --------------------------------------------------------------------------- step planning


class StepPlanner:
    """Per-sequence cache bookkeeping: ``step({seq: new_tokens})`` returns the step's
    ``slot_mapping`` (plus ``padding`` slots of -1 at the end), ``block_tables``, ``seq_lens``
    and ``query_start_loc``; blocks come from a shuffled free list."""

    def __init__(self, num_blocks: int, block_size: int, seed: int = 0) -> None:
        self.block_size = block_size
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.cached: dict[int, int] = {}
        self.blocks: dict[int, list[int]] = {}

    def step(self, new_tokens: dict[int, int], padding: int = 0, slot_dtype=torch.int64) -> dict:
        scheduled = []
        for seq, count in new_tokens.items():
            cached = self.cached.get(seq, 0)
            blocks = self.blocks.setdefault(seq, [])
            while len(blocks) * self.block_size < cached + count:
                blocks.append(self.free.pop())
            scheduled.append(ScheduledSequence(cached, count, list(blocks)))
            self.cached[seq] = cached + count
        metadata = build_attention_metadata(scheduled, self.block_size)
        slots = torch.cat([metadata.slot_mapping, torch.full((padding,), -1)]).to(slot_dtype)
        return {
            "slot_mapping": slots,
            "block_tables": metadata.block_tables,
            "seq_lens": metadata.seq_lens,
            "query_start_loc": metadata.query_start_loc,
        }


def attention_inputs(
    step: dict,
    padding: int = 0,
    *,
    heads: int = 4,
    kv_heads: int = 2,
    head_size: int = 8,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> dict:
    """Random ``query`` [T, heads, D] and ``key``/``value`` [T + padding, kv_heads, D] for a
    planned ``step`` (whose slot mapping ends with ``padding`` slots of -1), then the step's
    metadata: the inputs of :class:`PagedAttentionOnly` without the caches, in order."""
    tokens = int(step["query_start_loc"][-1])
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=generator).to(dtype)

    return {
        "query": rand(tokens, heads, head_size),
        "key": rand(tokens + padding, kv_heads, head_size),
        "value": rand(tokens + padding, kv_heads, head_size),
        **step,
    }
