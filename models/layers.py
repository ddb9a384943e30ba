"""Building blocks shared by the architectures: norms, activations, MLPs and the paged
attention layer (the only attention path of the zoo: the ``torch.ops.attnexport`` ops)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

import attnexport  # noqa: F401  (registers torch.ops.attnexport)
from attnexport.custom_ops.alibi import alibi_slopes as _alibi_slopes
from attnexport.models.errors import UnsupportedModelError


class PagedMetadata(NamedTuple):
    """The metadata one paged attention call reads (see ``attnexport::paged_attention``)."""

    slot_mapping: torch.Tensor
    """[T] int64, cache slot of each new token (ignored by read-only calls)."""
    block_tables: torch.Tensor
    """[S, max_blocks_per_seq] int32."""
    seq_lens: torch.Tensor
    """[S] int32, keys visible to each sequence (cached + new)."""
    query_start_loc: torch.Tensor
    """[S + 1] int32, start of each sequence's queries in the packed batch."""


class RMSNorm(nn.Module):
    """Root-mean-square norm as in Llama: computed in fp32, weight applied in the input dtype."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[..., hidden]`` -> same shape and dtype."""
        dtype = x.dtype
        x32 = x.float()
        # x / sqrt(...), not x * rsqrt(...): onnxruntime fuses this form (Pow, ReduceMean, Add,
        # Sqrt, Div, Mul) into one SimplifiedLayerNormalization node; it leaves Reciprocal alone.
        x32 = x32 / torch.sqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)`` for x, residual ``[T, hidden]``: one
        ``attnexport::fused_add_rms_norm`` (one node of an exported graph, not two)."""
        return torch.ops.attnexport.fused_add_rms_norm(x, residual, self.weight, self.eps)


def _gelu_tanh_formula(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3.0))))


def _gelu_fast(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


def _bloom_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


# The formulas of transformers' ACT2FN, by the names configs use.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_new": _gelu_tanh_formula,
    "gelu_python_tanh": _gelu_tanh_formula,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": _gelu_fast,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "relu": F.relu,
    "tanh": torch.tanh,
    "bloom_gelu": _bloom_gelu,
}


def activation(name: str, field: str = "hidden_act") -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation function ``name``; UnsupportedModelError names ``field`` if unknown."""
    if name not in ACTIVATIONS:
        raise UnsupportedModelError(
            f"{field}: unsupported activation {name!r}; supported: {', '.join(sorted(ACTIVATIONS))}"
        )
    return ACTIVATIONS[name]


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` (SwiGLU with ``silu``).

    gate and up are one fused projection ``gate_up_proj`` (one matmul per step instead of
    two); it loads from the checkpoint's ``gate_proj`` and ``up_proj`` concatenated.
    """

    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.act = activation(act)
        self.is_silu = self.act is F.silu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[T, hidden]`` -> ``[T, hidden]``."""
        gate_up = self.gate_up_proj(x)
        if self.is_silu:  # one attnexport::silu_and_mul (one node of an exported graph)
            return self.down_proj(torch.ops.attnexport.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


def alibi_slopes(num_heads: int) -> tuple[float, ...]:
    """The standard ALiBi slopes (Press et al.; BLOOM, MPT with the default max bias 8)."""
    with torch.device("cpu"):  # host values, also while a model is built on the meta device
        return tuple(_alibi_slopes(num_heads).tolist())


class ScaledCache(NamedTuple):
    """An int8 KV cache ``[num_blocks, block_size, Hkv, D]`` and its float32 scale cache
    ``[num_blocks, block_size, Hkv]``: how a layer receives int8 caches (layer code passes
    caches through untouched; :class:`PagedAttention` unpacks them)."""

    cache: torch.Tensor
    scale: torch.Tensor


LayerCache = torch.Tensor | ScaledCache
"""A layer's key (or value) cache: a tensor of a float cache dtype, or int8 with its scales."""


def _split(cache: LayerCache) -> tuple[torch.Tensor, torch.Tensor | None]:
    return (cache.cache, cache.scale) if isinstance(cache, ScaledCache) else (cache, None)


class PagedAttention(nn.Module):
    """Attention over the paged KV cache through ``attnexport::reshape_and_cache`` and
    ``attnexport::paged_attention``. Has no weights: projections belong to the architecture.

    ALiBi slopes are kept as Python floats and materialised in fp32 inside forward, so they
    stay exact whatever dtype the model is cast to.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_size: int,
        scale: float,
        *,
        causal: bool = True,
        sliding_window: int = -1,
        alibi: tuple[float, ...] | None = None,
        logits_soft_cap: float = 0.0,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise UnsupportedModelError(
                f"num_key_value_heads: {num_kv_heads} must divide num_attention_heads {num_heads}"
            )
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, head_size
        self.scale = float(scale)
        self.causal = causal
        self.sliding_window = int(sliding_window)
        self.alibi = alibi
        self.logits_soft_cap = float(logits_soft_cap)

    def write(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: LayerCache,
        value_cache: LayerCache,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Writes key/value ``[T, Hkv * D]`` (or ``[T, Hkv, D]``) at ``slot_mapping`` [T]."""
        key = key.unflatten(-1, (self.num_kv_heads, self.head_size)) if key.dim() == 2 else key
        value = (
            value.unflatten(-1, (self.num_kv_heads, self.head_size)) if value.dim() == 2 else value
        )
        (key_cache, key_scales), (value_cache, value_scales) = (
            _split(key_cache),
            _split(value_cache),
        )
        if key_scales is None:
            torch.ops.attnexport.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
            return
        torch.ops.attnexport.reshape_and_cache(
            key, value, key_cache, value_cache, slot_mapping, key_scales, value_scales
        )

    def attend(
        self,
        query: torch.Tensor,
        key_cache: LayerCache,
        value_cache: LayerCache,
        metadata: PagedMetadata,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """query ``[T, H * D]`` or ``[T, H, D]`` -> ``[T, H * D]``, reading the cache only;
        ``sinks`` [H]: attention sinks (a logit per head in each softmax), or None."""
        (key_cache, key_scales), (value_cache, value_scales) = (
            _split(key_cache),
            _split(value_cache),
        )
        scales = {}
        if key_scales is not None:
            scales = {"key_scale_cache": key_scales, "value_scale_cache": value_scales}
        if query.dim() == 2:
            query = query.unflatten(-1, (self.num_heads, self.head_size))
        slopes = None
        if self.alibi is not None:
            slopes = torch.tensor(self.alibi, dtype=torch.float32, device=query.device)
        out = torch.ops.attnexport.paged_attention(
            query,
            key_cache,
            value_cache,
            metadata.block_tables,
            metadata.seq_lens,
            metadata.query_start_loc,
            self.scale,
            self.causal,
            slopes,
            self.sliding_window,
            self.logits_soft_cap,
            **scales,
            **({} if sinks is None else {"sinks": sinks}),
        )
        return out.flatten(1)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: LayerCache,
        value_cache: LayerCache,
        metadata: PagedMetadata,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Writes the new keys/values, then attends: self-attention of a decoder layer.
        Shapes as in :meth:`write` and :meth:`attend`."""
        self.write(key, value, key_cache, value_cache, metadata.slot_mapping)
        return self.attend(query, key_cache, value_cache, metadata, sinks)


class VarlenAttention(nn.Module):
    """Attention over packed ragged sequences without a cache (``attnexport::varlen_attention``),
    for encoders."""

    def __init__(self, num_heads: int, head_size: int, scale: float, causal: bool = False):
        super().__init__()
        self.num_heads, self.head_size, self.scale, self.causal = (
            num_heads,
            head_size,
            scale,
            causal,
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cu_seqlens: torch.Tensor,
    ) -> torch.Tensor:
        """query/key/value ``[T, H * D]``; cu_seqlens ``[S + 1]`` int32 -> ``[T, H * D]``."""
        shape = (self.num_heads, self.head_size)
        out = torch.ops.attnexport.varlen_attention(
            query.unflatten(-1, shape),
            key.unflatten(-1, shape),
            value.unflatten(-1, shape),
            cu_seqlens,
            cu_seqlens,
            self.scale,
            self.causal,
        )
        return out.flatten(1)


class EmptySafeLayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` (same parameters) with its affine step outside the kernel: IPEX 2.8's
    CPU layer_norm raises on zero rows when given weight and bias under ``no_grad``, and the
    encoder of an encoder-decoder model sees zero rows in every decode-only step."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[..., normalized_shape]`` -> same shape and dtype."""
        normalized = F.layer_norm(x, self.normalized_shape, None, None, self.eps)
        return normalized * self.weight + self.bias
