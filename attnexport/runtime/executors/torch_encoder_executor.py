"""Runs an encoder (``attnexport.model_interface``'s encoder convention) in PyTorch: an eager
module, an ``ExportedProgram`` or a ``.pt2`` file; the torch side of
:mod:`attnexport.runtime.embedding`."""

from __future__ import annotations

import os

import numpy as np
import torch

from attnexport.artifact import load_pt2
from attnexport.model_interface import ENCODER_INPUT_NAMES


class TorchEncoderExecutor:
    """An encoder forward run step by step on the CPU.

    Args:
        model: an encoder ``nn.Module`` (``forward(input_ids, positions, cu_seqlens,
            token_type_ids)``), a ``torch.export.ExportedProgram`` or a ``.pt2`` path.
        vocab_size, max_model_len: the model's limits (default: a module's config).
        trust_pickle: see :func:`attnexport.artifact.load_pt2`.
    """

    name = "torch"

    def __init__(
        self,
        model: torch.nn.Module | torch.export.ExportedProgram | str | os.PathLike,
        *,
        vocab_size: int | None = None,
        max_model_len: int | None = None,
        trust_pickle: bool = False,
    ) -> None:
        if isinstance(model, (str, os.PathLike)):
            model = load_pt2(model, trust_pickle=trust_pickle)
        if isinstance(model, torch.export.ExportedProgram):
            model = model.module()
        config = getattr(model, "config", None)
        self.vocab_size = vocab_size or getattr(config, "vocab_size", None)
        self.max_model_len = max_model_len or getattr(config, "max_position_embeddings", None)
        self.model = model

    def encode(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        args = [torch.from_numpy(np.ascontiguousarray(inputs[n])) for n in ENCODER_INPUT_NAMES]
        with torch.no_grad():
            return self.model(*args).float().numpy()
