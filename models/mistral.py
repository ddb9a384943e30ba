"""Mistral: the Llama network with a sliding attention window on every layer and no biases.

transformers' ``MistralModel`` applies ``sliding_window`` (null: none) to all layers and
ignores ``layer_types``; so does this class.
"""

from __future__ import annotations

from dataclasses import dataclass

from attnexport.models.hf_config import check_model_type, required
from attnexport.models.hf_config import field as hf_field
from attnexport.models.llama import LlamaConfig, LlamaForCausalLM


@dataclass(frozen=True)
class MistralConfig(LlamaConfig):
    """The Llama config, read from a Mistral config.json."""

    @classmethod
    def tiny(cls) -> MistralConfig:
        """The tiny Llama config with a 6-token sliding window on both layers."""
        return cls(sliding_windows=(6, 6))

    @classmethod
    def from_hf(cls, hf: dict) -> MistralConfig:
        """From a ``mistral`` config.json (``MistralForCausalLM``)."""
        check_model_type(hf, ("mistral",), MistralForCausalLM.hf_architectures)
        window = hf_field(hf, "sliding_window", -1)
        layers = int(required(hf, "num_hidden_layers"))
        return cls.common_from_hf(hf, sliding_windows=(int(window),) * layers)


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral on the paged KV cache (the Llama network with sliding windows)."""

    config_class = MistralConfig
    zoo_name = "mistral"
    hf_model_types = ("mistral",)
    hf_architectures = ("MistralForCausalLM",)
