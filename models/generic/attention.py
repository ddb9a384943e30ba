"""The attention function the transformers path registers with transformers'
``AttentionInterface``: every attention layer of a transformers model loaded with
``attn_implementation=ATTENTION`` calls it with its query, key and value heads (after the
model's own RoPE and q/k norms) and its options; the step (the paged metadata and the layer's
caches) is the one :func:`stepping` set for the forward. It writes the new keys and
values with ``attnexport::reshape_and_cache`` and attends with ``attnexport::paged_attention``;
scaling, sliding window and soft-cap come from the layer's own arguments.

No dense mask is built: transformers skips mask creation for an attention implementation that
has no mask function (``AttentionMaskInterface``), and the causal and window masking are the
op's (``seq_lens``, ``query_start_loc``).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from attnexport.models.errors import UnsupportedModelError
from attnexport.models.layers import LayerCache, PagedAttention, PagedMetadata

ATTENTION = "attnexport_paged"
"""The name of the attention implementation (``config._attn_implementation``)."""
SLOT_ATTRIBUTE = "_attnexport_cache_slot"
"""Set on each attention module by the probe: the index of its caches in ``kv_caches``."""
_ACTIVE_STEP: contextvars.ContextVar[PagedStep | None] = contextvars.ContextVar(
    "attnexport_active_step", default=None
)

# Keyword arguments of transformers' attention calls that ask for something paged_attention
# does not compute; a layer passing one of them (not None) is refused.
_UNSUPPORTED_ARGUMENTS = {
    "position_bias": "a relative position bias added to the attention scores",
    "block_indices": "block-sparse attention (indices of the attended key blocks)",
    "indices": "sparse attention (indices of the attended keys)",
}


@dataclass(frozen=True)
class LayerCall:
    """What the probe learns of one attention call: the geometry of its heads and options."""

    module: torch.nn.Module
    num_heads: int
    num_kv_heads: int
    head_size: int
    """The caches' head size: the key heads' or the value heads', the larger (the other padded)."""
    value_head_size: int
    dtype: torch.dtype
    scale: float
    sliding_window: int
    logits_soft_cap: float
    refusals: tuple[str, ...] = ()
    """Why this call cannot run on the paged ops (empty: it can)."""


@dataclass
class PagedStep:
    """One forward's paged state, handed to every attention call by :func:`stepping`.

    With ``caches`` None the step only records each call (:class:`LayerCall`) and returns zeros
    of the attention output's shape: the probe that learns a model's cache geometry before any
    cache exists.
    """

    metadata: PagedMetadata | None = None
    caches: list[tuple[LayerCache, LayerCache]] | None = None
    """Per cache slot, the (key cache, value cache) of the layer (int8: ScaledCache)."""
    recorded: list[LayerCall] = field(default_factory=list)

    def attend(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        options: dict,
    ) -> torch.Tensor:
        """query ``[1, H, T, D]``, key/value ``[1, Hkv, T, D]`` -> ``[1, T, H, D]``."""
        if query.shape[0] != 1:
            raise UnsupportedModelError(
                f"attention: expected the packed batch as one row, got batch {query.shape[0]}"
            )
        call = _layer_call(module, query, key, value, options)
        if self.caches is None:
            self.recorded.append(call)
            return query.new_zeros(1, query.shape[2], call.num_heads, call.value_head_size)
        slot = getattr(module, SLOT_ATTRIBUTE, None)
        if slot is None or call.refusals:
            raise UnsupportedModelError(
                f"{type(module).__name__}: "
                + ("; ".join(call.refusals) or "an attention module the probe did not see")
            )
        key_cache, value_cache = self.caches[slot]
        attention = PagedAttention(
            call.num_heads,
            call.num_kv_heads,
            call.head_size,
            call.scale,
            sliding_window=call.sliding_window,
            logits_soft_cap=call.logits_soft_cap,
        )
        # transpose then reshape (not [0]): the ONNX layout rules fold these into the inverse
        # transpose and reshape of the model's own code, leaving [T, heads, D] straight from
        # the projection (attnexport.lowering.fusions)
        heads = [x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3]) for x in (query, key, value)]
        # Key and value heads of different sizes (MLA: DeepSeek-V3's 192 and 128) share one
        # cache head size: the smaller ones padded with zeros, which add nothing to a query-key
        # product (the scale is the layer's own) and give output columns that are cut off, as
        # transformers' flash-attention path does for these models.
        heads = [_padded(x, call.head_size) for x in heads]
        out = attention(*heads, key_cache, value_cache, self.metadata, _sinks(options))
        out = out.reshape(1, -1, call.num_heads, call.head_size)
        return out[..., : call.value_head_size] if call.value_head_size < call.head_size else out


def _sinks(options: dict) -> torch.Tensor | None:
    """The layer's attention sinks ``[H]`` (GPT-OSS hands them to its attention function as
    ``s_aux``), or None."""
    sinks = options.get("s_aux")
    return options.get("sinks") if sinks is None else sinks


def _padded(heads: torch.Tensor, size: int) -> torch.Tensor:
    """``heads [T, H, d]`` with zero columns up to ``[T, H, size]``."""
    missing = size - heads.shape[-1]
    return torch.nn.functional.pad(heads, (0, missing)) if missing else heads


def _layer_call(module, query, key, value, options: dict) -> LayerCall:
    refusals = [
        f"{name}: {why}"
        for name, why in _UNSUPPORTED_ARGUMENTS.items()
        if options.get(name) is not None
    ]
    if options.get("attention_mask") is not None:
        refusals.append(
            "attention_mask: the model builds a mask of its own (a bias or a pattern on the "
            "scores, which the paged ops would not apply)"
        )
    if options.get("is_causal", getattr(module, "is_causal", True)) is False:
        refusals.append("is_causal=False: bidirectional attention (an encoder layer)")
    if key.shape[-1] != query.shape[-1]:
        refusals.append(f"query head size {query.shape[-1]} != key head size {key.shape[-1]}")
    if query.shape[1] % key.shape[1]:
        refusals.append(f"{key.shape[1]} KV heads do not divide {query.shape[1]} query heads")
    scaling = options.get("scaling")
    if scaling is None:
        scaling = getattr(module, "scaling", None) or query.shape[-1] ** -0.5
    window = options.get("sliding_window")
    cap = options.get("softcap")
    return LayerCall(
        module=module,
        num_heads=int(query.shape[1]),
        num_kv_heads=int(key.shape[1]),
        head_size=max(int(key.shape[-1]), int(value.shape[-1])),
        value_head_size=int(value.shape[-1]),
        dtype=query.dtype,
        scale=float(scaling),
        sliding_window=int(window) if window else -1,
        logits_soft_cap=float(cap) if cap else 0.0,
        refusals=tuple(refusals),
    )


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``[1, H, T, D]`` heads in, ``([1, T, H, D],
    None)`` out (no attention weights). ``attention_mask`` is None (no mask is built): a
    model that builds one itself (Doge's learned per-key bias) is refused, as the paged ops
    would not apply it. The step is the one :func:`stepping` set."""
    step = _ACTIVE_STEP.get()
    if step is None:
        raise UnsupportedModelError(
            f"{type(module).__name__}: called outside a forward of the transformers path "
            "(no paged step given)"
        )
    return step.attend(
        module, query, key, value, {**kwargs, "attention_mask": attention_mask}
    ), None


@contextlib.contextmanager
def stepping(step: PagedStep) -> Iterator[None]:
    """``step`` for every attention call of the model forward run inside. A context variable,
    not a model keyword argument: some decoder layers drop those before their attention
    (StableLM's, Nemotron's). Read while torch.export traces, it leaves nothing in the graph."""
    token = _ACTIVE_STEP.set(step)
    try:
        yield
    finally:
        _ACTIVE_STEP.reset(token)


def register_attention() -> None:
    """Registers :func:`paged_attention_forward` as ``ATTENTION`` with transformers (once;
    registering again replaces it with itself)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, paged_attention_forward)
