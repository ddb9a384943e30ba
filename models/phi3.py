"""Phi-3: the Llama network with the checkpoint's projections already fused (``qkv_proj``:
q, k, v rows; ``gate_up_proj``: gate, up rows; the layout the zoo computes with, so they load
as they are), an optional ``sliding_window`` on every layer, ``partial_rotary_factor`` and
the RoPE variants transformers' ``Phi3ForCausalLM`` implements: ``default`` and ``longrope``
(legacy names ``su`` and ``yarn``), whose short or long factors are chosen per sequence from
its length in the step (see :class:`~attnexport.models.rope.RotaryEmbedding`).

transformers re-runs a whole sequence with the long factors once it grows past
``original_max_position_embeddings`` during ``generate`` (its
``prepare_inputs_for_generation`` drops the cache). The model declares that length as
``rope_switch_length`` (set by :class:`~attnexport.models.llama.LlamaForCausalLM` for any
LongRoPE config) and the engine's scheduler recomputes a sequence crossing it
(docs/runtime.md, "RoPE regime switch").
"""

from __future__ import annotations

from dataclasses import dataclass

from attnexport.models.hf_config import check_model_type, required
from attnexport.models.hf_config import field as hf_field
from attnexport.models.llama import LlamaConfig, LlamaForCausalLM
from attnexport.models.rope import RopeConfig

# The defaults of transformers' Phi3Config for fields a config.json may leave out.
_PHI3_DEFAULTS = {"rms_norm_eps": 1e-5, "max_position_embeddings": 4096}


@dataclass(frozen=True)
class Phi3Config(LlamaConfig):
    """The Llama config, read from a Phi-3 config.json."""

    @classmethod
    def tiny(cls) -> Phi3Config:
        """The tiny Llama config with a 6-token window on both layers and half of each head
        rotated."""
        return cls(sliding_windows=(6, 6), rope=RopeConfig(partial_rotary_factor=0.5))

    @classmethod
    def from_hf(cls, hf: dict) -> Phi3Config:
        """From a ``phi3`` config.json (``Phi3ForCausalLM``)."""
        check_model_type(hf, ("phi3",), Phi3ForCausalLM.hf_architectures)
        hf = {**_PHI3_DEFAULTS, **hf}
        window = hf_field(hf, "sliding_window")
        layers = int(required(hf, "num_hidden_layers"))
        rope = RopeConfig.from_hf(hf, allowed_types=("default", "longrope"), partial_rotary=True)
        return cls.common_from_hf(
            hf,
            attention_bias=False,
            o_proj_bias=False,
            mlp_bias=False,
            sliding_windows=(-1 if window is None else int(window),) * layers,
            rope=rope,
        )


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 on the paged KV cache (the Llama network, fused projections as stored)."""

    config_class = Phi3Config
    zoo_name = "phi3"
    hf_model_types = ("phi3",)
    hf_architectures = ("Phi3ForCausalLM",)

    def hf_weight_names(self, name: str) -> tuple[str | tuple[str, ...], ...]:
        return (name,)
