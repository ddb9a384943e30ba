"""Qwen2: the Llama network with biases on the q/k/v projections (not on o_proj) and an
optional sliding window on some layers.

As in transformers' ``Qwen2Config``: the window applies only when ``use_sliding_window`` is
true, and then only to the layers whose ``layer_types`` entry is ``"sliding_attention"``
(without ``layer_types``: the layers with index >= ``max_window_layers``).
"""

from __future__ import annotations

from dataclasses import dataclass

from attnexport.models.errors import UnsupportedModelError
from attnexport.models.hf_config import check_model_type, required
from attnexport.models.hf_config import field as hf_field
from attnexport.models.llama import LlamaConfig, LlamaForCausalLM

LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class Qwen2Config(LlamaConfig):
    """The Llama config, read from a Qwen2 config.json."""

    @classmethod
    def tiny(cls) -> Qwen2Config:
        """The tiny Llama config with q/k/v biases and a 6-token window on layer 1."""
        return cls(attention_bias=True, sliding_windows=(-1, 6))

    @classmethod
    def from_hf(cls, hf: dict) -> Qwen2Config:
        """From a ``qwen2`` config.json (``Qwen2ForCausalLM``)."""
        check_model_type(hf, ("qwen2",), Qwen2ForCausalLM.hf_architectures)
        return cls.common_from_hf(
            hf,
            attention_bias=True,
            o_proj_bias=False,
            mlp_bias=False,
            sliding_windows=qwen_windows(hf),
        )


def qwen_windows(hf: dict) -> tuple[int, ...]:
    """Per-layer windows of a Qwen2/Qwen3 config.json, as transformers reads them."""
    layers = int(required(hf, "num_hidden_layers"))
    window = hf_field(hf, "sliding_window")
    if not (hf_field(hf, "use_sliding_window", False) and window is not None):
        return (-1,) * layers
    max_window_layers = int(hf_field(hf, "max_window_layers", 28))
    layer_types = hf_field(hf, "layer_types") or [
        "sliding_attention" if i >= max_window_layers else "full_attention" for i in range(layers)
    ]
    if len(layer_types) != layers or any(t not in LAYER_TYPES for t in layer_types):
        raise UnsupportedModelError(
            f"layer_types: expected {layers} entries from {LAYER_TYPES}, got {layer_types}"
        )
    return tuple(int(window) if t == "sliding_attention" else -1 for t in layer_types)


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 on the paged KV cache (the Llama network with q/k/v biases)."""

    config_class = Qwen2Config
    zoo_name = "qwen2"
    hf_model_types = ("qwen2",)
    hf_architectures = ("Qwen2ForCausalLM",)
