"""BLOOM: ALiBi attention (no position embeddings), LayerNorm on the embeddings and in every
block, a fused per-head-interleaved QKV projection and a tanh-GELU MLP.

transformers adds ``slope * key_position`` to the logits; the op adds
``slope * (key_position - query_position)``, which differs by a per-query constant that the
softmax removes. Parameter names mirror ``BloomForCausalLM``; checkpoints saved without the
``transformer.`` prefix (the original bigscience uploads) load too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from attnexport.models.base import ModelConfig
from attnexport.models.decoder import TransformerBlocksDecoder
from attnexport.models.errors import UnsupportedModelError
from attnexport.models.hf_config import check_model_type, required
from attnexport.models.hf_config import field as hf_field
from attnexport.models.layers import ACTIVATIONS, PagedAttention, alibi_slopes


@dataclass(frozen=True)
class BloomConfig(ModelConfig):
    """BLOOM hyper-parameters (field names follow transformers' BloomConfig)."""

    vocab_size: int = 256
    hidden_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    layer_norm_epsilon: float = 1e-5
    apply_residual_connection_post_layernorm: bool = False
    tie_word_embeddings: bool = True

    def __post_init__(self) -> None:
        if self.hidden_size % self.n_head:
            raise UnsupportedModelError(
                f"n_head: {self.n_head} must divide hidden_size {self.hidden_size}"
            )

    @classmethod
    def tiny(cls) -> BloomConfig:
        """2 layers, hidden 64, 4 heads, vocab 256."""
        return cls()

    @classmethod
    def from_hf(cls, hf: dict) -> BloomConfig:
        """From a ``bloom`` config.json (``BloomForCausalLM``)."""
        check_model_type(hf, ("bloom",), BloomForCausalLM.hf_architectures)
        return cls(
            vocab_size=int(required(hf, "vocab_size")),
            hidden_size=int(required(hf, "hidden_size", "n_embed")),
            n_layer=int(required(hf, "n_layer", "num_hidden_layers")),
            n_head=int(required(hf, "n_head", "num_attention_heads")),
            layer_norm_epsilon=float(hf_field(hf, "layer_norm_epsilon", 1e-5)),
            apply_residual_connection_post_layernorm=bool(
                hf_field(hf, "apply_residual_connection_post_layernorm", False)
            ),
            tie_word_embeddings=bool(hf_field(hf, "tie_word_embeddings", True)),
        )


class BloomAttention(nn.Module):
    def __init__(self, config: BloomConfig) -> None:
        super().__init__()
        self.heads, self.dim = config.n_head, config.hidden_size // config.n_head
        self.query_key_value = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.attn = PagedAttention(
            self.heads, self.heads, self.dim, self.dim**-0.5, alibi=alibi_slopes(self.heads)
        )

    def forward(self, x, key_cache, value_cache, metadata):
        # Per head, the fused projection holds [q, k, v] consecutively.
        qkv = self.query_key_value(x).unflatten(-1, (self.heads, 3, self.dim))
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        return self.dense(self.attn(q, k, v, key_cache, value_cache, metadata))


class BloomMLP(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.dense_h_to_4h = nn.Linear(hidden, 4 * hidden)
        self.dense_4h_to_h = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return self.dense_4h_to_h(ACTIVATIONS["bloom_gelu"](self.dense_h_to_4h(x)))


class BloomBlock(nn.Module):
    def __init__(self, config: BloomConfig) -> None:
        super().__init__()
        eps = config.layer_norm_epsilon
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=eps)
        self.self_attention = BloomAttention(config)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=eps)
        self.mlp = BloomMLP(config.hidden_size)
        self.post_ln_residual = config.apply_residual_connection_post_layernorm

    def forward(self, x, key_cache, value_cache, metadata):
        normed = self.input_layernorm(x)
        residual = normed if self.post_ln_residual else x
        x = residual + self.self_attention(normed, key_cache, value_cache, metadata)
        normed = self.post_attention_layernorm(x)
        residual = normed if self.post_ln_residual else x
        return residual + self.mlp(normed)


class BloomBackbone(nn.Module):
    def __init__(self, config: BloomConfig) -> None:
        super().__init__()
        eps = config.layer_norm_epsilon
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.word_embeddings_layernorm = nn.LayerNorm(config.hidden_size, eps=eps)
        self.h = nn.ModuleList(BloomBlock(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=eps)


class BloomForCausalLM(TransformerBlocksDecoder):
    """BLOOM with ALiBi on the paged KV cache."""

    config_class = BloomConfig
    zoo_name = "bloom"
    hf_model_types = ("bloom",)
    hf_architectures = ("BloomForCausalLM",)

    def __init__(self, config: BloomConfig) -> None:
        super().__init__(config)
        self.transformer = BloomBackbone(config)
        self.num_layers = config.n_layer
        self.num_kv_heads = config.n_head
        self.head_size = config.hidden_size // config.n_head
        self.max_model_len = None  # ALiBi: no learned or rotary position limit
        self.set_lm_head(config.hidden_size, config.vocab_size, config.tie_word_embeddings)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        backbone = self.transformer
        return backbone.word_embeddings_layernorm(backbone.word_embeddings(input_ids))

    def input_embeddings(self) -> nn.Embedding:
        return self.transformer.word_embeddings
