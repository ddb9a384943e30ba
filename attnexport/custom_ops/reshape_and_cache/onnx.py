"""ONNX face of ``reshape_and_cache``: the ``attnexport.ReshapeAndCache`` node.

Its body drops padding tokens (negative slots) with ``NonZero`` + ``Gather`` and writes the rest
with one ``ScatterND`` per cache whose data input is the cache input and whose output is the
node output. When an inlined graph binds one buffer as both, onnxruntime skips the copy and the
write costs O(new tokens), not O(cache) (docs/traps.md).
"""

from __future__ import annotations

from attnexport.custom_ops.onnx_builder import INT64, Builder, differs, refuse_if
from attnexport.custom_ops.onnx_spec import (
    CACHES,
    FLOAT_TYPES,
    TOKENS,
    Attribute,
    Dim,
    OnnxOp,
    Port,
    attnexport_opset,
    traced_dims,
)

_TOKEN_DIMS = (TOKENS, "num_kv_heads", "head_size")


def _geometry(dim: Dim) -> dict[str, int]:
    return {"block_size": dim("key_cache", 1)}


def translate(key, value, key_cache, value_cache, slot_mapping):
    """attnexport::reshape_and_cache_functional(Tensor key, Tensor value, Tensor key_cache,
    Tensor value_cache, Tensor slot_mapping) -> (Tensor, Tensor)"""
    return attnexport_opset().ReshapeAndCache(
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        **_geometry(traced_dims(key_cache=key_cache)),
        _outputs=2,
    )


def body(b: Builder) -> None:
    """``attnexport.ReshapeAndCache`` in standard ops (NonZero + Gather + ScatterND)."""
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
        ],
        "shapes",
    )
    for token, cache in (("key", "key_cache"), ("value", "value_cache")):
        b.op("ScatterND", cache, index, b.Gather(token, kept, axis=0), names=[f"{cache}_out"])


ONNX_OPS = (
    OnnxOp(
        node="ReshapeAndCache",
        doc=(
            "Writes token t of key/value [T, Hkv, D] into the paged caches "
            "[num_blocks, block_size, Hkv, D] at slot slot_mapping[t] (block slot // block_size, "
            "offset slot % block_size); negative slots are padding and are skipped. The outputs "
            "are the written caches; bind each to the same buffer as its input to update in place."
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
        ),
        outputs=(
            Port("key_cache_out", "T", "key_cache with the new keys written"),
            Port("value_cache_out", "T", "value_cache with the new values written"),
        ),
        type_constraints=(
            ("T", FLOAT_TYPES, "Cache and token dtype."),
            ("S", ("tensor(int32)", "tensor(int64)"), "Slot index type."),
        ),
        attributes=(Attribute("block_size", "int", "The caches' dim 1 (tokens per block)."),),
        torch_op="reshape_and_cache_functional",
        in_place_op="reshape_and_cache",
        translate=translate,
        body=body,
        geometry=_geometry,
    ),
)
