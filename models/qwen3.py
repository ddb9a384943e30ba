"""Qwen3 (dense): the Llama network with an RMSNorm over each query and key head before the
rotation, ``attention_bias`` on all four projections (off in the released checkpoints) and
Qwen2's per-layer sliding windows (``use_sliding_window``, ``layer_types`` /
``max_window_layers``), as transformers' ``Qwen3ForCausalLM`` computes them.
"""

from __future__ import annotations

from dataclasses import dataclass

from attnexport.models.hf_config import check_model_type
from attnexport.models.hf_config import field as hf_field
from attnexport.models.llama import LlamaConfig, LlamaForCausalLM
from attnexport.models.qwen2 import qwen_windows


@dataclass(frozen=True)
class Qwen3Config(LlamaConfig):
    """The Llama config with per-head q/k norms, read from a Qwen3 config.json."""

    @classmethod
    def tiny(cls) -> Qwen3Config:
        """The tiny Llama config with q/k norms and a 6-token window on layer 1."""
        return cls(qk_norm=True, sliding_windows=(-1, 6))

    @classmethod
    def from_hf(cls, hf: dict) -> Qwen3Config:
        """From a ``qwen3`` config.json (``Qwen3ForCausalLM``)."""
        check_model_type(hf, ("qwen3",), Qwen3ForCausalLM.hf_architectures)
        bias = bool(hf_field(hf, "attention_bias", False))
        return cls.common_from_hf(
            hf,
            attention_bias=bias,
            o_proj_bias=bias,
            mlp_bias=False,
            qk_norm=True,
            sliding_windows=qwen_windows(hf),
        )


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 on the paged KV cache (the Llama network with per-head q/k RMSNorm)."""

    config_class = Qwen3Config
    zoo_name = "qwen3"
    hf_model_types = ("qwen3",)
    hf_architectures = ("Qwen3ForCausalLM",)
