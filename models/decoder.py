"""The decoder-only forward convention (``attnexport.model_interface``), shared by every
causal LM of the zoo. An architecture implements :meth:`DecoderModel.hidden_states` and
:meth:`DecoderModel.lm_logits`; this class provides forward, the cache spec and the export
sample. The transformers path (``attnexport.models.generic``) overrides
:meth:`DecoderModel.step_logits` instead: one forward convention for both."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from attnexport.model_interface import DECODER_INPUT_NAMES, CacheSpec
from attnexport.models.base import (
    SAMPLE_LOGITS_INDICES,
    ExportSample,
    PagedModel,
    SampleBatch,
    check_kv_caches,
    decoder_dims,
    layer_caches,
    sample_batch,
)
from attnexport.models.layers import PagedMetadata


class DecoderModel(PagedModel):
    """A causal LM over the paged KV cache."""

    kind = "decoder"

    # Set by each architecture from its config.
    num_layers: int
    num_kv_heads: int
    head_size: int
    vocab_size: int
    lm_head: nn.Linear | None

    def set_lm_head(self, hidden_size: int, vocab_size: int, tied: bool) -> None:
        """An untied ``lm_head`` (HF name ``lm_head.weight``), or none when the output
        projection is the input embedding matrix (a tied checkpoint may still store it)."""
        self.vocab_size = vocab_size
        self.lm_head = None if tied else nn.Linear(hidden_size, vocab_size, bias=False)
        if tied:
            self.ignored_hf_weights = (*self.ignored_hf_weights, "lm_head.weight")

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        logits_indices: torch.Tensor,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        """One step of a packed ragged batch (see ``attnexport.model_interface``).

        Args:
            input_ids: ``[T]`` int64 new tokens. positions: ``[T]`` int64 absolute positions.
            slot_mapping: ``[T]`` int64 cache slots. block_tables: ``[S, max_blocks]`` int32.
            seq_lens: ``[S]`` int32 cached + new tokens. query_start_loc: ``[S + 1]`` int32.
            logits_indices: ``[N]`` int64 rows of the batch whose logits are returned.
            kv_caches: ``2 * num_layers`` tensors ``[num_blocks, block_size, Hkv, D]`` of the
                cache dtype (the model's by default), written in place; int8 caches: 4 per
                layer, with their scale caches (``attnexport.model_interface``).

        Returns:
            ``[N, vocab_size]`` float32 logits.
        """
        check_kv_caches(kv_caches, 2 * self.num_layers)
        metadata = PagedMetadata(slot_mapping, block_tables, seq_lens, query_start_loc)
        return self.step_logits(input_ids, positions, metadata, kv_caches, logits_indices).float()

    def step_logits(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: PagedMetadata,
        kv_caches: list[torch.Tensor],
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """``[N, vocab_size]`` logits of the ``logits_indices`` rows, in any float dtype: the
        zoo's :meth:`hidden_states` then :meth:`lm_logits` (the transformers path runs its
        model instead)."""
        hidden = self.hidden_states(input_ids, positions, metadata, kv_caches)
        return self.lm_logits(hidden.index_select(0, logits_indices))

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: PagedMetadata,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        """``[T, hidden]`` final hidden states (after the final norm) of the new tokens."""
        raise NotImplementedError

    def input_embeddings(self) -> nn.Embedding:
        """The token embedding (the output projection of tied models)."""
        raise NotImplementedError

    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` -> ``[N, vocab_size]`` in the model dtype."""
        head = self.lm_head if self.lm_head is not None else self.input_embeddings()
        return F.linear(hidden, head.weight)

    def cache_spec(
        self, block_size: int = 16, kv_cache_dtype: torch.dtype | None = None
    ) -> CacheSpec:
        return CacheSpec(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            dtype=kv_cache_dtype or self.dtype,
            block_size=block_size,
        )

    def export_sample(
        self, block_size: int = 16, kv_cache_dtype: torch.dtype | None = None
    ) -> ExportSample:
        sample = sample_batch(block_size)
        device = next(self.parameters()).device
        args = decoder_sample_args(sample, self.vocab_size)
        spec = self.cache_spec(block_size, kv_cache_dtype)
        caches = spec.allocate(sample.num_blocks, device)
        dims = decoder_dims()
        dynamic_shapes = (
            *decoder_dynamic_shapes(dims),
            [{0: dims["num_blocks"]}] * spec.num_cache_tensors,
        )
        return ExportSample(
            (*(a.to(device) for a in args), caches),
            dynamic_shapes,
            (*DECODER_INPUT_NAMES, "kv_caches"),
        )


class TransformerBlocksDecoder(DecoderModel):
    """A decoder laid out as GPT-2 and BLOOM are: a ``transformer`` module of blocks ``h``
    (each ``block(x, key_cache, value_cache, metadata)``) and a final norm ``ln_f``, whose
    checkpoints may omit the ``transformer.`` prefix (the original uploads). A subclass builds
    ``self.transformer`` and embeds the tokens (:meth:`embed`)."""

    transformer: nn.Module

    def hf_weight_names(self, name: str) -> tuple[str, ...]:
        return (name, name.removeprefix("transformer."))

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` input of the first block."""
        raise NotImplementedError

    def hidden_states(self, input_ids, positions, metadata, kv_caches) -> torch.Tensor:
        x = self.embed(input_ids, positions)
        for block, (key_cache, value_cache) in zip(
            self.transformer.h, layer_caches(kv_caches), strict=True
        ):
            x = block(x, key_cache, value_cache, metadata)
        return self.transformer.ln_f(x)


def decoder_sample_args(sample: SampleBatch, vocab_size: int) -> tuple[torch.Tensor, ...]:
    """The sample values of the DECODER_INPUT_NAMES inputs (on the CPU)."""
    metadata = sample.metadata
    return (
        torch.arange(metadata.num_tokens, dtype=torch.int64) % vocab_size,
        sample.positions,
        metadata.slot_mapping,
        metadata.block_tables,
        metadata.seq_lens,
        metadata.query_start_loc,
        torch.tensor(SAMPLE_LOGITS_INDICES, dtype=torch.int64),
    )


def decoder_dynamic_shapes(dims: dict) -> tuple[dict, ...]:
    """The dynamic shapes of the DECODER_INPUT_NAMES inputs."""
    tokens, seqs = {0: dims["num_tokens"]}, dims["num_seqs"]
    return (
        tokens,
        tokens,
        tokens,
        {0: seqs, 1: dims["max_blocks_per_seq"]},
        {0: seqs},
        {0: seqs + 1},
        {0: dims["num_logits"]},
    )
