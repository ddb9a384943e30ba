"""The model inputs of one step, built from the scheduler's batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnexport.custom_ops.metadata import (
    AttentionMetadata,
    ScheduledSequence,
    build_attention_metadata,
)
from attnexport.runtime.scheduler import ScheduledBatch


@dataclass
class ModelInput:
    """Everything a decoder forward takes except the caches (see ``model_interface``)."""

    input_ids: torch.Tensor
    """(T,) int64, the new tokens of every scheduled sequence, packed in batch order."""
    positions: torch.Tensor
    """(T,) int64, absolute position of each token in its sequence."""
    logits_indices: torch.Tensor
    """(N,) int64, the last new token of each sequence that samples this step (a sequence in
    the middle of a chunked prefill does not). When none samples, one dummy row is asked for so
    that no executor sees an empty output."""
    metadata: AttentionMetadata
    sampling_seqs: list[int]
    """For each logits row, the batch index of its sequence (empty when the row is a dummy)."""

    def forward_args(self, kv_caches: list[torch.Tensor]) -> tuple:
        """The positional arguments of a decoder forward, caches last."""
        md = self.metadata
        return (
            self.input_ids,
            self.positions,
            md.slot_mapping,
            md.block_tables,
            md.seq_lens,
            md.query_start_loc,
            self.logits_indices,
            kv_caches,
        )

    def to(self, device: torch.device | str) -> ModelInput:
        return ModelInput(
            self.input_ids.to(device),
            self.positions.to(device),
            self.logits_indices.to(device),
            self.metadata.to(device),
            self.sampling_seqs,
        )


def build_model_input(batch: ScheduledBatch, block_size: int) -> ModelInput:
    """The inputs of ``batch`` on the CPU. Sequence i computes its tokens
    ``[num_computed, num_computed + num_new_tokens[i])``."""
    tokens: list[int] = []
    positions: list[int] = []
    scheduled = []
    logits_indices, sampling_seqs = [], []
    for i, (seq, count) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True)):
        start, stop = seq.num_computed, seq.num_computed + count
        tokens += seq.token_ids[start:stop]
        positions += range(start, stop)
        if stop == len(seq.token_ids):
            logits_indices.append(len(tokens) - 1)
            sampling_seqs.append(i)
        scheduled.append(ScheduledSequence(start, count, seq.block_ids))
    if not logits_indices:
        logits_indices.append(len(tokens) - 1)
    return ModelInput(
        input_ids=torch.tensor(tokens, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        logits_indices=torch.tensor(logits_indices, dtype=torch.int64),
        metadata=build_attention_metadata(scheduled, block_size),
        sampling_seqs=sampling_seqs,
    )
