"""The torch side of a step's inputs: the tensors a torch forward takes, made from the host
arrays of a :class:`~attnexport.runtime.model_input.ModelInput` (the serving core packs steps
without torch; the torch executor and the parity driver build these)."""

from __future__ import annotations

import torch

from attnexport.custom_ops.metadata import AttentionMetadata, metadata_from_arrays
from attnexport.runtime.model_input import TOKEN_DTYPES, ModelInput


class StepTensors:
    """The forward's non-cache arguments of one step as tensors on ``device`` (on the CPU they
    share the memory of ``model_input.arrays``).

    Attributes:
        input_ids, positions: (T,) int64.
        logits_indices: (N,) int64.
        encoder_input_ids, encoder_positions: (T_enc,) int64 (encoder-decoder steps; else
            None).
        metadata: the step's :class:`AttentionMetadata`.
    """

    def __init__(self, model_input: ModelInput, device: torch.device | str = "cpu") -> None:
        arrays = model_input.arrays
        on_cpu = device == "cpu" or torch.device(device).type == "cpu"
        tensors = {}
        for name in TOKEN_DTYPES:
            if name in arrays:
                tensor = torch.from_numpy(arrays[name])
                tensors[name] = tensor if on_cpu else tensor.to(device)
        self.input_names = model_input.input_names
        self.input_ids: torch.Tensor = tensors["input_ids"]
        self.positions: torch.Tensor = tensors["positions"]
        self.logits_indices: torch.Tensor = tensors["logits_indices"]
        self.encoder_input_ids: torch.Tensor | None = tensors.get("encoder_input_ids")
        self.encoder_positions: torch.Tensor | None = tensors.get("encoder_positions")
        self.metadata: AttentionMetadata = metadata_from_arrays(arrays, device)

    def index_args(self) -> tuple[torch.Tensor, ...]:
        """The forward's arguments before the caches (named by ``input_names``)."""
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
