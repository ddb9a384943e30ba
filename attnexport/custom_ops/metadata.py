"""Per-step attention metadata, shared by models and the runtime.

A scheduler decides, for every running sequence, how many tokens are already cached and how
many are computed this step, and which physical blocks hold them. :func:`build_attention_metadata`
turns that into the tensors the ops take, once per step; every layer reuses them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np
import torch


@dataclass(frozen=True)
class ScheduledSequence:
    """One sequence's part of a step."""

    num_cached_tokens: int
    """Tokens of this sequence already in the cache (context)."""
    num_new_tokens: int
    """Tokens computed this step; they sit right after the cached ones."""
    block_ids: Sequence[int]
    """Physical blocks of the sequence in order; they must cover cached + new tokens."""
    encoder_len: int = 0
    """Encoder-decoder models: length of the encoder output this sequence cross-attends to."""
    encoder_block_ids: Sequence[int] = ()
    """Blocks of the cross-attention cache holding the encoder keys/values."""
    encode_now: bool = False
    """The encoder runs for this sequence in this step (its cross cache is written now)."""


@dataclass
class AttentionMetadata:
    """Tensors and host facts describing one batch. S sequences, T new tokens.

    Decoder self-attention uses ``slot_mapping``, ``block_tables``, ``seq_lens`` and
    ``query_start_loc``. Encoder-decoder models also use the encoder/cross fields: the encoder
    runs (``varlen_attention`` over ``encoder_start_loc``) for the sequences encoded this step,
    its keys/values are written to the cross cache at ``cross_slot_mapping``, and every
    decoder token cross-attends over ``cross_block_tables``/``encoder_seq_lens`` with
    ``causal=False``.
    """

    slot_mapping: torch.Tensor
    """(T,) int64, the cache slot of each new token (negative: padding, not written)."""
    block_tables: torch.Tensor
    """(S, max_blocks_per_seq) int32, the blocks of each sequence; unused entries are 0."""
    seq_lens: torch.Tensor
    """(S,) int32, cached + new tokens of each sequence."""
    query_start_loc: torch.Tensor
    """(S + 1,) int32, start of each sequence's new tokens in the packed batch."""
    max_query_len: int
    max_seq_len: int
    num_prefills: int
    """Sequences with more than one new token or no cached context (listed in any order)."""
    num_prefill_tokens: int
    num_decode_tokens: int
    """Sequences with exactly one new token after cached context (one token each)."""

    encoder_seq_lens: torch.Tensor | None = None
    """(S,) int32, encoder length of each sequence (cross-attention KV length)."""
    encoder_start_loc: torch.Tensor | None = None
    """(S + 1,) int32, start of each sequence's encoder tokens computed this step (the
    sequences not encoded now contribute zero tokens)."""
    cross_slot_mapping: torch.Tensor | None = None
    """(T_enc,) int64, cross-cache slot of each encoder token computed this step."""
    cross_block_tables: torch.Tensor | None = None
    """(S, max_cross_blocks) int32, the cross-cache blocks of each sequence."""
    max_encoder_seq_len: int = 0

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    @property
    def is_encoder_decoder(self) -> bool:
        return self.encoder_seq_lens is not None

    def to(self, device: torch.device | str) -> AttentionMetadata:
        """A copy with every tensor moved to ``device``."""
        values = {}
        for f in fields(self):
            value = getattr(self, f.name)
            values[f.name] = value.to(device) if isinstance(value, torch.Tensor) else value
        return AttentionMetadata(**values)


def _cumulative(counts: list[int]) -> list[int]:
    offsets = [0]
    for count in counts:
        offsets.append(offsets[-1] + count)
    return offsets


def _slots(block_ids: Sequence[int], start: int, stop: int, block_size: int) -> list[int]:
    return [
        block_ids[pos // block_size] * block_size + pos % block_size for pos in range(start, stop)
    ]


_NUMPY_DTYPES = {torch.int32: np.int32, torch.int64: np.int64}


def index_tensor(
    values: Sequence[int] | Sequence[Sequence[int]],
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """An int32/int64 tensor of a (nested) list, built through NumPy: a fifth of the cost of
    ``torch.tensor`` on a list, and the host code runs these every step."""
    tensor = torch.from_numpy(np.array(values, dtype=_NUMPY_DTYPES[dtype]))
    return tensor if torch.device(device).type == "cpu" else tensor.to(device)


def _block_table(rows: list[Sequence[int]], device: torch.device | str) -> torch.Tensor:
    width = max(max((len(r) for r in rows), default=0), 1)
    # One conversion of padded rows: a per-row copy costs a tensor per sequence every step.
    padded = [[*row, *([0] * (width - len(row)))] for row in rows]
    return index_tensor(padded, torch.int32, device).view(len(rows), width)


def build_attention_metadata(
    sequences: Sequence[ScheduledSequence],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Builds the step's metadata from per-sequence state, in the given order.

    Raises ValueError if a sequence's blocks do not cover its tokens.
    """
    if block_size <= 0:
        raise ValueError(f"block_size: expected a positive integer, got {block_size}")
    slots: list[int] = []
    seq_lens, query_lens = [], []
    for i, seq in enumerate(sequences):
        if seq.num_cached_tokens < 0 or seq.num_new_tokens < 0:
            raise ValueError(
                f"sequences[{i}]: expected non-negative token counts, got "
                f"{seq.num_cached_tokens} cached and {seq.num_new_tokens} new"
            )
        total = seq.num_cached_tokens + seq.num_new_tokens
        if len(seq.block_ids) * block_size < total:
            raise ValueError(
                f"sequences[{i}]: {len(seq.block_ids)} blocks of {block_size} tokens cannot hold "
                f"{total} tokens; expected at least {-(-total // block_size)} blocks"
            )
        slots += _slots(seq.block_ids, seq.num_cached_tokens, total, block_size)
        seq_lens.append(total)
        query_lens.append(seq.num_new_tokens)

    is_decode = [s.num_new_tokens == 1 and s.num_cached_tokens > 0 for s in sequences]
    metadata = AttentionMetadata(
        slot_mapping=index_tensor(slots, torch.int64, device),
        block_tables=_block_table([s.block_ids for s in sequences], device),
        seq_lens=index_tensor(seq_lens, torch.int32, device),
        query_start_loc=index_tensor(_cumulative(query_lens), torch.int32, device),
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
        num_prefills=is_decode.count(False),
        num_prefill_tokens=sum(n for n, d in zip(query_lens, is_decode, strict=True) if not d),
        num_decode_tokens=is_decode.count(True),
    )
    if not any(s.encoder_len or s.encode_now for s in sequences):
        return metadata

    cross_slots: list[int] = []
    encoded_now = []
    for i, seq in enumerate(sequences):
        if len(seq.encoder_block_ids) * block_size < seq.encoder_len:
            raise ValueError(
                f"sequences[{i}]: {len(seq.encoder_block_ids)} cross blocks of {block_size} "
                f"tokens cannot hold an encoder output of {seq.encoder_len} tokens"
            )
        count = seq.encoder_len if seq.encode_now else 0
        cross_slots += _slots(seq.encoder_block_ids, 0, count, block_size)
        encoded_now.append(count)
    encoder_lens = [s.encoder_len for s in sequences]
    metadata.encoder_seq_lens = index_tensor(encoder_lens, torch.int32, device)
    metadata.encoder_start_loc = index_tensor(_cumulative(encoded_now), torch.int32, device)
    metadata.cross_slot_mapping = index_tensor(cross_slots, torch.int64, device)
    metadata.cross_block_tables = _block_table([s.encoder_block_ids for s in sequences], device)
    metadata.max_encoder_seq_len = max(encoder_lens, default=0)
    return metadata
