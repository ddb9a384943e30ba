"""The model inputs of one step: one packing of per-sequence work into the forward's inputs,
shared by the engine (from the scheduler's batch) and the step driver (parity checks).

The inputs are built on the host as lists of ints: an onnxruntime executor copies them into the
buffers it binds, and the NumPy arrays are made from them only when asked for. This module
imports no torch: the torch tensors of a step are :class:`attnexport.runtime.torch_inputs.
StepTensors`, made by the torch side."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from attnexport.model_interface import DECODER_INPUT_NAMES, ENCODER_DECODER_INPUT_NAMES
from attnexport.paged_inputs import (
    INDEX_DTYPES,
    ScheduledSequence,
    attention_lists,
    cross_attention_lists,
    is_encoder_decoder_batch,
    list_shape,
    to_array,
)


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


TOKEN_DTYPES = {
    "input_ids": np.int64,
    "positions": np.int64,
    "logits_indices": np.int64,
    "encoder_input_ids": np.int64,
    "encoder_positions": np.int64,
}
"""The dtype of each input that is not attention metadata."""

INPUT_DTYPES = {**INDEX_DTYPES, **TOKEN_DTYPES}
"""The dtype of each forward input (before the caches)."""


class ModelInput:
    """Everything a paged forward takes except the caches (see ``model_interface``), on the
    host: lists of ints (:attr:`values`), and the NumPy arrays of them made on first use.

    ``input_ids`` (T,) are the new tokens of every scheduled sequence, packed in batch order;
    ``positions`` (T,) the absolute position of each; ``logits_indices`` (N,) the rows whose
    logits are returned: by default the last new token of each sequence that samples this step
    (a sequence in the middle of a chunked prefill does not). When none is wanted, one dummy
    row is asked for so that no executor sees an empty output.

    Args:
        values: the inputs by forward input name (:attr:`input_names`): lists of ints, rows of
            one width for a block table.
        sampling_seqs: for each logits row, the batch index of its sequence.
        sample_rows: the logits rows that sample, when not all do (a sequence that scores
            its prompt asks for the rows of every prompt token).
    """

    def __init__(
        self,
        values: dict[str, list],
        sampling_seqs: list[int],
        sample_rows: list[int] | None = None,
    ) -> None:
        self.values = values
        """The inputs by name, as lists (never changed after packing)."""
        self.sampling_seqs = sampling_seqs
        """For each logits row, the batch index of its sequence (empty when the row is a dummy
        asked for because no sequence samples)."""
        self.sample_rows = sample_rows
        """The logits rows a token is sampled from, in order; None when every row is one."""
        self.shapes = {name: list_shape(name, value) for name, value in values.items()}
        """The array shape of each input: what an executor binds."""
        self._arrays: dict[str, np.ndarray] | None = None

    @property
    def arrays(self) -> dict[str, np.ndarray]:
        """The inputs as NumPy arrays (int64 token ids, positions, slots and logits rows;
        int32 block tables, lengths and offsets), made once."""
        if self._arrays is None:
            self._arrays = {
                name: to_array(name, value, INPUT_DTYPES[name])
                for name, value in self.values.items()
            }
        return self._arrays

    @property
    def is_encoder_decoder(self) -> bool:
        return "encoder_seq_lens" in self.values

    @property
    def num_logits(self) -> int:
        """N, the logits rows the forward returns."""
        return len(self.values["logits_indices"])

    def check_rows(self, vocab_size: int, max_model_len: int | None = None) -> None:
        """Raises ValueError naming the input unless every token id is in ``[0, vocab_size)``,
        every position in ``[0, max_model_len)`` (``[0, inf)`` when None) and every logits row
        indexes one of the T new tokens.

        The model indexes tables with these (embedding and rotary lookups, a row gather): torch
        raises a bare IndexError on a large id and wraps a negative one, and onnxruntime's
        Gather wraps negative ids too (another row, silently). An executor checks them on the
        host before running, where they are lists already: a min and a max of each, about a
        microsecond for a decode step, which is cheaper than guard nodes in the graph."""
        values = self.values
        bounds = [
            ("input_ids", vocab_size, "vocab_size"),
            ("positions", max_model_len, "max_model_len"),
            ("logits_indices", len(values["input_ids"]), "T, the new tokens"),
        ]
        if "encoder_input_ids" in values:
            bounds += [
                ("encoder_input_ids", vocab_size, "vocab_size"),
                ("encoder_positions", None, ""),  # the encoder's own limit is the model's
            ]
        for name, limit, limit_name in bounds:
            column = values[name]
            if not column:
                continue
            low, high = min(column), max(column)
            if low < 0 or (limit is not None and high >= limit):
                raise ValueError(
                    f"{name}: {low if low < 0 else high} is out of range; expected values in "
                    f"[0, {limit if limit is not None else 'inf'})"
                    + (f" ({limit_name})" if limit is not None else "")
                )

    @property
    def input_names(self) -> tuple[str, ...]:
        """The names of the inputs, in the forward's order."""
        if self.is_encoder_decoder:
            return ENCODER_DECODER_INPUT_NAMES
        return DECODER_INPUT_NAMES


def pack_decoder_step(
    num_cached: Sequence[int],
    num_new: Sequence[int],
    block_ids: Sequence[Sequence[int]],
    token_ids: Sequence[Sequence[int]],
    num_logits: Sequence[int],
    block_size: int,
    samples: Sequence[bool] | None = None,
) -> ModelInput:
    """The decoder inputs of one step, sequences in the given order: sequence i computes its
    tokens ``[num_cached[i], num_cached[i] + num_new[i])`` of ``token_ids[i]`` into its blocks
    ``block_ids[i]`` and asks for ``num_logits[i]`` logits rows (0, 1 for its last new token,
    or up to ``num_new[i]`` for its last ones). With ``samples``, only the last row of a
    sequence with ``samples[i]`` samples (:attr:`ModelInput.sample_rows`); without, every row.

    Raises ValueError like :func:`attnexport.custom_ops.build_attention_metadata`.
    """
    values = attention_lists(num_cached, num_new, block_ids, block_size)
    tokens: list[int] = []
    positions: list[int] = []
    logits_indices: list[int] = []
    sampling_seqs: list[int] = []
    sample_rows: list[int] = []
    for i, (start, count, ids, rows) in enumerate(
        zip(num_cached, num_new, token_ids, num_logits, strict=True)
    ):
        stop = start + count
        tokens += ids[start:stop]
        positions += range(start, stop)
        if rows:
            rows = min(rows, count)
            logits_indices += range(len(tokens) - rows, len(tokens))
            sampling_seqs += [i] * rows
            if samples is not None and samples[i]:
                sample_rows.append(len(sampling_seqs) - 1)
    if not logits_indices:
        logits_indices.append(len(tokens) - 1)
    values["input_ids"] = tokens
    values["positions"] = positions
    values["logits_indices"] = logits_indices
    return ModelInput(values, sampling_seqs, sample_rows if samples is not None else None)


def pack_step(sequences: Sequence[StepSequence], block_size: int) -> ModelInput:
    """The inputs of one step on the CPU, sequences in the given order. Sequence i computes its
    tokens ``[num_cached, num_cached + num_new)``; an encoder-decoder batch (some sequence has an
    encoder length) also gets the encoder tokens of the sequences with ``encode_now``."""
    scheduled = [entry.scheduled for entry in sequences]
    decoder = pack_decoder_step(
        [s.num_cached_tokens for s in scheduled],
        [s.num_new_tokens for s in scheduled],
        [s.block_ids for s in scheduled],
        [entry.token_ids for entry in sequences],
        [entry.num_logits for entry in sequences],
        block_size,
    )
    if not is_encoder_decoder_batch(scheduled):
        return decoder
    encoder_ids: list[int] = []
    encoder_positions: list[int] = []
    for entry in sequences:
        if entry.scheduled.encode_now:
            encoder_ids += entry.encoder_ids
            encoder_positions += range(len(entry.encoder_ids))
    values = {
        **decoder.values,
        **cross_attention_lists(scheduled, block_size),
        "encoder_input_ids": encoder_ids,
        "encoder_positions": encoder_positions,
    }
    return ModelInput(values, decoder.sampling_seqs)
