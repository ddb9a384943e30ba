"""Rotary position embeddings (NeoX "rotate half" style), with linear, Llama-3 and LongRoPE
(Phi-3) scaling.

Frequencies are computed exactly as Hugging Face transformers computes them (fp32, same order
of operations), so logits match to fp32 rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from attnexport.models.errors import UnsupportedModelError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")
# transformers' Phi3Config reads these legacy names as longrope.
_LONGROPE_ALIASES = ("su", "yarn")
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
    partial_rotary_factor: float = 1.0
    """The fraction of each head that is rotated (its first dims); Phi-3 family only."""
    short_factor: tuple[float, ...] = ()
    """``longrope``: per-frequency divisors while a sequence is at most
    ``original_max_position_embeddings`` long."""
    long_factor: tuple[float, ...] = ()
    """``longrope``: per-frequency divisors once a sequence is longer."""
    attention_factor: float = 1.0
    """Scale of the cos/sin tables (``longrope``: from the context extension)."""

    def __post_init__(self) -> None:
        for name in ("short_factor", "long_factor"):  # lists from JSON compare as tuples
            object.__setattr__(self, name, tuple(getattr(self, name)))

    @classmethod
    def from_hf(
        cls,
        hf: dict,
        *,
        params: dict | None = None,
        allowed_types: tuple[str, ...] = ("default", "linear", "llama3"),
        partial_rotary: bool = False,
        default_theta: float = 10000.0,
    ) -> RopeConfig:
        """Reads ``rope_parameters`` (transformers 5) or ``rope_theta`` + ``rope_scaling``
        (older configs); ``params`` replaces them (one layer type's entry of per-layer-type
        parameters). ``allowed_types``: the rope types the architecture's transformers class
        honours; ``partial_rotary``: whether it honours ``partial_rotary_factor``. Raises
        UnsupportedModelError for a scaling type or option that changes the math in a way this
        implementation does not reproduce."""
        if params is None:
            params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        if not isinstance(params, dict):
            raise UnsupportedModelError(f"rope_parameters: expected an object, got {params!r}")
        if any(key in params for key in _PER_LAYER_KEYS):
            raise UnsupportedModelError(
                "rope_parameters: per-layer-type RoPE parameters are not supported"
            )
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        if "longrope" in allowed_types and rope_type in _LONGROPE_ALIASES:
            rope_type = "longrope"
        if rope_type not in allowed_types:
            raise UnsupportedModelError(
                f"rope_scaling: unsupported rope type {rope_type!r}; supported: "
                f"{', '.join(allowed_types)}"
            )
        partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
        partial = 1.0 if partial is None else float(partial)
        if partial != 1.0 and not partial_rotary:
            raise UnsupportedModelError(
                f"partial_rotary_factor: only 1.0 (rotate the whole head) is supported, "
                f"got {partial}"
            )
        if not 0.0 < partial <= 1.0:
            raise UnsupportedModelError(
                f"partial_rotary_factor: expected a value in (0, 1], got {partial}"
            )
        theta = params.get("rope_theta", hf.get("rope_theta", default_theta))
        if theta is None:
            theta = default_theta
        fields: dict = {"theta": float(theta), "type": rope_type, "partial_rotary_factor": partial}
        if rope_type == "longrope":
            fields.update(_longrope_fields(hf, params))
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

    def rotary_dim(self, head_dim: int) -> int:
        """How many leading dims of each head are rotated."""
        return int(head_dim * self.partial_rotary_factor)

    def inv_freq(self, head_dim: int, long: bool = False) -> torch.Tensor:
        """``[rotary_dim // 2]`` float32 inverse frequencies (``long``: LongRoPE's long
        factors)."""
        dim = self.rotary_dim(head_dim)
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        if self.type == "longrope":
            factors = self.long_factor if long else self.short_factor
            if len(factors) != dim // 2:
                raise UnsupportedModelError(
                    f"rope_parameters: {'long' if long else 'short'}_factor has "
                    f"{len(factors)} entries, expected {dim // 2} (half the rotary dim)"
                )
            return 1.0 / (torch.tensor(factors, dtype=torch.float32) * self.theta**exponents)
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


def _longrope_fields(hf: dict, params: dict) -> dict:
    """LongRoPE's fields as transformers' ``_compute_longrope_parameters`` reads them."""
    original = hf.get("original_max_position_embeddings")  # Phi-3 keeps it at the top level
    if original is None:
        original = params.get("original_max_position_embeddings")
    if original is None:
        original = _required(hf, "max_position_embeddings", "longrope")
    original = int(original)
    factor = params.get("factor")
    if factor is None:
        factor = int(_required(hf, "max_position_embeddings", "longrope")) / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        factor = float(factor)
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    return {
        "original_max_position_embeddings": original,
        "factor": float(factor),
        "attention_factor": float(attention_factor),
        "short_factor": tuple(float(f) for f in _required(params, "short_factor", "longrope")),
        "long_factor": tuple(float(f) for f in _required(params, "long_factor", "longrope")),
    }


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
        self.rotary_dim = rope.rotary_dim(head_dim)
        # host values, also while the model is built on the meta device (from_pretrained)
        with torch.device("cpu"):
            self._inv_freq = tuple(rope.inv_freq(head_dim).tolist())
            self._long_inv_freq: tuple[float, ...] | None = None
            if rope.type == "longrope":
                self._long_inv_freq = tuple(rope.inv_freq(head_dim, long=True).tolist())
        self.long_after = rope.original_max_position_embeddings
        self.attention_factor = rope.attention_factor

    @property
    def is_longrope(self) -> bool:
        """Whether the tables depend on the length of each token's sequence
        (:meth:`forward` then needs ``seq_lens``)."""
        return self._long_inv_freq is not None

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype, seq_lens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, ...]:
        """positions ``[T]`` int64 -> (cos, sin), each ``[T, rotary_dim]`` in ``dtype``: the
        tables of ``attnexport.rotary_embedding``, computed once per step for every layer.

        LongRoPE (``seq_lens``: ``[T]``, the length of each token's sequence in this step):
        a token of a sequence longer than ``original_max_position_embeddings`` is rotated
        with the long factors, others with the short ones, which is what transformers does
        for each sequence it runs (its ``longrope_frequency_update`` picks the set from the
        longest position of the forward call)."""
        device = positions.device
        inv_freq = torch.tensor(self._inv_freq, dtype=torch.float32, device=device)[None, :]
        if self._long_inv_freq is not None:
            if seq_lens is None:
                raise ValueError("seq_lens: LongRoPE tables need each token's sequence length")
            long = torch.tensor(self._long_inv_freq, dtype=torch.float32, device=device)
            inv_freq = torch.where((seq_lens > self.long_after)[:, None], long[None, :], inv_freq)
        freqs = positions.float()[:, None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


def token_seq_lens(
    positions: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor
) -> torch.Tensor:
    """``[T]``: the ``seq_lens`` entry of each token's sequence in a packed step of ``T``
    tokens (``positions`` ``[T]``, ``seq_lens`` ``[S]``, ``query_start_loc`` ``[S + 1]``).

    Each sequence start below ``T`` adds one at its offset and a cumulative sum counts the
    starts at or before each token: one more than its sequence's index. Not
    ``repeat_interleave`` (an output length read from the data, which an exported graph
    cannot size), and no slice of ``query_start_loc`` (torch.export then assumes more than
    one sequence)."""
    num_tokens = positions.shape[0]
    starts = query_start_loc.long()
    inside = starts < num_tokens
    marks = torch.zeros(num_tokens, dtype=torch.int64, device=positions.device)
    marks = marks.scatter_add(0, torch.where(inside, starts, 0), inside.long())
    return seq_lens.index_select(0, marks.cumsum(0) - 1)
