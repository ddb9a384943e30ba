"""BERT encoder: padding-free ragged batches through ``attnexport::varlen_attention``
(non-causal), learned absolute positions, token types, post-LayerNorm blocks.

Forward (the encoder-only convention of ``attnexport.model_interface``)::

    forward(input_ids [T] int64, positions [T] int64, cu_seqlens [S + 1] int32,
            token_type_ids [T] int64 | None) -> hidden states [T, hidden] (model dtype)

There is no cache. :class:`SentenceEmbedder` adds mean (or CLS) pooling per sequence and an
optional L2 normalisation, as sentence-transformers models such as all-MiniLM-L6-v2 use.

Any ``Bert*`` checkpoint loads: the encoder is used, task heads (``cls.*``, ``classifier.*``,
``qa_outputs.*``) and the NSP pooler are not part of this model and are ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from attnexport.model_interface import ENCODER_INPUT_NAMES, CacheSpec
from attnexport.models.base import ExportSample, ModelConfig, PagedModel
from attnexport.models.errors import UnsupportedModelError
from attnexport.models.hf_config import check_model_type, refuse, required
from attnexport.models.hf_config import field as hf_field
from attnexport.models.layers import VarlenAttention, activation

BERT_ARCHITECTURES = (
    "BertModel",
    "BertForMaskedLM",
    "BertForPreTraining",
    "BertForSequenceClassification",
    "BertForTokenClassification",
    "BertForQuestionAnswering",
    "BertForNextSentencePrediction",
    "BertForMultipleChoice",
)


@dataclass(frozen=True)
class BertConfig(ModelConfig):
    """BERT hyper-parameters (field names follow transformers' BertConfig)."""

    vocab_size: int = 256
    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    intermediate_size: int = 128
    hidden_act: str = "gelu"
    max_position_embeddings: int = 128
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise UnsupportedModelError(
                f"num_attention_heads: {self.num_attention_heads} must divide hidden_size "
                f"{self.hidden_size}"
            )
        activation(self.hidden_act)

    @classmethod
    def tiny(cls) -> BertConfig:
        """2 layers, hidden 64, 4 heads, 128 positions, vocab 256."""
        return cls()

    @classmethod
    def from_hf(cls, hf: dict) -> BertConfig:
        """From a ``bert`` config.json."""
        check_model_type(hf, ("bert",), BERT_ARCHITECTURES)
        refuse(hf, "position_embedding_type", "absolute", "relative position embeddings")
        refuse(hf, "is_decoder", False, "BERT as a causal decoder is not implemented")
        refuse(hf, "add_cross_attention", False, "BERT cross-attention is not implemented")
        return cls(
            vocab_size=int(required(hf, "vocab_size")),
            hidden_size=int(required(hf, "hidden_size")),
            num_hidden_layers=int(required(hf, "num_hidden_layers")),
            num_attention_heads=int(required(hf, "num_attention_heads")),
            intermediate_size=int(required(hf, "intermediate_size")),
            hidden_act=hf_field(hf, "hidden_act", "gelu"),
            max_position_embeddings=int(hf_field(hf, "max_position_embeddings", 512)),
            type_vocab_size=int(hf_field(hf, "type_vocab_size", 2)),
            layer_norm_eps=float(hf_field(hf, "layer_norm_eps", 1e-12)),
        )


class BertEmbeddings(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids, positions, token_type_ids):
        x = self.word_embeddings(input_ids)
        if token_type_ids is None:
            x = x + self.token_type_embeddings.weight[0]
        else:
            x = x + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(x + self.position_embeddings(positions))


class BertSelfAttention(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        dim = hidden // heads
        self.attn = VarlenAttention(heads, dim, dim**-0.5, causal=False)

    def forward(self, x, cu_seqlens):
        return self.attn(self.query(x), self.key(x), self.value(x), cu_seqlens)


class BertDenseNorm(nn.Module):
    """``LayerNorm(dense(x) + residual)``: BERT's "output" sublayers."""

    def __init__(self, inputs: int, hidden: int, eps: float) -> None:
        super().__init__()
        self.dense = nn.Linear(inputs, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=eps)

    def forward(self, x, residual):
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertDenseNorm(config.hidden_size, config.hidden_size, config.layer_norm_eps)


class BertIntermediate(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = activation(config.hidden_act)

    def forward(self, x):
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertDenseNorm(
            config.intermediate_size, config.hidden_size, config.layer_norm_eps
        )

    def forward(self, x, cu_seqlens):
        x = self.attention.output(self.attention.self(x, cu_seqlens), x)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))


class BertModel(PagedModel):
    """The BERT encoder on ``varlen_attention``: packed ragged sequences, no padding."""

    config_class = BertConfig
    kind = "encoder"
    zoo_name = "bert"
    hf_model_types = ("bert",)
    hf_architectures = BERT_ARCHITECTURES
    ignored_hf_weights = (
        r"(bert\.)?pooler\..*",
        r"(bert\.)?embeddings\.position_ids",
        r"(cls|classifier|qa_outputs)\..*",
    )

    def __init__(self, config: BertConfig) -> None:
        super().__init__(config)
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)
        self.max_model_len = config.max_position_embeddings

    def hf_weight_names(self, name: str) -> tuple[str, ...]:
        # BertModel saves without a prefix, the task models under "bert."; very old
        # checkpoints name LayerNorm parameters gamma/beta.
        legacy = name.replace("LayerNorm.weight", "LayerNorm.gamma").replace(
            "LayerNorm.bias", "LayerNorm.beta"
        )
        return (name, f"bert.{name}", legacy, f"bert.{legacy}")

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cu_seqlens: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Encodes packed ragged sequences.

        Args:
            input_ids: ``[T]`` int64, the tokens of every sequence, packed.
            positions: ``[T]`` int64, the position of each token in its sequence.
            cu_seqlens: ``[S + 1]`` int32 cumulative sequence lengths.
            token_type_ids: ``[T]`` int64 segment ids, or None for all zeros.

        Returns:
            ``[T, hidden_size]`` last hidden states, in the model dtype.
        """
        x = self.embeddings(input_ids, positions, token_type_ids)
        for layer in self.encoder.layer:
            x = layer(x, cu_seqlens)
        return x

    def cache_spec(self, block_size: int = 16, kv_cache_dtype=None) -> CacheSpec:
        """No cache: ``num_layers == 0`` (kept for a uniform interface)."""
        heads = self.config.num_attention_heads
        return CacheSpec(0, heads, self.config.hidden_size // heads, self.dtype, block_size)

    def export_sample(self, block_size: int = 16, kv_cache_dtype=None) -> ExportSample:
        """Two sequences of 3 and 4 tokens (num_tokens 7, num_seqs 2); ``block_size`` unused."""
        from torch.export import Dim

        lengths = (3, 4)
        device = next(self.parameters()).device
        num_tokens = sum(lengths)
        args = (
            torch.arange(num_tokens, dtype=torch.int64, device=device) % self.config.vocab_size,
            torch.cat([torch.arange(n) for n in lengths]).to(device),
            offsets_of(lengths, device),
            torch.tensor([0, 0, 0, 0, 1, 1, 1], dtype=torch.int64, device=device),
        )
        tokens, seqs = Dim("num_tokens", min=1), Dim("num_seqs", min=1)
        dynamic = ({0: tokens}, {0: tokens}, {0: seqs + 1}, {0: tokens})
        return ExportSample(args, dynamic, ENCODER_INPUT_NAMES)


def offsets_of(lengths, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[S + 1]`` int32 cumulative offsets of sequence ``lengths``."""
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + int(n))
    return torch.tensor(offsets, dtype=torch.int32, device=device)


def pool(
    hidden: torch.Tensor, cu_seqlens: torch.Tensor, mode: str = "mean", normalize: bool = False
) -> torch.Tensor:
    """Per-sequence pooling of packed hidden states.

    Args:
        hidden: ``[T, H]`` hidden states of packed sequences.
        cu_seqlens: ``[S + 1]`` int32 cumulative lengths.
        mode: ``"mean"`` (average of the sequence's tokens) or ``"cls"`` (its first token).
        normalize: L2-normalise each embedding.

    Returns:
        ``[S, H]`` float32. Uses a ``[S, T]`` membership matrix (no data-dependent shapes), so
        it exports to ONNX as plain ops.
    """
    starts, ends = cu_seqlens[:-1, None].long(), cu_seqlens[1:, None].long()
    token = torch.arange(hidden.shape[0], device=hidden.device)[None, :]
    if mode == "mean":
        member = ((token >= starts) & (token < ends)).float()
        counts = (ends - starts).clamp(min=1).float()
        pooled = (member @ hidden.float()) / counts
    elif mode == "cls":
        pooled = ((token == starts) & (starts < ends)).float() @ hidden.float()
    else:
        raise ValueError(f"mode: expected 'mean' or 'cls', got {mode!r}")
    if normalize:
        pooled = torch.nn.functional.normalize(pooled, p=2.0, dim=-1)
    return pooled


class SentenceEmbedder(nn.Module):
    """An encoder followed by :func:`pool`: ``forward(input_ids, positions, cu_seqlens,
    token_type_ids) -> [S, hidden]`` float32 sentence embeddings."""

    def __init__(self, encoder: BertModel, mode: str = "mean", normalize: bool = False):
        super().__init__()
        if mode not in ("mean", "cls"):
            raise ValueError(f"mode: expected 'mean' or 'cls', got {mode!r}")
        self.encoder, self.mode, self.normalize = encoder, mode, normalize

    def forward(self, input_ids, positions, cu_seqlens, token_type_ids=None) -> torch.Tensor:
        """Shapes as in :meth:`BertModel.forward`; returns ``[S, hidden]`` float32."""
        hidden = self.encoder(input_ids, positions, cu_seqlens, token_type_ids)
        return pool(hidden, cu_seqlens, self.mode, self.normalize)

    def export_sample(self, block_size: int = 16) -> ExportSample:
        return self.encoder.export_sample(block_size)
