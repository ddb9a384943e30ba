"""The model inputs of one step: one packing of per-sequence work into the forward's tensors,
shared by the engine (from the scheduler's batch) and the step driver (parity checks)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from attnexport.custom_ops.metadata import (
    AttentionMetadata,
    ScheduledSequence,
    build_attention_metadata,
    index_tensor,
)
from attnexport.model_interface import DECODER_INPUT_NAMES, ENCODER_DECODER_INPUT_NAMES


@dataclass(frozen=True)
class StepSequence:
    """One sequence's part of a step, as the packer needs it."""

    scheduled: ScheduledSequence
    """Its cached/new token counts and blocks (and cross blocks of an encoder-decoder)."""
    token_ids: Sequence[int]
    """Every token of the sequence; the new ones are taken from ``scheduled``'s counts."""
    num_logits: int = 1
    """Logits rows wanted: 0 (none), 1 (the last new token) or up to ``num_new_tokens`` (the
    last ones)."""
    encoder_ids: Sequence[int] = ()
    """The encoder tokens, when ``scheduled.encode_now`` (at positions ``0 .. len - 1``)."""


@dataclass
class ModelInput:
    """Everything a paged forward takes except the caches (see ``model_interface``)."""

    input_ids: torch.Tensor
    """(T,) int64, the new tokens of every scheduled sequence, packed in batch order."""
    positions: torch.Tensor
    """(T,) int64, absolute position of each token in its sequence."""
    logits_indices: torch.Tensor
    """(N,) int64, the rows whose logits are returned: by default the last new token of each
    sequence that samples this step (a sequence in the middle of a chunked prefill does not).
    When none is wanted, one dummy row is asked for so that no executor sees an empty output."""
    metadata: AttentionMetadata
    sampling_seqs: list[int]
    """For each logits row, the batch index of its sequence (empty when the row is a dummy)."""
    encoder_input_ids: torch.Tensor | None = None
    """Encoder-decoder models: (T_enc,) int64 encoder tokens of the sequences encoded now."""
    encoder_positions: torch.Tensor | None = None
    """(T_enc,) int64, position of each in its encoder input."""

    @property
    def input_names(self) -> tuple[str, ...]:
        """Names of :meth:`index_args`, in order."""
        if self.metadata.is_encoder_decoder:
            return ENCODER_DECODER_INPUT_NAMES
        return DECODER_INPUT_NAMES

    def forward_args(self, kv_caches: list[torch.Tensor]) -> tuple:
        """The positional arguments of the forward: :meth:`index_args`, then the caches."""
        return (*self.index_args(), kv_caches)

    def index_args(self) -> tuple[torch.Tensor, ...]:
        """The forward's arguments before the caches (named by :attr:`input_names`)."""
        md = self.metadata
        args = (
            self.input_ids,
            self.positions,
            md.slot_mapping,
            md.block_tables,
            md.seq_lens,
            md.query_start_loc,
            self.logits_indices,
        )
        if md.is_encoder_decoder:
            args += (
                self.encoder_input_ids,
                self.encoder_positions,
                md.encoder_start_loc,
                md.cross_slot_mapping,
                md.cross_block_tables,
                md.encoder_seq_lens,
            )
        return args

    def to(self, device: torch.device | str) -> ModelInput:
        def move(tensor):
            return None if tensor is None else tensor.to(device)

        return ModelInput(
            self.input_ids.to(device),
            self.positions.to(device),
            self.logits_indices.to(device),
            self.metadata.to(device),
            self.sampling_seqs,
            move(self.encoder_input_ids),
            move(self.encoder_positions),
        )


def pack_step(sequences: Sequence[StepSequence], block_size: int) -> ModelInput:
    """The inputs of one step on the CPU, sequences in the given order. Sequence i computes its
    tokens ``[num_cached, num_cached + num_new)``; an encoder-decoder batch (some sequence has an
    encoder length) also gets the encoder tokens of the sequences with ``encode_now``."""
    tokens: list[int] = []
    positions: list[int] = []
    encoder_ids: list[int] = []
    encoder_positions: list[int] = []
    logits_indices: list[int] = []
    sampling_seqs: list[int] = []
    for i, entry in enumerate(sequences):
        seq = entry.scheduled
        start, stop = seq.num_cached_tokens, seq.num_cached_tokens + seq.num_new_tokens
        tokens += entry.token_ids[start:stop]
        positions += range(start, stop)
        rows = min(entry.num_logits, seq.num_new_tokens)
        logits_indices += range(len(tokens) - rows, len(tokens))
        sampling_seqs += [i] * rows
        if seq.encode_now:
            encoder_ids += entry.encoder_ids
            encoder_positions += range(len(entry.encoder_ids))
    if not logits_indices:
        logits_indices.append(len(tokens) - 1)
    metadata = build_attention_metadata([s.scheduled for s in sequences], block_size)
    encoder = metadata.is_encoder_decoder
    return ModelInput(
        input_ids=index_tensor(tokens, torch.int64),
        positions=index_tensor(positions, torch.int64),
        logits_indices=index_tensor(logits_indices, torch.int64),
        metadata=metadata,
        sampling_seqs=sampling_seqs,
        encoder_input_ids=index_tensor(encoder_ids, torch.int64) if encoder else None,
        encoder_positions=index_tensor(encoder_positions, torch.int64) if encoder else None,
    )
