"""The index inputs of a paged forward (``model_interface``) as host lists and NumPy arrays.

A scheduler decides, for every running sequence, how many tokens are already cached, how many
are computed this step, and which physical blocks hold them (:class:`ScheduledSequence`).
:func:`attention_lists` and :func:`cross_attention_lists` turn that into the attention inputs
as lists of ints, :func:`to_array` into arrays. This module imports neither torch nor the ops:
the serving core packs its steps with it, and ``attnexport.custom_ops.metadata`` builds the
torch tensors of ``AttentionMetadata`` from its arrays.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


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


def _cumulative(counts: Sequence[int]) -> list[int]:
    offsets = [0]
    for count in counts:
        offsets.append(offsets[-1] + count)
    return offsets


def _slots(block_ids: Sequence[int], start: int, stop: int, block_size: int) -> list[int]:
    return [
        block_ids[pos // block_size] * block_size + pos % block_size for pos in range(start, stop)
    ]


INDEX_DTYPES = {
    "slot_mapping": np.int64,
    "block_tables": np.int32,
    "seq_lens": np.int32,
    "query_start_loc": np.int32,
    "encoder_start_loc": np.int32,
    "cross_slot_mapping": np.int64,
    "cross_block_tables": np.int32,
    "encoder_seq_lens": np.int32,
}
"""The dtype of each attention input (the names of :func:`attention_lists` and
:func:`cross_attention_lists`)."""

MAX_SEQUENCE_LENGTH = 2**31 - 1
"""The longest sequence the inputs can describe: ``seq_lens`` and ``query_start_loc`` are
int32."""

BLOCK_TABLES = ("block_tables", "cross_block_tables")
"""The two-dimensional inputs: lists of rows of one width."""


def list_shape(name: str, values: list) -> tuple[int, ...]:
    """The array shape of input ``name`` given as ``values`` (a list, or rows for a block
    table: ``(0, 1)`` when there are none)."""
    if name in BLOCK_TABLES:
        return (len(values), len(values[0]) if values else 1)
    return (len(values),)


def to_array(name: str, values: list, dtype: type[np.integer]) -> np.ndarray:
    """Input ``name`` given as a (nested) list, as a NumPy array of ``dtype`` and the shape of
    :func:`list_shape` (one conversion of the whole list: a fifth of the cost of
    ``torch.tensor`` on it, and the host code runs these every step)."""
    return np.array(values, dtype=dtype).reshape(list_shape(name, values))


def _pad(rows: list[list[int]], width: int) -> list[list[int]]:
    """``rows``, each zero-padded in place to ``width`` (at least 1)."""
    width = max(width, 1)
    for row in rows:
        if len(row) < width:
            row += [0] * (width - len(row))
    return rows


def _check_block_size(block_size: int) -> None:
    if block_size <= 0:
        raise ValueError(f"block_size: expected a positive integer, got {block_size}")


def attention_lists(
    num_cached: Sequence[int],
    num_new: Sequence[int],
    block_ids: Sequence[Sequence[int]],
    block_size: int,
) -> dict[str, list]:
    """The decoder self-attention inputs of a batch of S sequences (sequence i computes its
    tokens ``[num_cached[i], num_cached[i] + num_new[i])`` into its blocks ``block_ids[i]``), as
    lists named like the forward's inputs: ``slot_mapping`` (T ints), ``block_tables`` (S rows
    zero-padded to the most blocks, at least 1), ``seq_lens`` (S) and ``query_start_loc``
    (S + 1). Nothing refers to the given lists (the rows are copies).

    Raises ValueError if a count is negative or a sequence's blocks do not cover its tokens.
    """
    _check_block_size(block_size)
    slots: list[int] = []
    seq_lens: list[int] = []
    starts = [0]
    rows: list[list[int]] = []
    width = 0
    for i, (cached, new, blocks) in enumerate(zip(num_cached, num_new, block_ids, strict=True)):
        if cached < 0 or new < 0:
            raise ValueError(
                f"sequences[{i}]: expected non-negative token counts, got "
                f"{cached} cached and {new} new"
            )
        total, num_blocks = cached + new, len(blocks)
        if num_blocks * block_size < total:
            raise ValueError(
                f"sequences[{i}]: {num_blocks} blocks of {block_size} tokens cannot hold "
                f"{total} tokens; expected at least {-(-total // block_size)} blocks"
            )
        if new == 1:  # a decode: no list of one slot to build
            slots.append(blocks[cached // block_size] * block_size + cached % block_size)
        else:
            slots += _slots(blocks, cached, total, block_size)
        seq_lens.append(total)
        starts.append(starts[-1] + new)
        rows.append(list(blocks))  # a copy: the caller's lists grow in later steps
        if num_blocks > width:
            width = num_blocks
    return {
        "slot_mapping": slots,
        "block_tables": _pad(rows, width),
        "seq_lens": seq_lens,
        "query_start_loc": starts,
    }


def cross_attention_lists(
    sequences: Sequence[ScheduledSequence], block_size: int
) -> dict[str, list]:
    """The encoder/cross-attention inputs of an encoder-decoder batch, as lists named like the
    forward's inputs: ``encoder_start_loc`` (S + 1 ints), ``cross_slot_mapping`` (T_enc),
    ``cross_block_tables`` (S rows zero-padded to the most cross blocks, at least 1) and
    ``encoder_seq_lens`` (S).

    Raises ValueError if a sequence's cross blocks do not cover its encoder output.
    """
    _check_block_size(block_size)
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
    tables = [s.encoder_block_ids for s in sequences]
    return {
        "encoder_start_loc": _cumulative(encoded_now),
        "cross_slot_mapping": cross_slots,
        "cross_block_tables": _pad([list(t) for t in tables], max(map(len, tables), default=0)),
        "encoder_seq_lens": [s.encoder_len for s in sequences],
    }


def is_encoder_decoder_batch(sequences: Sequence[ScheduledSequence]) -> bool:
    """Some sequence has an encoder: the batch takes the encoder/cross-attention inputs."""
    return any(s.encoder_len or s.encode_now for s in sequences)


def index_arrays(sequences: Sequence[ScheduledSequence], block_size: int) -> dict[str, np.ndarray]:
    """The attention inputs of the sequences, in the given order, as arrays:
    :func:`attention_lists`, and :func:`cross_attention_lists` for an encoder-decoder batch.

    Raises ValueError if a sequence's blocks do not cover its tokens.
    """
    values = attention_lists(
        [s.num_cached_tokens for s in sequences],
        [s.num_new_tokens for s in sequences],
        [s.block_ids for s in sequences],
        block_size,
    )
    if is_encoder_decoder_batch(sequences):
        values.update(cross_attention_lists(sequences, block_size))
    return {name: to_array(name, value, INDEX_DTYPES[name]) for name, value in values.items()}
