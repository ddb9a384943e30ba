"""Llama family: RoPE (default, linear or Llama-3 scaling), grouped-query attention, RMSNorm,
SwiGLU, tied or untied embeddings, optional attention/MLP biases and per-layer sliding windows.

Mistral (:mod:`attnexport.models.mistral`) and Qwen2 (:mod:`attnexport.models.qwen2`) are this
network with other config fields; they only parse their configs. Parameter names mirror
transformers' ``LlamaForCausalLM``, so checkpoints load by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from attnexport import qkv_rotary_embedding, rotary_embedding
from attnexport.models.base import ModelConfig, layer_caches
from attnexport.models.decoder import DecoderModel
from attnexport.models.errors import UnsupportedModelError
from attnexport.models.hf_config import check_model_type, required
from attnexport.models.hf_config import field as hf_field
from attnexport.models.layers import GatedMLP, PagedAttention, PagedMetadata, RMSNorm, activation
from attnexport.models.rope import RopeConfig, RotaryEmbedding, token_seq_lens


@dataclass(frozen=True)
class LlamaConfig(ModelConfig):
    """Llama-style decoder hyper-parameters (field names follow transformers' LlamaConfig)."""

    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    """Bias on q/k/v projections."""
    o_proj_bias: bool = False
    mlp_bias: bool = False
    rope: RopeConfig = field(default_factory=RopeConfig)
    sliding_windows: tuple[int, ...] = ()
    """Per-layer sliding window (-1: full attention); empty means full attention everywhere."""
    max_position_embeddings: int = 2048
    qk_norm: bool = False
    """RMSNorm over each query and key head before the rotation (Qwen3, Gemma 3)."""
    query_pre_attn_scalar: float | None = None
    """Attention scores are scaled by ``query_pre_attn_scalar ** -0.5`` (default: head_dim)."""
    attn_logit_softcap: float = 0.0
    """``cap * tanh(score / cap)`` on the attention scores (0: none; Gemma 2)."""

    @property
    def attn_scale(self) -> float:
        """The factor of the attention scores."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise UnsupportedModelError(
                f"num_key_value_heads: {self.num_key_value_heads} must divide "
                f"num_attention_heads {self.num_attention_heads}"
            )
        rotary = self.rope.rotary_dim(self.head_dim)
        for name in ("short_factor", "long_factor") if self.rope.type == "longrope" else ():
            if len(getattr(self.rope, name)) != rotary // 2:
                raise UnsupportedModelError(
                    f"rope_parameters.{name}: {len(getattr(self.rope, name))} entries, expected "
                    f"{rotary // 2} (half the rotary dim {rotary})"
                )
        if self.sliding_windows and len(self.sliding_windows) != self.num_hidden_layers:
            raise ValueError(
                f"sliding_windows: expected {self.num_hidden_layers} entries (one per layer), "
                f"got {len(self.sliding_windows)}"
            )

    @classmethod
    def tiny(cls) -> LlamaConfig:
        """2 layers, hidden 64, 4 heads over 2 KV heads, vocab 256."""
        return cls()

    def window(self, layer: int) -> int:
        """The sliding window of ``layer`` (-1: full attention)."""
        return self.sliding_windows[layer] if self.sliding_windows else -1

    @classmethod
    def from_hf(cls, hf: dict) -> LlamaConfig:
        """From a ``llama`` config.json (``LlamaForCausalLM``)."""
        check_model_type(hf, ("llama",), ("LlamaForCausalLM",))
        bias = bool(hf_field(hf, "attention_bias", False))
        return cls.common_from_hf(
            hf,
            attention_bias=bias,
            o_proj_bias=bias,
            mlp_bias=bool(hf_field(hf, "mlp_bias", False)),
        )

    @classmethod
    def common_from_hf(cls, hf: dict, **overrides) -> LlamaConfig:
        """The fields Llama, Mistral, Qwen2/3 and Phi-3 configs share, plus ``overrides``."""
        activation(overrides.get("hidden_act", hf_field(hf, "hidden_act", "silu")))
        heads = int(required(hf, "num_attention_heads"))
        hidden = int(required(hf, "hidden_size"))
        values = {
            "vocab_size": int(required(hf, "vocab_size")),
            "hidden_size": hidden,
            "intermediate_size": int(required(hf, "intermediate_size")),
            "num_hidden_layers": int(required(hf, "num_hidden_layers")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(hf_field(hf, "num_key_value_heads", heads)),
            "head_dim": int(hf_field(hf, "head_dim", hidden // heads)),
            "rms_norm_eps": float(hf_field(hf, "rms_norm_eps", 1e-6)),
            "hidden_act": hf_field(hf, "hidden_act", "silu"),
            "tie_word_embeddings": bool(hf_field(hf, "tie_word_embeddings", False)),
            "rope": overrides.pop("rope", None) or RopeConfig.from_hf(hf),
            "max_position_embeddings": int(hf_field(hf, "max_position_embeddings", 2048)),
        }
        values.update(overrides)
        return cls(**values)


# Local fused projections -> the checkpoint tensors they concatenate (along the output dim).
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig, layer: int) -> None:
        super().__init__()
        heads, kv_heads, dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        hidden, bias = config.hidden_size, config.attention_bias
        # q, k and v in one matmul; loads from the checkpoint's q/k/v_proj concatenated.
        self.qkv_proj = nn.Linear(hidden, (heads + 2 * kv_heads) * dim, bias=bias)
        self.o_proj = nn.Linear(heads * dim, hidden, bias=config.o_proj_bias)
        self.attn = PagedAttention(
            heads,
            kv_heads,
            dim,
            config.attn_scale,
            sliding_window=config.window(layer),
            logits_soft_cap=config.attn_logit_softcap,
        )
        self.heads, self.kv_heads, self.dim = heads, kv_heads, dim
        self.rotary_dim = config.rope.rotary_dim(dim)
        # Per-head norms as standard ops: a few elementwise nodes on [T, H, D], small beside
        # the projections (onnxruntime 1.32 leaves these 3-D ones unfused, measured on Qwen3).
        self.q_norm = RMSNorm(dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(self, x, rope, key_cache, value_cache, metadata: PagedMetadata):
        cos, sin = rope
        qkv = self.qkv_proj(x)
        if self.q_norm is None and self.rotary_dim == self.dim:
            # The split into heads and the rotation of q and k: one fused node in the graph.
            q, k, v = qkv_rotary_embedding(qkv, cos, sin, self.heads, self.kv_heads)
        else:
            q, k, v = qkv.unflatten(1, (-1, self.dim)).split(
                (self.heads, self.kv_heads, self.kv_heads), dim=1
            )
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            # q and k rotated in one call (the op takes any head count).
            qk = self._rotate(torch.cat((q, k), dim=1), cos, sin)
            q, k = qk.split((self.heads, self.kv_heads), dim=1)
        return self.o_proj(self.attn(q, k, v, key_cache, value_cache, metadata))

    def _rotate(self, heads: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """heads ``[T, H, D]``: the first ``rotary_dim`` dims rotated, the rest kept."""
        if self.rotary_dim == self.dim:
            return rotary_embedding(heads, cos, sin)
        rotated, kept = heads.split((self.rotary_dim, self.dim - self.rotary_dim), dim=-1)
        return torch.cat((rotary_embedding(rotated.contiguous(), cos, sin), kept), dim=-1)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer)
        self.mlp = GatedMLP(
            config.hidden_size, config.intermediate_size, config.hidden_act, config.mlp_bias
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, residual, rope, key_cache, value_cache, metadata):
        """The layer on ``x`` [T, hidden] with the residual stream kept apart (as in vLLM):
        ``residual`` is None in the first layer, whose input is the residual; otherwise the
        layer input is ``x + residual``, added by the fused norm. Returns ``(x, residual)``
        of the next layer."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add_and_norm(x, residual)
        h = self.self_attn(h, rope, key_cache, value_cache, metadata)
        h, residual = self.post_attention_layernorm.add_and_norm(h, residual)
        return self.mlp(h), residual


class LlamaBackbone(nn.Module):
    layer_class: type[nn.Module] = LlamaDecoderLayer

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            self.layer_class(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope)


class LlamaForCausalLM(DecoderModel):
    """Llama (and the shared network of Mistral and Qwen2) on the paged KV cache."""

    config_class = LlamaConfig
    backbone_class: type[LlamaBackbone] = LlamaBackbone
    zoo_name = "llama"
    hf_model_types = ("llama",)
    hf_architectures = ("LlamaForCausalLM",)

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__(config)
        self.model = self.backbone_class(config)
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = config.num_key_value_heads
        self.head_size = config.head_dim
        self.max_model_len = config.max_position_embeddings
        if self.model.rotary_emb.is_longrope:
            self.rope_switch_length = self.model.rotary_emb.long_after
        self.ignored_hf_weights = (r".*rotary_emb\.inv_freq",)  # saved by old transformers
        self.set_lm_head(config.hidden_size, config.vocab_size, config.tie_word_embeddings)

    def hf_weight_names(self, name: str) -> tuple[str | tuple[str, ...], ...]:
        for fused, parts in _FUSED.items():
            if f".{fused}." in name:
                return (tuple(name.replace(fused, part) for part in parts),)
        return (name,)

    def hidden_states(self, input_ids, positions, metadata, kv_caches) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        rope = self.model.rotary_emb(positions, x.dtype, self.rope_seq_lens(positions, metadata))
        residual = None
        for layer, (key_cache, value_cache) in zip(
            self.model.layers, layer_caches(kv_caches), strict=True
        ):
            x, residual = layer(x, residual, rope, key_cache, value_cache, metadata)
        if residual is None:  # no layers
            return self.model.norm(x)
        return self.model.norm.add_and_norm(x, residual)[0]

    def rope_seq_lens(self, positions, metadata: PagedMetadata) -> torch.Tensor | None:
        """``[T]`` sequence length of each token when the RoPE tables depend on it
        (LongRoPE), else None."""
        if not self.model.rotary_emb.is_longrope:
            return None
        return token_seq_lens(positions, metadata.seq_lens, metadata.query_start_loc)

    def input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens
