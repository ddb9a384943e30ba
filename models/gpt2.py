"""GPT-2: learned absolute positions, pre-LayerNorm blocks, a fused QKV projection and a GELU
MLP, tied embeddings by default.

transformers stores GPT-2's projections as ``Conv1D`` (weight ``[in, out]``); they are
transposed into ``nn.Linear`` at load. Honours ``scale_attn_weights`` and
``scale_attn_by_inverse_layer_idx`` (both fold into the op's ``scale``); refuses
``add_cross_attention``. Checkpoints saved without the ``transformer.`` prefix (the original
OpenAI uploads) load too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from attnexport.models.base import ModelConfig
from attnexport.models.decoder import TransformerBlocksDecoder
from attnexport.models.errors import UnsupportedModelError
from attnexport.models.hf_config import check_model_type, refuse, required
from attnexport.models.hf_config import field as hf_field
from attnexport.models.layers import PagedAttention, activation

_CONV1D = re.compile(r".*\.(c_attn|c_proj|c_fc)\.weight")


@dataclass(frozen=True)
class GPT2Config(ModelConfig):
    """GPT-2 hyper-parameters (field names follow transformers' GPT2Config)."""

    vocab_size: int = 256
    n_positions: int = 128
    n_embd: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_inner: int = 256
    activation_function: str = "gelu_new"
    layer_norm_epsilon: float = 1e-5
    scale_attn_weights: bool = True
    scale_attn_by_inverse_layer_idx: bool = False
    tie_word_embeddings: bool = True

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise UnsupportedModelError(f"n_head: {self.n_head} must divide n_embd {self.n_embd}")
        activation(self.activation_function, "activation_function")

    @classmethod
    def tiny(cls) -> GPT2Config:
        """2 layers, hidden 64, 4 heads, 128 positions, vocab 256."""
        return cls()

    @classmethod
    def from_hf(cls, hf: dict) -> GPT2Config:
        """From a ``gpt2`` config.json (``GPT2LMHeadModel``)."""
        check_model_type(hf, ("gpt2",), GPT2LMHeadModel.hf_architectures)
        refuse(hf, "add_cross_attention", False, "GPT-2 cross-attention is not implemented")
        hidden = int(required(hf, "n_embd", "hidden_size"))
        return cls(
            vocab_size=int(required(hf, "vocab_size")),
            n_positions=int(required(hf, "n_positions", "max_position_embeddings")),
            n_embd=hidden,
            n_layer=int(required(hf, "n_layer", "num_hidden_layers")),
            n_head=int(required(hf, "n_head", "num_attention_heads")),
            n_inner=int(hf_field(hf, "n_inner", 4 * hidden)),
            activation_function=hf_field(hf, "activation_function", "gelu_new"),
            layer_norm_epsilon=float(hf_field(hf, "layer_norm_epsilon", 1e-5)),
            scale_attn_weights=bool(hf_field(hf, "scale_attn_weights", True)),
            scale_attn_by_inverse_layer_idx=bool(
                hf_field(hf, "scale_attn_by_inverse_layer_idx", False)
            ),
            tie_word_embeddings=bool(hf_field(hf, "tie_word_embeddings", True)),
        )


class GPT2Attention(nn.Module):
    def __init__(self, config: GPT2Config, layer: int) -> None:
        super().__init__()
        self.heads, self.dim = config.n_head, config.n_embd // config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        scale = self.dim**-0.5 if config.scale_attn_weights else 1.0
        if config.scale_attn_by_inverse_layer_idx:
            scale /= float(layer + 1)
        self.attn = PagedAttention(self.heads, self.heads, self.dim, scale)

    def forward(self, x, key_cache, value_cache, metadata):
        q, k, v = self.c_attn(x).chunk(3, dim=-1)
        return self.c_proj(self.attn(q, k, v, key_cache, value_cache, metadata))


class GPT2MLP(nn.Module):
    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, config.n_inner)
        self.c_proj = nn.Linear(config.n_inner, config.n_embd)
        self.act = activation(config.activation_function, "activation_function")

    def forward(self, x):
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, config: GPT2Config, layer: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = GPT2Attention(config, layer)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = GPT2MLP(config)

    def forward(self, x, key_cache, value_cache, metadata):
        x = x + self.attn(self.ln_1(x), key_cache, value_cache, metadata)
        return x + self.mlp(self.ln_2(x))


class GPT2Backbone(nn.Module):
    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.h = nn.ModuleList(GPT2Block(config, i) for i in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)


class GPT2LMHeadModel(TransformerBlocksDecoder):
    """GPT-2 on the paged KV cache."""

    config_class = GPT2Config
    zoo_name = "gpt2"
    hf_model_types = ("gpt2",)
    hf_architectures = ("GPT2LMHeadModel",)

    def __init__(self, config: GPT2Config) -> None:
        super().__init__(config)
        self.transformer = GPT2Backbone(config)
        self.num_layers = config.n_layer
        self.num_kv_heads = config.n_head
        self.head_size = config.n_embd // config.n_head
        self.max_model_len = config.n_positions
        # The causal-mask buffers old transformers versions saved.
        self.ignored_hf_weights = (r"(transformer\.)?h\.\d+\.attn\.(masked_)?bias",)
        self.set_lm_head(config.n_embd, config.vocab_size, config.tie_word_embeddings)

    def convert_hf_weight(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.t() if _CONV1D.fullmatch(name) else tensor

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.transformer.wte(input_ids) + self.transformer.wpe(positions)

    def input_embeddings(self) -> nn.Embedding:
        return self.transformer.wte
