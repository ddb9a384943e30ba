"""Gemma 2 and Gemma 3 (text): the Llama attention with Gemma's choices, as transformers'
``Gemma2ForCausalLM`` and ``Gemma3ForCausalLM`` compute them.

- RMSNorm with a zero-centred weight, ``x_normed * (1 + w)``: ``1 + w`` is computed once at
  import (fp32, as transformers does per call), so the norm is Llama's and the residual adds
  stay ``attnexport::fused_add_rms_norm`` nodes.
- "Sandwich" norms: a norm after the attention and after the MLP, before each residual add,
  besides the norms before them.
- The embedding scaled by ``sqrt(hidden_size)`` rounded to the model dtype; GeGLU
  (``gelu_pytorch_tanh``); scores scaled by ``query_pre_attn_scalar ** -0.5``; tied embeddings.
- Layers of ``layer_types``: ``sliding_attention`` ones see the last ``sliding_window`` keys.
- Gemma 2: ``attn_logit_softcapping`` on the attention scores and ``final_logit_softcapping``
  on the logits, ``cap * tanh(x / cap)``.
- Gemma 3: per-head q/k norms; the sliding layers take the RoPE of
  ``rope_parameters["sliding_attention"]`` (legacy: ``rope_local_base_freq``), the others that
  of ``"full_attention"`` (legacy: ``rope_theta`` + ``rope_scaling``); final soft-capping when
  set. transformers' Gemma 3 attention does not apply ``attn_logit_softcapping`` (it never
  passes it to the attention function), so neither does this class.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from attnexport.models.base import layer_caches
from attnexport.models.errors import UnsupportedModelError
from attnexport.models.hf_config import check_model_type, refuse, required
from attnexport.models.hf_config import field as hf_field
from attnexport.models.layers import GatedMLP, RMSNorm
from attnexport.models.llama import LlamaAttention, LlamaBackbone, LlamaConfig, LlamaForCausalLM
from attnexport.models.rope import RopeConfig, RotaryEmbedding

LAYER_TYPES = ("full_attention", "sliding_attention")

# The defaults of transformers' config classes, for the fields a config.json may leave out
# (an absent field takes the class default; a null one means "none").
_GEMMA2_DEFAULTS = {
    "head_dim": 256,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "final_logit_softcapping": 30.0,
    "attn_logit_softcapping": 50.0,
}
_GEMMA3_DEFAULTS = {
    **_GEMMA2_DEFAULTS,
    "max_position_embeddings": 131072,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
}
_GEMMA3_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}

# The norms whose checkpoint weight w means a scale of 1 + w.
_NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
    "q_norm",
    "k_norm",
)


@dataclass(frozen=True)
class GemmaConfig(LlamaConfig):
    """The Llama config plus Gemma's fields (shared by Gemma 2 and Gemma 3)."""

    hidden_act: str = "gelu_pytorch_tanh"
    tie_word_embeddings: bool = True
    final_logit_softcap: float = 0.0
    """``cap * tanh(logits / cap)`` on the output logits (0: none)."""
    local_rope: RopeConfig | None = None
    """The RoPE of the sliding-window layers, when it differs from ``rope`` (Gemma 3)."""

    @classmethod
    def gemma_from_hf(cls, hf: dict, defaults: dict, **overrides) -> GemmaConfig:
        """The fields Gemma 2 and 3 share, from ``hf`` completed with ``defaults``."""
        hf = {**defaults, **hf}
        refuse(hf, "use_bidirectional_attention", (False,), "only causal attention is exported")
        layers = int(required(hf, "num_hidden_layers"))
        layer_types = overrides.pop("layer_types", None) or hf.get("layer_types")
        if layer_types is None:
            layer_types = [
                "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)
            ]
        if len(layer_types) != layers or any(t not in LAYER_TYPES for t in layer_types):
            raise UnsupportedModelError(
                f"layer_types: expected {layers} entries from {LAYER_TYPES}, got {layer_types}"
            )
        window = hf.get("sliding_window")
        windows = tuple(
            int(window) if t == "sliding_attention" and window is not None else -1
            for t in layer_types
        )
        scalar = hf.get("query_pre_attn_scalar")
        return cls.common_from_hf(
            hf,
            hidden_act=hf_field(hf, "hidden_activation", "gelu_pytorch_tanh", "hidden_act"),
            attention_bias=bool(hf_field(hf, "attention_bias", False)),
            o_proj_bias=bool(hf_field(hf, "attention_bias", False)),
            mlp_bias=False,
            sliding_windows=windows,
            query_pre_attn_scalar=None if scalar is None else float(scalar),
            final_logit_softcap=float(hf.get("final_logit_softcapping") or 0.0),
            **overrides,
        )

    def layer_rope(self, layer: int) -> RopeConfig:
        """The RoPE of ``layer``."""
        if self.local_rope is not None and self.window(layer) >= 0:
            return self.local_rope
        return self.rope


@dataclass(frozen=True)
class Gemma2Config(GemmaConfig):
    """Gemma 2 hyper-parameters."""

    @classmethod
    def tiny(cls) -> Gemma2Config:
        """Two layers (sliding 6, full), soft-caps 50 (scores) and 30 (logits)."""
        return cls(sliding_windows=(6, -1), attn_logit_softcap=50.0, final_logit_softcap=30.0)

    @classmethod
    def from_hf(cls, hf: dict) -> Gemma2Config:
        """From a ``gemma2`` config.json (``Gemma2ForCausalLM``)."""
        check_model_type(hf, ("gemma2",), Gemma2ForCausalLM.hf_architectures)
        cap = {**_GEMMA2_DEFAULTS, **hf}.get("attn_logit_softcapping")
        return cls.gemma_from_hf(hf, _GEMMA2_DEFAULTS, attn_logit_softcap=float(cap or 0.0))


@dataclass(frozen=True)
class Gemma3Config(GemmaConfig):
    """Gemma 3 (text) hyper-parameters."""

    @classmethod
    def tiny(cls) -> Gemma3Config:
        """Two layers (sliding 6 with RoPE base 10k, full with base 1M), q/k norms."""
        return cls(
            sliding_windows=(6, -1),
            qk_norm=True,
            rope=RopeConfig(theta=_GEMMA3_THETA["full_attention"]),
            local_rope=RopeConfig(theta=_GEMMA3_THETA["sliding_attention"]),
        )

    @classmethod
    def from_hf(cls, hf: dict) -> Gemma3Config:
        """From a ``gemma3_text`` config.json (``Gemma3ForCausalLM``)."""
        check_model_type(hf, ("gemma3_text",), Gemma3ForCausalLM.hf_architectures)
        layers = int(required(hf, "num_hidden_layers"))
        layer_types = hf.get("layer_types")
        if layer_types is None:
            pattern = int(hf_field(hf, "sliding_window_pattern", 6))
            layer_types = [
                "sliding_attention" if (i + 1) % pattern else "full_attention"
                for i in range(layers)
            ]
        ropes = _gemma3_ropes(hf)
        return cls.gemma_from_hf(
            hf,
            _GEMMA3_DEFAULTS,
            layer_types=layer_types,
            qk_norm=True,
            rope=ropes["full_attention"],
            local_rope=ropes["sliding_attention"],
        )


def _gemma3_ropes(hf: dict) -> dict[str, RopeConfig]:
    """The RoPE of each layer type, as ``Gemma3TextConfig.convert_rope_params_to_dict`` reads
    them: per-layer-type ``rope_parameters``, or the legacy ``rope_theta`` (global),
    ``rope_local_base_freq`` (local) and ``rope_scaling`` (global only)."""
    params = hf.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise UnsupportedModelError(f"rope_parameters: expected an object, got {params!r}")
    per_type = dict(params or {})
    if per_type and not set(per_type) <= set(LAYER_TYPES):
        # one set of parameters for every layer: transformers reads it as the global one
        per_type = {"full_attention": per_type}
    full = dict(per_type.get("full_attention") or {"rope_type": "default"})
    full.update(hf.get("rope_scaling") or {})
    full.setdefault("rope_theta", hf.get("rope_theta") or _GEMMA3_THETA["full_attention"])
    local = dict(per_type.get("sliding_attention") or {"rope_type": "default"})
    local.setdefault(
        "rope_theta", hf.get("rope_local_base_freq") or _GEMMA3_THETA["sliding_attention"]
    )
    return {
        "full_attention": RopeConfig.from_hf(hf, params=full),
        "sliding_attention": RopeConfig.from_hf(hf, params=local),
    }


class GemmaDecoderLayer(nn.Module):
    """Pre- and post-norms around the attention and around the MLP."""

    def __init__(self, config: GemmaConfig, layer: int) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = LlamaAttention(config, layer)
        self.mlp = GatedMLP(hidden, config.intermediate_size, config.hidden_act)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps)

    def forward(self, x, residual, rope, key_cache, value_cache, metadata):
        """As ``LlamaDecoderLayer.forward``: the residual stream kept apart, each add fused
        with the norm after it. Returns ``(x, residual)`` of the next layer."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add_and_norm(x, residual)
        h = self.post_attention_layernorm(self.self_attn(h, rope, key_cache, value_cache, metadata))
        h, residual = self.pre_feedforward_layernorm.add_and_norm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class GemmaBackbone(LlamaBackbone):
    layer_class = GemmaDecoderLayer

    def __init__(self, config: GemmaConfig) -> None:
        super().__init__(config)
        self.local_rotary_emb = (
            RotaryEmbedding(config.head_dim, config.local_rope)
            if config.local_rope is not None
            else None
        )


class GemmaForCausalLM(LlamaForCausalLM):
    """The network of Gemma 2 and Gemma 3 (text) on the paged KV cache."""

    config_class = GemmaConfig
    backbone_class = GemmaBackbone

    def __init__(self, config: GemmaConfig) -> None:
        super().__init__(config)
        self.embed_scale = math.sqrt(config.hidden_size)
        self.final_logit_softcap = config.final_logit_softcap
        self.local_layers = tuple(
            config.local_rope is not None and config.window(i) >= 0
            for i in range(config.num_hidden_layers)
        )

    def convert_hf_weight(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        # Gemma's norms scale by 1 + w, computed in fp32 like transformers' Gemma RMSNorm.
        if name == "model.norm.weight" or any(f".{n}." in name for n in _NORMS):
            return tensor.float() + 1.0
        return tensor

    def hidden_states(self, input_ids, positions, metadata, kv_caches) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        # transformers multiplies by sqrt(hidden) cast to the weights' dtype
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        seq_lens = self.rope_seq_lens(positions, metadata)
        rope = self.model.rotary_emb(positions, x.dtype, seq_lens)
        local = self.model.local_rotary_emb
        local_rope = local(positions, x.dtype, seq_lens) if local is not None else rope
        residual = None
        for layer, is_local, (key_cache, value_cache) in zip(
            self.model.layers, self.local_layers, layer_caches(kv_caches), strict=True
        ):
            layer_rope = local_rope if is_local else rope
            x, residual = layer(x, residual, layer_rope, key_cache, value_cache, metadata)
        if residual is None:  # no layers
            return self.model.norm(x)
        return self.model.norm.add_and_norm(x, residual)[0]

    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().lm_logits(hidden)
        if self.final_logit_softcap > 0:
            cap = self.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits


class Gemma2ForCausalLM(GemmaForCausalLM):
    """Gemma 2 on the paged KV cache."""

    config_class = Gemma2Config
    zoo_name = "gemma2"
    hf_model_types = ("gemma2",)
    hf_architectures = ("Gemma2ForCausalLM",)


class Gemma3ForCausalLM(GemmaForCausalLM):
    """Gemma 3 (text only) on the paged KV cache."""

    config_class = Gemma3Config
    zoo_name = "gemma3"
    hf_model_types = ("gemma3_text",)
    hf_architectures = ("Gemma3ForCausalLM",)
