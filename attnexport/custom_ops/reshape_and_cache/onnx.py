"""ONNX face of ``reshape_and_cache``: the ``attnexport.ReshapeAndCache`` node.

Its body drops padding tokens (negative slots) with ``NonZero`` + ``Gather`` and writes the rest
with one ``ScatterND`` per cache whose data input is the cache input and whose output is the
node output. When an inlined graph binds one buffer as both, onnxruntime skips the copy and the
write costs O(new tokens), not O(cache) (docs/traps.md).
"""

from __future__ import annotations

from attnexport.custom_ops.onnx_builder import FLOAT, INT8, INT64, Builder, differs, refuse_if
from attnexport.custom_ops.onnx_spec import (
    CACHE_TYPE_CONSTRAINT,
    CACHES,
    FLOAT_TYPES,
    SCALE_TYPE_CONSTRAINT,
    TOKENS,
    Attribute,
    Dim,
    OnnxOp,
    Port,
    attnexport_opset,
    scale_caches,
    traced_dims,
)

_TOKEN_DIMS = (TOKENS, "num_kv_heads", "head_size")


def _geometry(dim: Dim) -> dict[str, int]:
    return {"block_size": dim("key_cache", 1)}


def translate(
    key, value, key_cache, value_cache, slot_mapping, key_scale_cache=None, value_scale_cache=None
):
    """attnexport::reshape_and_cache_functional(Tensor key, Tensor value, Tensor key_cache,
    Tensor value_cache, Tensor slot_mapping, Tensor? key_scale_cache=None,
    Tensor? value_scale_cache=None) -> Tensor[]"""
    scales = () if key_scale_cache is None else (key_scale_cache, value_scale_cache)
    return attnexport_opset().ReshapeAndCache(
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        *scales,
        **_geometry(traced_dims(key_cache=key_cache)),
        _outputs=2 + len(scales),
    )


def body(b: Builder) -> None:
    """``attnexport.ReshapeAndCache`` over float caches in standard ops (NonZero + Gather +
    ScatterND); the rows are cast to the cache dtype (round to nearest even)."""
    index, kept = _index(b, [])
    for token, cache in (("key", "key_cache"), ("value", "value_cache")):
        rows = b.CastLike(b.Gather(token, kept, axis=0), cache)
        b.op("ScatterND", cache, index, rows, names=[f"{cache}_out"])


def scaled_body(b: Builder) -> None:
    """``attnexport.ReshapeAndCache`` over int8 caches: each (token, KV head) row x, in
    float32, is stored as ``clamp(Round(x / scale), -127, 127)`` with ``scale = max|x| / 127``
    (0 where the scale is 0) and its scale beside it (docs/ops.md, "KV cache dtypes")."""
    flags = [
        differs(b, b.Shape(scales), b.Shape(cache, end=3))
        for scales, cache in (("key_scale_cache", "key_cache"), ("value_scale_cache", "key_cache"))
    ]
    index, kept = _index(b, flags)
    for token, cache, scales in (
        ("key", "key_cache", "key_scale_cache"),
        ("value", "value_cache", "value_scale_cache"),
    ):
        rows = b.Cast(b.Gather(token, kept, axis=0), to=FLOAT)  # [T', Hkv, D]
        scale = b.Div(b.ReduceMax(b.Abs(rows), b.ints([-1]), keepdims=1), b.float_scalar(127.0))
        quantized = b.Clip(
            b.Round(b.Div(rows, scale)), b.float_scalar(-127.0), b.float_scalar(127.0)
        )
        quantized = b.Where(b.Greater(scale, b.float_scalar(0.0)), quantized, b.float_scalar(0.0))
        b.op("ScatterND", cache, index, b.Cast(quantized, to=INT8), names=[f"{cache}_out"])
        scale = b.Squeeze(scale, b.ints([-1]))  # [T', Hkv]
        b.op("ScatterND", scales, index, scale, names=[f"{scales}_out"])


def _index(b: Builder, scale_flags: list):
    """The (block, offset) index [T', 2] of the kept tokens' slots and the kept token rows
    [T'], refused unless the slots are distinct and the shapes agree (``scale_flags``: the
    scale caches' shape checks of an int8 write)."""
    block_size = b.Unsqueeze(b.attribute("block_size", "int"), b.ints([0]))
    slots = b.Cast("slot_mapping", to=INT64)
    # Rows with a slot >= 0 (Gather, not Compress: Compress's schema has no bfloat16).
    kept = b.Squeeze(b.NonZero(b.GreaterOrEqual(slots, b.ints([0]))), b.ints([0]))
    slots = b.Gather(slots, kept, axis=0)
    blocks = b.Unsqueeze(b.Div(slots, block_size), b.ints([1]))
    offsets = b.Unsqueeze(b.Mod(slots, block_size), b.ints([1]))
    index = b.Concat(blocks, offsets, axis=1)  # [T', 2] = (block, offset)
    # A slot written twice has no defined value (docs/ops.md; the torch op refuses it): as
    # many distinct slots as kept ones. Shared by every layer like the index.
    distinct = b.op("Unique", slots, outputs=4)[0]
    index = refuse_if(b, index, [differs(b, b.Shape(distinct), b.Shape(slots))], "slot_mapping")
    # The index depends on slot_mapping only (shared by every layer after inlining); the
    # shapes are per layer, so the check guards the small index both writes read: no cache
    # is written before a mismatch fails the run.
    key_shape, cache_shape = b.Shape("key"), b.Shape("key_cache")
    index = refuse_if(
        b,
        index,
        [
            differs(b, b.Shape("value"), key_shape),
            differs(b, b.Shape("value_cache"), cache_shape),
            differs(b, b.Shape("key", start=1), b.Shape("key_cache", start=2)),
            differs(b, b.Shape("key_cache", start=1, end=2), block_size),
            differs(b, b.Shape("slot_mapping"), b.Shape("key", end=1)),
            *scale_flags,
        ],
        "shapes",
    )
    return index, kept


ONNX_OPS = (
    OnnxOp(
        node="ReshapeAndCache",
        doc=(
            "Writes token t of key/value [T, Hkv, D] into the paged caches "
            "[num_blocks, block_size, Hkv, D] at slot slot_mapping[t] (block slot // block_size, "
            "offset slot % block_size); negative slots are padding and are skipped. Rows are "
            "converted to the cache dtype (round to nearest even); int8 caches store each "
            "(token, kv head) row as clamp(round(x / scale), -127, 127) with scale = "
            "max|x| / 127 written into the scale caches [num_blocks, block_size, Hkv] (inputs "
            "5, 6 and outputs 2, 3, present iff the caches are int8). The outputs are the "
            "written caches; bind each to the same buffer as its input to update in place."
        ),
        summary="Writes key/value into the paged caches; negative slots are skipped.",
        inputs=(
            Port("key", "T", "[num_tokens, num_kv_heads, head_size]", dims=_TOKEN_DIMS),
            Port("value", "T", "[num_tokens, num_kv_heads, head_size]", dims=_TOKEN_DIMS),
            *CACHES,
            Port(
                "slot_mapping",
                "S",
                "[num_tokens] cache slot per token (negative: skip)",
                dims=(TOKENS,),
            ),
            *scale_caches(names=True),
        ),
        outputs=(
            Port("key_cache_out", "C", "key_cache with the new keys written"),
            Port("value_cache_out", "C", "value_cache with the new values written"),
            Port(
                "key_scale_cache_out",
                "F",
                "key_scale_cache with the new rows' scales written (int8 caches)",
                optional=True,
                scale=True,
            ),
            Port(
                "value_scale_cache_out",
                "F",
                "value_scale_cache with the new rows' scales written (int8 caches)",
                optional=True,
                scale=True,
            ),
        ),
        type_constraints=(
            ("T", FLOAT_TYPES, "Token (key/value) dtype."),
            CACHE_TYPE_CONSTRAINT,
            ("S", ("tensor(int32)", "tensor(int64)"), "Slot index type."),
            SCALE_TYPE_CONSTRAINT,
        ),
        attributes=(Attribute("block_size", "int", "The caches' dim 1 (tokens per block)."),),
        torch_op="reshape_and_cache_functional",
        in_place_op="reshape_and_cache",
        translate=translate,
        body=body,
        scaled_body=scaled_body,
        geometry=_geometry,
    ),
)
