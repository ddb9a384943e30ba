"""Per-step attention metadata, shared by models and the runtime.

A scheduler decides, for every running sequence, how many tokens are already cached and how
many are computed this step, and which physical blocks hold them. :func:`build_attention_metadata`
turns that into the tensors the ops take, once per step; every layer reuses them. The host
lists and arrays they are made from (torch-free, the serving core packs its steps with them)
live in :mod:`attnexport.paged_inputs`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

import numpy as np
import torch

from attnexport.paged_inputs import ScheduledSequence, index_arrays


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


def _is_cpu(device: torch.device | str) -> bool:
    # The string check first: parsing a torch.device costs more than building a small tensor.
    return device == "cpu" or torch.device(device).type == "cpu"


def metadata_from_arrays(
    arrays: Mapping[str, np.ndarray], device: torch.device | str = "cpu"
) -> AttentionMetadata:
    """The metadata of the arrays of the inputs of :func:`attention_lists` (and of
    :func:`cross_attention_lists` for an encoder-decoder batch), as tensors on ``device`` that
    share the arrays' memory on the CPU, with the host facts derived from them."""
    seq_lens = arrays["seq_lens"]
    query_lens = np.diff(arrays["query_start_loc"])
    is_decode = (query_lens == 1) & (seq_lens > 1)

    def tensor(name: str) -> torch.Tensor:
        value = torch.from_numpy(arrays[name])
        return value if _is_cpu(device) else value.to(device)

    metadata = AttentionMetadata(
        slot_mapping=tensor("slot_mapping"),
        block_tables=tensor("block_tables"),
        seq_lens=tensor("seq_lens"),
        query_start_loc=tensor("query_start_loc"),
        max_query_len=_max(query_lens),
        max_seq_len=_max(seq_lens),
        num_prefills=int((~is_decode).sum()),
        num_prefill_tokens=int(query_lens[~is_decode].sum()),
        num_decode_tokens=int(is_decode.sum()),
    )
    if "encoder_seq_lens" in arrays:
        metadata.encoder_seq_lens = tensor("encoder_seq_lens")
        metadata.encoder_start_loc = tensor("encoder_start_loc")
        metadata.cross_slot_mapping = tensor("cross_slot_mapping")
        metadata.cross_block_tables = tensor("cross_block_tables")
        metadata.max_encoder_seq_len = _max(arrays["encoder_seq_lens"])
    return metadata


def _max(values: np.ndarray) -> int:
    return int(values.max()) if values.size else 0


def build_attention_metadata(
    sequences: Sequence[ScheduledSequence],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Builds the step's metadata from per-sequence state, in the given order.

    Raises ValueError if a sequence's blocks do not cover its tokens.
    """
    return metadata_from_arrays(index_arrays(sequences, block_size), device)
