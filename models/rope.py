"""Rotary position embeddings (NeoX "rotate half" style), with linear and Llama-3 scaling.

Frequencies are computed exactly as Hugging Face transformers computes them (fp32, same order
of operations), so logits match to fp32 rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from attnexport.models.errors import UnsupportedModelError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_PER_LAYER_KEYS = ("full_attention", "sliding_attention", "chunked_attention")


@dataclass(frozen=True)
class RopeConfig:
    """RoPE parameters: ``theta`` and an optional static scaling of the frequencies."""

    theta: float = 10000.0
    type: str = "default"
    """``default``, ``linear`` (frequencies / factor) or ``llama3`` (Llama 3.1 smoothing)."""
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    @classmethod
    def from_hf(cls, hf: dict) -> RopeConfig:
        """Reads ``rope_parameters`` (transformers 5) or ``rope_theta`` + ``rope_scaling``
        (older configs). Raises UnsupportedModelError for a scaling type or option that changes
        the math in a way this implementation does not reproduce."""
        params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        if not isinstance(params, dict):
            raise UnsupportedModelError(f"rope_parameters: expected an object, got {params!r}")
        if any(key in params for key in _PER_LAYER_KEYS):
            raise UnsupportedModelError(
                "rope_parameters: per-layer-type RoPE parameters are not supported"
            )
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope_scaling: unsupported rope type {rope_type!r}; supported: "
                f"{', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
        if partial is not None and float(partial) != 1.0:
            raise UnsupportedModelError(
                f"partial_rotary_factor: only 1.0 (rotate the whole head) is supported, "
                f"got {partial}"
            )
        theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
        if theta is None:
            theta = 10000.0
        fields: dict = {"theta": float(theta), "type": rope_type}
        if rope_type in ("linear", "llama3"):
            fields["factor"] = float(_required(params, "factor", rope_type))
        if rope_type == "llama3":
            fields["low_freq_factor"] = float(_required(params, "low_freq_factor", rope_type))
            fields["high_freq_factor"] = float(_required(params, "high_freq_factor", rope_type))
            original = params.get("original_max_position_embeddings")
            if original is None:
                original = hf.get("original_max_position_embeddings")
            if original is None:
                original = _required(hf, "max_position_embeddings", rope_type)
            fields["original_max_position_embeddings"] = int(original)
        return cls(**fields)

    def inv_freq(self, head_dim: int) -> torch.Tensor:
        """``[head_dim // 2]`` float32 inverse frequencies."""
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        inv_freq = 1.0 / (self.theta**exponents)
        if self.type == "linear":
            return inv_freq / self.factor
        if self.type == "llama3":
            return self._llama3(inv_freq)
        return inv_freq

    def _llama3(self, inv_freq: torch.Tensor) -> torch.Tensor:
        old_context = self.original_max_position_embeddings
        low_freq_wavelen = old_context / self.low_freq_factor
        high_freq_wavelen = old_context / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (old_context / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)


def _required(params: dict, key: str, rope_type: str):
    if params.get(key) is None:
        raise UnsupportedModelError(f"rope_scaling: type {rope_type!r} needs {key!r}")
    return params[key]


class RotaryEmbedding(nn.Module):
    """cos/sin tables for the positions of one step (``attnexport.rotary_embedding`` applies
    them to q and k).

    The inverse frequencies are kept as Python floats (exact fp32 values) and turned into a
    constant inside forward, so casting the model to bf16 never rounds them.
    """

    def __init__(self, head_dim: int, rope: RopeConfig) -> None:
        super().__init__()
        self.head_dim = head_dim
        self._inv_freq = tuple(rope.inv_freq(head_dim).tolist())

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """positions ``[T]`` int64 -> (cos, sin), each ``[T, head_dim]`` in ``dtype``: the
        tables of ``attnexport.rotary_embedding``, computed once per step for every layer."""
        inv_freq = torch.tensor(self._inv_freq, dtype=torch.float32, device=positions.device)
        freqs = positions.float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)
