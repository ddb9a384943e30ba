"""BART: an encoder-decoder with learned positions (offset 2), post-LayerNorm blocks, GELU MLPs,
paged decoder self-attention and cross-attention over the encoder output cached once in the
paged cross cache (``causal=False``).

Why BART: its positions are learned absolute embeddings, so every attention is plain scaled
dot-product attention that the attnexport ops express exactly (T5's relative position bias is
not an op input; Whisper's decoder needs an audio front end to be useful).

Forward (the encoder-decoder convention of ``attnexport.model_interface``)::

    forward(input_ids, positions, slot_mapping, block_tables, seq_lens, query_start_loc,
            logits_indices,                                  # the decoder step, as decoders
            encoder_input_ids [T_enc], encoder_positions [T_enc], encoder_start_loc [S + 1],
            cross_slot_mapping [T_enc], cross_block_tables [S, MCB], encoder_seq_lens [S],
            kv_caches = [self k/v per layer..., cross k/v per layer...]) -> logits [N, V] fp32

One graph serves every step. In the step that admits a sequence, the runtime passes its
encoder tokens (``encode_now``): the encoder runs over them with non-causal
``varlen_attention``, and each decoder layer projects their keys/values and writes them into
its cross cache at ``cross_slot_mapping``. Later steps pass zero encoder tokens; every decoder
token cross-attends over ``cross_block_tables``/``encoder_seq_lens``. A sequence's encoder input
is encoded whole in one step (it is not chunked).

Tied checkpoints (the default) share ``model.shared`` between both embeddings and the LM head;
untied ones have their own ``encoder``/``decoder`` ``embed_tokens`` and ``lm_head``.
``final_logits_bias`` is added to the logits (zeros when the checkpoint lacks it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from attnexport.model_interface import ENCODER_DECODER_INPUT_NAMES, CacheSpec
from attnexport.models.base import (
    SAMPLE_ENCODER_LENGTHS,
    ExportSample,
    ModelConfig,
    PagedModel,
    check_kv_caches,
    decoder_dims,
    layer_caches,
    sample_batch,
)
from attnexport.models.decoder import decoder_dynamic_shapes, decoder_sample_args
from attnexport.models.errors import UnsupportedModelError
from attnexport.models.hf_config import check_model_type, refuse, required
from attnexport.models.hf_config import field as hf_field
from attnexport.models.layers import (
    EmptySafeLayerNorm,
    PagedAttention,
    PagedMetadata,
    VarlenAttention,
    activation,
)

POSITION_OFFSET = 2
"""BART's learned position table starts at index 2 (a fairseq legacy)."""


@dataclass(frozen=True)
class BartConfig(ModelConfig):
    """BART hyper-parameters (field names follow transformers' BartConfig)."""

    vocab_size: int = 256
    d_model: int = 64
    encoder_layers: int = 2
    decoder_layers: int = 2
    encoder_attention_heads: int = 4
    decoder_attention_heads: int = 4
    encoder_ffn_dim: int = 128
    decoder_ffn_dim: int = 128
    activation_function: str = "gelu"
    max_position_embeddings: int = 128
    scale_embedding: bool = False
    tie_word_embeddings: bool = True
    decoder_start_token_id: int = 2
    """The first decoder token of a generation (not used by forward; for the runtime)."""

    def __post_init__(self) -> None:
        for field in ("encoder_attention_heads", "decoder_attention_heads"):
            heads = getattr(self, field)
            if self.d_model % heads:
                raise UnsupportedModelError(f"{field}: {heads} must divide d_model {self.d_model}")
        activation(self.activation_function, "activation_function")

    @classmethod
    def tiny(cls) -> BartConfig:
        """2 + 2 layers, d_model 64, 4 heads, 128 positions, vocab 256."""
        return cls()

    @classmethod
    def from_hf(cls, hf: dict) -> BartConfig:
        """From a ``bart`` config.json (``BartForConditionalGeneration``)."""
        check_model_type(hf, ("bart",), BartForConditionalGeneration.hf_architectures)
        refuse(hf, "normalize_before", False, "pre-LayerNorm (mBART-style) blocks")
        refuse(hf, "add_final_layer_norm", False, "a final LayerNorm (mBART-style)")
        refuse(hf, "add_bias_logits", False, "a bias on the LM head")
        return cls(
            vocab_size=int(required(hf, "vocab_size")),
            d_model=int(required(hf, "d_model", "hidden_size")),
            encoder_layers=int(required(hf, "encoder_layers")),
            decoder_layers=int(required(hf, "decoder_layers")),
            encoder_attention_heads=int(required(hf, "encoder_attention_heads")),
            decoder_attention_heads=int(required(hf, "decoder_attention_heads")),
            encoder_ffn_dim=int(required(hf, "encoder_ffn_dim")),
            decoder_ffn_dim=int(required(hf, "decoder_ffn_dim")),
            activation_function=hf_field(hf, "activation_function", "gelu"),
            max_position_embeddings=int(hf_field(hf, "max_position_embeddings", 1024)),
            scale_embedding=bool(hf_field(hf, "scale_embedding", False)),
            tie_word_embeddings=bool(hf_field(hf, "tie_word_embeddings", True)),
            decoder_start_token_id=int(hf_field(hf, "decoder_start_token_id", 2)),
        )


class BartProjections(nn.Module):
    """q/k/v/out projections of one BART attention (HF names)."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model)
        self.v_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)


class BartLayer(nn.Module):
    """What encoder and decoder layers share: self-attention projections and its norm, and
    the post-LN feed-forward ``final_layer_norm(x + fc2(act(fc1(x))))``."""

    def __init__(self, d_model: int, ffn_dim: int, act: str, norm: type[nn.LayerNorm]) -> None:
        super().__init__()
        self.self_attn = BartProjections(d_model)
        self.self_attn_layer_norm = norm(d_model)
        self.fc1 = nn.Linear(d_model, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, d_model)
        self.final_layer_norm = norm(d_model)
        self.act = activation(act, "activation_function")

    def feed_forward(self, x):
        """x ``[T, d_model]`` -> ``[T, d_model]``."""
        return self.final_layer_norm(x + self.fc2(self.act(self.fc1(x))))


class BartEncoderLayer(BartLayer):
    def __init__(self, config: BartConfig) -> None:
        heads, d = config.encoder_attention_heads, config.d_model
        # Decode-only steps run the encoder on zero tokens.
        super().__init__(d, config.encoder_ffn_dim, config.activation_function, EmptySafeLayerNorm)
        self.attn = VarlenAttention(heads, d // heads, (d // heads) ** -0.5, causal=False)

    def forward(self, x, cu_seqlens):
        p = self.self_attn
        attended = self.attn(p.q_proj(x), p.k_proj(x), p.v_proj(x), cu_seqlens)
        return self.feed_forward(self.self_attn_layer_norm(x + p.out_proj(attended)))


class BartDecoderLayer(BartLayer):
    def __init__(self, config: BartConfig) -> None:
        heads, d = config.decoder_attention_heads, config.d_model
        super().__init__(d, config.decoder_ffn_dim, config.activation_function, nn.LayerNorm)
        self.encoder_attn = BartProjections(d)
        self.encoder_attn_layer_norm = nn.LayerNorm(d)
        scale = (d // heads) ** -0.5
        self.self_paged = PagedAttention(heads, heads, d // heads, scale, causal=True)
        self.cross_paged = PagedAttention(heads, heads, d // heads, scale, causal=False)

    def forward(self, x, encoder_out, caches, self_meta: PagedMetadata, cross_meta: PagedMetadata):
        key_cache, value_cache, cross_key_cache, cross_value_cache = caches
        p = self.self_attn
        attended = self.self_paged(
            p.q_proj(x), p.k_proj(x), p.v_proj(x), key_cache, value_cache, self_meta
        )
        x = self.self_attn_layer_norm(x + p.out_proj(attended))
        c = self.encoder_attn
        # The encoder tokens of this step (possibly none) enter the cross cache once.
        self.cross_paged.write(
            c.k_proj(encoder_out),
            c.v_proj(encoder_out),
            cross_key_cache,
            cross_value_cache,
            cross_meta.slot_mapping,
        )
        attended = self.cross_paged.attend(
            c.q_proj(x), cross_key_cache, cross_value_cache, cross_meta
        )
        return self.feed_forward(self.encoder_attn_layer_norm(x + c.out_proj(attended)))


class BartStack(nn.Module):
    """Embeddings (token * scale + learned position) and layers of the encoder or decoder."""

    def __init__(
        self,
        config: BartConfig,
        embed_tokens: nn.Embedding,
        layers: list,
        norm: type[nn.LayerNorm] = nn.LayerNorm,
    ) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens
        self.embed_positions = nn.Embedding(
            config.max_position_embeddings + POSITION_OFFSET, config.d_model
        )
        self.layernorm_embedding = norm(config.d_model)
        self.layers = nn.ModuleList(layers)
        self.embed_scale = math.sqrt(config.d_model) if config.scale_embedding else 1.0

    def embed(self, input_ids, positions):
        """input_ids, positions ``[T]`` int64 -> ``[T, d_model]`` normalised embeddings."""
        tokens = self.embed_tokens(input_ids) * self.embed_scale
        return self.layernorm_embedding(tokens + self.embed_positions(positions + POSITION_OFFSET))

    def encode(self, input_ids, positions, cu_seqlens):
        """The encoder stack: ``[T]`` int64 tokens and positions, ``[S + 1]`` int32 sequence
        starts -> ``[T, d_model]`` hidden states."""
        x = self.embed(input_ids, positions)
        for layer in self.layers:
            x = layer(x, cu_seqlens)
        return x


class BartBackbone(nn.Module):
    def __init__(self, config: BartConfig) -> None:
        super().__init__()
        vocab, d = config.vocab_size, config.d_model
        if config.tie_word_embeddings:
            self.shared = nn.Embedding(vocab, d)

        def embed() -> nn.Embedding:
            return self.shared if config.tie_word_embeddings else nn.Embedding(vocab, d)

        self.encoder = BartStack(
            config,
            embed(),
            [BartEncoderLayer(config) for _ in range(config.encoder_layers)],
            EmptySafeLayerNorm,
        )
        self.decoder = BartStack(
            config, embed(), [BartDecoderLayer(config) for _ in range(config.decoder_layers)]
        )


class BartForConditionalGeneration(PagedModel):
    """BART encoder-decoder on the paged KV cache (self + cross caches)."""

    config_class = BartConfig
    kind = "encoder-decoder"
    zoo_name = "bart"
    hf_model_types = ("bart",)
    hf_architectures = ("BartForConditionalGeneration",)

    def __init__(self, config: BartConfig) -> None:
        super().__init__(config)
        self.model = BartBackbone(config)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.d_model, config.vocab_size, bias=False)
        )
        self.register_buffer("final_logits_bias", torch.zeros(1, config.vocab_size))
        self.num_layers = config.decoder_layers
        self.num_heads = config.decoder_attention_heads
        self.head_size = config.d_model // config.decoder_attention_heads
        self.vocab_size = config.vocab_size
        self.max_model_len = config.max_position_embeddings
        if config.tie_word_embeddings:
            # Older checkpoints also store the tied copies.
            self.ignored_hf_weights = (
                r"model\.(encoder|decoder)\.embed_tokens\.weight",
                "lm_head.weight",
            )
        else:
            self.ignored_hf_weights = (r"model\.shared\.weight",)
        self.ignored_hf_weights += (r"model\.(encoder|decoder)\.version",)

    def optional_weights(self) -> dict[str, float]:
        return {"final_logits_bias": 0.0}

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        logits_indices: torch.Tensor,
        encoder_input_ids: torch.Tensor,
        encoder_positions: torch.Tensor,
        encoder_start_loc: torch.Tensor,
        cross_slot_mapping: torch.Tensor,
        cross_block_tables: torch.Tensor,
        encoder_seq_lens: torch.Tensor,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        """One step: encodes the sequences being admitted, then decodes the new tokens.

        Args:
            input_ids .. logits_indices: the decoder step, as for decoder-only models.
            encoder_input_ids: ``[T_enc]`` int64 encoder tokens encoded this step (may be 0).
            encoder_positions: ``[T_enc]`` int64 positions in their encoder sequences.
            encoder_start_loc: ``[S + 1]`` int32 cumulative encoder tokens per sequence.
            cross_slot_mapping: ``[T_enc]`` int64 cross-cache slots of the encoder tokens.
            cross_block_tables: ``[S, max_cross_blocks_per_seq]`` int32.
            encoder_seq_lens: ``[S]`` int32 encoder length of each sequence.
            kv_caches: ``2 * decoder_layers`` self caches then ``2 * decoder_layers`` cross
                caches, each ``[num_blocks, block_size, heads, head_size]``, written in place.

        Returns:
            ``[N, vocab_size]`` float32 logits (with ``final_logits_bias``).
        """
        layers = self.num_layers
        check_kv_caches(kv_caches, 4 * layers)
        encoder_out = self.model.encoder.encode(
            encoder_input_ids, encoder_positions, encoder_start_loc
        )

        self_meta = PagedMetadata(slot_mapping, block_tables, seq_lens, query_start_loc)
        cross_meta = PagedMetadata(
            cross_slot_mapping, cross_block_tables, encoder_seq_lens, query_start_loc
        )
        decoder = self.model.decoder
        x = decoder.embed(input_ids, positions)
        pairs = layer_caches(kv_caches)  # the self caches of every layer, then the cross caches
        for i, layer in enumerate(decoder.layers):
            caches = (*pairs[i], *pairs[layers + i])
            x = layer(x, encoder_out, caches, self_meta, cross_meta)
        x = x.index_select(0, logits_indices)
        head = self.lm_head if self.lm_head is not None else decoder.embed_tokens
        return (F.linear(x, head.weight) + self.final_logits_bias).float()

    def cache_spec(
        self, block_size: int = 16, kv_cache_dtype: torch.dtype | None = None
    ) -> CacheSpec:
        """Self caches for every decoder layer, then as many cross caches (of
        ``kv_cache_dtype``; None: the model's dtype)."""
        return CacheSpec(
            num_layers=self.num_layers,
            num_kv_heads=self.num_heads,
            head_size=self.head_size,
            dtype=kv_cache_dtype or self.dtype,
            block_size=block_size,
            num_cross_layers=self.num_layers,
        )

    def export_sample(
        self, block_size: int = 16, kv_cache_dtype: torch.dtype | None = None
    ) -> ExportSample:
        sample = sample_batch(block_size, SAMPLE_ENCODER_LENGTHS)
        metadata = sample.metadata
        device = next(self.parameters()).device
        num_encoder_tokens = int(metadata.encoder_start_loc[-1])
        args = (
            *decoder_sample_args(sample, self.vocab_size),
            torch.arange(num_encoder_tokens, dtype=torch.int64) % self.vocab_size,
            sample.encoder_positions,
            metadata.encoder_start_loc,
            metadata.cross_slot_mapping,
            metadata.cross_block_tables,
            metadata.encoder_seq_lens,
        )
        spec = self.cache_spec(block_size, kv_cache_dtype)
        caches = spec.allocate(sample.num_blocks, device)
        dims = decoder_dims()
        encoder_tokens, seqs = {0: dims["num_encoder_tokens"]}, dims["num_seqs"]
        dynamic_shapes = (
            *decoder_dynamic_shapes(dims),
            encoder_tokens,
            encoder_tokens,
            {0: seqs + 1},
            encoder_tokens,
            {0: seqs, 1: dims["max_cross_blocks_per_seq"]},
            {0: seqs},
            [{0: dims["num_blocks"]}] * spec.num_cache_tensors,
        )
        return ExportSample(
            (*(a.to(device) for a in args), caches),
            dynamic_shapes,
            (*ENCODER_DECODER_INPUT_NAMES, "kv_caches"),
        )
