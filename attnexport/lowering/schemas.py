"""The ``attnexport`` ONNX domain: operator schemas of its nodes (version 1).

:func:`register_schemas` adds them to ``onnx.defs`` (idempotent), which the ONNX translation
and ``onnx.checker`` need. The nodes implement docs/ops.md; their standard-op
function bodies are in :mod:`attnexport.lowering.bodies`.
"""

from __future__ import annotations

import functools

import onnx
from onnx.defs import OpSchema

from attnexport.model_props import DOMAIN, DOMAIN_VERSION

FLOAT_TYPES = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)", "tensor(double)"]

_Single = OpSchema.FormalParameterOption.Single
_Optional = OpSchema.FormalParameterOption.Optional


def _param(name: str, type_str: str, doc: str, optional: bool = False) -> OpSchema.FormalParameter:
    return OpSchema.FormalParameter(
        name, type_str, doc, param_option=_Optional if optional else _Single
    )


def _default(name: str, value: float | int) -> OpSchema.Attribute:
    return OpSchema.Attribute(name, onnx.helper.make_attribute(name, value), _ATTR_DOCS[name])


_ATTR_DOCS = {
    "scale": "Multiplies q . k.",
    "causal": "1: query at position p sees keys k <= p (bottom-right aligned); 0: all keys.",
    "sliding_window": "If >= 0, key k is visible only when p - k < sliding_window; -1: no window.",
    "logits_soft_cap": "If > 0, logits become cap * tanh(logits / cap) (before ALiBi); 0: off.",
    "num_heads": "H: the query's dim 1.",
    "num_kv_heads": "Hkv: the heads dim of the keys (of the caches).",
    "head_size": "D: the query's dim 2.",
    "block_size": "The caches' dim 1 (tokens per block).",
}
# The geometry attributes repeat static input dims (the exporter sets them from the shapes). As
# constants they let onnxruntime compute the bodies' per-step index arithmetic once for all
# layers; read with Shape, it would be computed per layer.
_GEOMETRY = ("num_heads", "num_kv_heads", "head_size")


def _required_int(name: str) -> OpSchema.Attribute:
    return OpSchema.Attribute(name, OpSchema.AttrType.INT, _ATTR_DOCS[name], required=True)


def _mask_attributes(causal_default: int, geometry: tuple[str, ...]) -> list[OpSchema.Attribute]:
    return [
        OpSchema.Attribute("scale", OpSchema.AttrType.FLOAT, _ATTR_DOCS["scale"]),
        _default("causal", causal_default),
        _default("sliding_window", -1),
        _default("logits_soft_cap", 0.0),
        *(_required_int(name) for name in geometry),
    ]


_ALIBI_DOC = (
    "[num_heads] float32 ALiBi slopes: adds slope[h] * (k - p) after the soft cap. The exporter "
    "always supplies it (zeros for a model without ALiBi), because ONNX function bodies cannot "
    "test for an omitted input."
)


def reshape_and_cache_schema() -> OpSchema:
    return OpSchema(
        "ReshapeAndCache",
        DOMAIN,
        DOMAIN_VERSION,
        doc=(
            "Writes token t of key/value [T, Hkv, D] into the paged caches "
            "[num_blocks, block_size, Hkv, D] at slot slot_mapping[t] (block slot // block_size, "
            "offset slot % block_size); negative slots are padding and are skipped. The outputs "
            "are the written caches; bind each to the same buffer as its input to update in place."
        ),
        inputs=[
            _param("key", "T", "[num_tokens, num_kv_heads, head_size]"),
            _param("value", "T", "[num_tokens, num_kv_heads, head_size]"),
            _param("key_cache", "T", "[num_blocks, block_size, num_kv_heads, head_size]"),
            _param("value_cache", "T", "[num_blocks, block_size, num_kv_heads, head_size]"),
            _param("slot_mapping", "S", "[num_tokens] cache slot per token (negative: skip)"),
        ],
        outputs=[
            _param("key_cache_out", "T", "key_cache with the new keys written"),
            _param("value_cache_out", "T", "value_cache with the new values written"),
        ],
        type_constraints=[
            ("T", FLOAT_TYPES, "Cache and token dtype."),
            ("S", ["tensor(int32)", "tensor(int64)"], "Slot index type."),
        ],
        attributes=[_required_int("block_size")],
    )


def paged_attention_schema() -> OpSchema:
    return OpSchema(
        "PagedAttention",
        DOMAIN,
        DOMAIN_VERSION,
        doc=(
            "Attention of packed ragged queries over a paged KV cache: prefill, decode, chunked "
            "prefill, mixed batches and non-causal cross-attention. The q_i queries of sequence "
            "i are its last positions: query j sits at p = seq_lens[i] - q_i + j. Key "
            "k < seq_lens[i] is visible iff (not causal or k <= p) and (sliding_window < 0 or "
            "p - k < sliding_window). A query that sees no key outputs zeros."
        ),
        inputs=[
            _param("query", "T", "[num_tokens, num_heads, head_size]"),
            _param("key_cache", "T", "[num_blocks, block_size, num_kv_heads, head_size]"),
            _param("value_cache", "T", "[num_blocks, block_size, num_kv_heads, head_size]"),
            _param("block_tables", "I", "[num_seqs, max_blocks_per_seq] int32"),
            _param("seq_lens", "I", "[num_seqs] int32, cached + new tokens per sequence"),
            _param("query_start_loc", "I", "[num_seqs + 1] int32 cumulative query counts"),
            _param("alibi_slopes", "A", _ALIBI_DOC, optional=True),
        ],
        outputs=[_param("output", "T", "[num_tokens, num_heads, head_size]")],
        type_constraints=[
            ("T", FLOAT_TYPES, "Query and cache dtype."),
            ("I", ["tensor(int32)"], "Index type."),
            ("A", ["tensor(float)"], "ALiBi slope type."),
        ],
        attributes=_mask_attributes(1, (*_GEOMETRY, "block_size")),
    )


def varlen_attention_schema() -> OpSchema:
    return OpSchema(
        "VarlenAttention",
        DOMAIN,
        DOMAIN_VERSION,
        doc=(
            "Attention over packed ragged sequences without a cache (encoders, cross-attention at "
            "prefill). Query j of a sequence with q queries and k keys sits at p = k - q + j "
            "(bottom-right); masking as in PagedAttention."
        ),
        inputs=[
            _param("query", "T", "[num_query_tokens, num_heads, head_size]"),
            _param("key", "T", "[num_key_tokens, num_kv_heads, head_size]"),
            _param("value", "T", "[num_key_tokens, num_kv_heads, head_size]"),
            _param("cu_seqlens_q", "I", "[num_seqs + 1] int32 cumulative query lengths"),
            _param("cu_seqlens_k", "I", "[num_seqs + 1] int32 cumulative key lengths"),
            _param("alibi_slopes", "A", _ALIBI_DOC, optional=True),
        ],
        outputs=[_param("output", "T", "[num_query_tokens, num_heads, head_size]")],
        type_constraints=[
            ("T", FLOAT_TYPES, "Query and key dtype."),
            ("I", ["tensor(int32)"], "Index type."),
            ("A", ["tensor(float)"], "ALiBi slope type."),
        ],
        attributes=_mask_attributes(0, _GEOMETRY),
    )


def rotary_embedding_schema() -> OpSchema:
    return OpSchema(
        "NeoxRotaryEmbedding",
        DOMAIN,
        DOMAIN_VERSION,
        doc=(
            "Rotary position embedding in the rotate-half (GPT-NeoX) layout: output = x * cos + "
            "rotate_half(x) * sin, rotate_half(x) = concat(-x[..., D/2:], x[..., :D/2]), with "
            "the [num_tokens, head_size] tables broadcast over the heads."
        ),
        inputs=[
            _param("x", "T", "[num_tokens, num_heads, head_size], head_size even"),
            _param("cos", "T", "[num_tokens, head_size] cosines of each token's angles"),
            _param("sin", "T", "[num_tokens, head_size] sines of each token's angles"),
        ],
        outputs=[_param("output", "T", "[num_tokens, num_heads, head_size]")],
        type_constraints=[("T", FLOAT_TYPES, "Input and table dtype.")],
    )


def qkv_rotary_embedding_schema() -> OpSchema:
    return OpSchema(
        "NeoxQKVRotaryEmbedding",
        DOMAIN,
        DOMAIN_VERSION,
        doc=(
            "The heads of a fused q/k/v projection [num_tokens, (num_heads + 2 * num_kv_heads) "
            "* head_size]: query = its first num_heads heads, key the next num_kv_heads, value "
            "the last num_kv_heads, query and key rotated as by NeoxRotaryEmbedding."
        ),
        inputs=[
            _param("qkv", "T", "[num_tokens, (num_heads + 2 * num_kv_heads) * head_size]"),
            _param("cos", "T", "[num_tokens, head_size] cosines of each token's angles"),
            _param("sin", "T", "[num_tokens, head_size] sines of each token's angles"),
        ],
        outputs=[
            _param("query", "T", "[num_tokens, num_heads, head_size], rotated"),
            _param("key", "T", "[num_tokens, num_kv_heads, head_size], rotated"),
            _param("value", "T", "[num_tokens, num_kv_heads, head_size]"),
        ],
        type_constraints=[("T", FLOAT_TYPES, "Input and table dtype.")],
        attributes=[_required_int(name) for name in _GEOMETRY],
    )


def silu_and_mul_schema() -> OpSchema:
    return OpSchema(
        "SiluAndMul",
        DOMAIN,
        DOMAIN_VERSION,
        doc=(
            "SwiGLU's gate of a fused gate/up projection: output = silu(x[:, :d]) * x[:, d:] with "
            "silu(g) = g * sigmoid(g)."
        ),
        inputs=[_param("x", "T", "[num_tokens, 2 * d]: the gate half, then the up half")],
        outputs=[_param("output", "T", "[num_tokens, d]")],
        type_constraints=[("T", FLOAT_TYPES, "Input and output dtype.")],
    )


def fused_add_rms_norm_schema() -> OpSchema:
    return OpSchema(
        "FusedAddRMSNorm",
        DOMAIN,
        DOMAIN_VERSION,
        doc=(
            "A residual add and Llama's RMSNorm: residual_out = x + residual (in T); output = "
            "weight * T(t / sqrt(mean(t^2 over the last axis) + epsilon)), t = residual_out in "
            "float32."
        ),
        inputs=[
            _param("x", "T", "[num_tokens, hidden] the block's output"),
            _param("residual", "T", "[num_tokens, hidden] the residual stream"),
            _param("weight", "T", "[hidden] the norm's scale"),
        ],
        outputs=[
            _param("output", "T", "[num_tokens, hidden] the normalized sum"),
            _param("residual_out", "T", "[num_tokens, hidden] x + residual"),
        ],
        type_constraints=[("T", FLOAT_TYPES, "Input and output dtype.")],
        attributes=[
            OpSchema.Attribute("epsilon", OpSchema.AttrType.FLOAT, "Added to the mean square.")
        ],
    )


@functools.cache
def register_schemas() -> None:
    """Registers the attnexport schemas with ``onnx.defs`` once per process.

    A name must not be a standard op's (ONNX 23 has ``RotaryEmbedding``): ``onnx.reference``,
    which onnxscript imports, refuses two schemas of one name in different domains, so the
    import of onnxscript would fail in any process that registered first."""
    schemas = (
        reshape_and_cache_schema(),
        paged_attention_schema(),
        varlen_attention_schema(),
        rotary_embedding_schema(),
        qkv_rotary_embedding_schema(),
        silu_and_mul_schema(),
        fused_add_rms_norm_schema(),
    )
    for schema in schemas:
        if onnx.defs.has(schema.name, ""):
            raise ValueError(f"attnexport node {schema.name}: a standard ONNX op has this name")
        if not onnx.defs.has(schema.name, schema.domain):
            onnx.defs.register_schema(schema)
