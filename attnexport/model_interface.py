"""The calling convention shared by models, the lowering, the runtime and the CLI.

A *paged model* is an ``nn.Module`` whose forward takes one step's packed ragged batch, its
attention metadata as plain tensors, and the KV caches as explicit inputs (never buffers, so
that torch.export/ONNX keep them as graph inputs and outputs)::

    forward(
        input_ids,        # [T] int64, the new tokens of every sequence, packed
        positions,        # [T] int64, absolute position of each token in its sequence
        slot_mapping,     # [T] int64, cache slot per token (negative: padding, not written)
        block_tables,     # [S, max_blocks_per_seq] int32
        seq_lens,         # [S] int32, cached + new tokens per sequence
        query_start_loc,  # [S + 1] int32
        logits_indices,   # [N] int64, rows of the packed batch whose logits are returned
        kv_caches,        # list of 2 * num_layers tensors [k_0, v_0, k_1, v_1, ...],
                          #   each [num_blocks, block_size, num_kv_heads, head_size]
    ) -> logits           # [N, vocab_size] float32

The caches may have a dtype of their own (``KV_CACHE_DTYPES``; float16, bfloat16 or int8
under float32 activations). int8 caches come with float32 scale caches ``[num_blocks,
block_size, num_kv_heads]`` and ``kv_caches`` then holds 4 tensors per layer,
``[k_0, v_0, ks_0, vs_0, k_1, ...]`` (docs/ops.md, "KV cache dtypes").

*Encoder-decoder* models (``attnexport.models.bart``) run the encoder and the decoder in one
forward, so that one exported graph serves every step. After the decoder inputs come::

        encoder_input_ids,   # [T_enc] int64, encoder tokens of the sequences encoded in this
                             #   step, packed (T_enc may be 0: nothing to encode)
        encoder_positions,   # [T_enc] int64, position of each in its encoder sequence
        encoder_start_loc,   # [S + 1] int32, cumulative encoder tokens per sequence this step
                             #   (a sequence not encoded now contributes 0)
        cross_slot_mapping,  # [T_enc] int64, cross-cache slot of each encoder token
        cross_block_tables,  # [S, max_cross_blocks_per_seq] int32, cross-cache blocks
        encoder_seq_lens,    # [S] int32, encoder length of each sequence (cross-attended keys)
        kv_caches,           # 2 * num_layers self caches, then 2 * num_layers cross caches:
                             #   [k_0, v_0, ..., k_{L-1}, v_{L-1}, xk_0, xv_0, ..., xv_{L-1}]

The encoder runs (non-causal ``varlen_attention``) over the sequences being encoded, each
decoder layer writes their cross keys/values into its cross cache once, and every decoder
token attends over the cross cache with ``paged_attention(causal=False)``. These are the
encoder/cross fields of ``AttentionMetadata`` (``ScheduledSequence.encode_now`` marks the step
that encodes a sequence; later steps pass zero encoder tokens).

*Encoder-only* models take ``input_ids, positions, cu_seqlens, token_type_ids`` and no cache and
return hidden states ``[T, hidden]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

DECODER_INPUT_NAMES = (
    "input_ids",
    "positions",
    "slot_mapping",
    "block_tables",
    "seq_lens",
    "query_start_loc",
    "logits_indices",
)
"""The non-cache inputs of a decoder's forward, in order; ``kv_caches`` follows them."""

ENCODER_DECODER_INPUT_NAMES = (
    *DECODER_INPUT_NAMES,
    "encoder_input_ids",
    "encoder_positions",
    "encoder_start_loc",
    "cross_slot_mapping",
    "cross_block_tables",
    "encoder_seq_lens",
)
"""The non-cache inputs of an encoder-decoder forward, in order; ``kv_caches`` follows them."""

ENCODER_INPUT_NAMES = ("input_ids", "positions", "cu_seqlens", "token_type_ids")
"""The inputs of an encoder-only forward (no cache)."""

KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8")
"""The KV cache dtypes an export may choose (``--kv-cache-dtype``); ``auto``: the model's."""
SCALED_CACHE_DTYPE = "int8"
"""The cache dtype with scale caches: per layer ``kv_caches`` holds the key and value caches
then their float32 scale caches ``[num_blocks, block_size, num_kv_heads]``."""
SCALE_DTYPE = "float32"


@dataclass(frozen=True, eq=False)
class CacheSpec:
    """The geometry of a model's paged KV caches (this module imports no torch: the serving
    core reads cache specs without it)."""

    num_layers: int
    """Layers with a (self-attention) cache; there are 2 * num_layers cache tensors."""
    num_kv_heads: int
    head_size: int
    dtype: Any
    """The caches' element type: a ``torch.dtype`` (torch models and executors) or a NumPy
    dtype (the onnxruntime executor's host caches); anything with ``itemsize``. It may differ
    from the model's dtype (``--kv-cache-dtype``); ``int8`` caches come with float32 scale
    caches (:attr:`scaled`)."""
    block_size: int = 16
    num_cross_layers: int = 0
    """Encoder-decoder models: layers with a cross-attention cache (2 tensors each), after the
    self-attention caches in ``kv_caches``."""

    @property
    def dtype_name(self) -> str:
        """``dtype`` as torch and NumPy both name it: ``float32``, ``float16``, ..."""
        return str(self.dtype).removeprefix("torch.")

    def _key(self) -> tuple:
        return (
            self.num_layers,
            self.num_kv_heads,
            self.head_size,
            self.dtype_name,
            self.block_size,
            self.num_cross_layers,
        )

    def __eq__(self, other: object) -> bool:
        """Specs are equal when their geometry is: a torch and a NumPy dtype of one name
        match (the torch and the onnxruntime executor of one model have equal specs)."""
        return isinstance(other, CacheSpec) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    @property
    def scaled(self) -> bool:
        """int8 caches: each layer's key and value caches have a float32 scale cache
        ``[num_blocks, block_size, num_kv_heads]`` (the scale of each row) beside them."""
        return self.dtype_name == SCALED_CACHE_DTYPE

    @property
    def tensors_per_layer(self) -> int:
        """Cache tensors per layer: key, value (and, :attr:`scaled`, key scale, value scale)."""
        return 4 if self.scaled else 2

    @property
    def num_cache_tensors(self) -> int:
        return self.tensors_per_layer * (self.num_layers + self.num_cross_layers)

    @property
    def num_self_tensors(self) -> int:
        """The cache tensors of the self-attention layers (the first ones of ``kv_caches``)."""
        return self.tensors_per_layer * self.num_layers

    def block_shape(self) -> tuple[int, int, int]:
        return (self.block_size, self.num_kv_heads, self.head_size)

    def cache_shape(self, num_blocks: int) -> tuple[int, int, int, int]:
        """``[num_blocks, block_size, num_kv_heads, head_size]``."""
        return (num_blocks, *self.block_shape())

    def tensor_shapes(self, num_blocks: int) -> list[tuple[tuple[int, ...], str]]:
        """``(shape, dtype name)`` of each cache tensor in ``kv_caches`` order: per layer the
        key and value caches, then (int8) their scale caches ``[num_blocks, block_size,
        num_kv_heads]`` float32."""
        cache = (self.cache_shape(num_blocks), self.dtype_name)
        scale = ((num_blocks, self.block_size, self.num_kv_heads), SCALE_DTYPE)
        layer = [cache, cache, scale, scale] if self.scaled else [cache, cache]
        return layer * (self.num_layers + self.num_cross_layers)

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block takes across every cache tensor of the model (scales included)."""
        per_tensor = self.block_size * self.num_kv_heads * self.head_size * self.dtype.itemsize
        total = per_tensor * 2 * (self.num_layers + self.num_cross_layers)
        if self.scaled:
            total += (
                self.block_size
                * self.num_kv_heads
                * 4
                * 2
                * (self.num_layers + self.num_cross_layers)
            )
        return total

    def allocate(self, num_blocks: int, device: torch.device | str = "cpu") -> list[torch.Tensor]:
        """Zeroed torch caches ``[k_0, v_0, k_1, v_1, ...]`` for ``num_blocks`` blocks (of
        ``dtype``, a ``torch.dtype``); int8: ``[k_0, v_0, ks_0, vs_0, k_1, ...]`` with the
        float32 scale caches."""
        import torch  # the torch side only: reading a spec needs no torch

        return [
            torch.zeros(shape, dtype=getattr(torch, dtype), device=device)
            for shape, dtype in self.tensor_shapes(num_blocks)
        ]
