"""The op slices. Each name is a subpackage of :mod:`attnexport.custom_ops` that holds one op
whole: its ``__init__`` the torch face (schema, fake kernel, checks, float64 reference, the typed
call a backend receives) and its ``onnx`` module the ONNX face (node schema, translation from
the torch op, standard-op function body, native-kernel geometry). The registries of both faces
are built by iterating this tuple, so adding an op is one folder plus its name here."""

from __future__ import annotations

OP_SLICES: tuple[str, ...] = (
    "reshape_and_cache",
    "paged_attention",
    "varlen_attention",
    "rotary_embedding",
    "qkv_rotary_embedding",
    "silu_and_mul",
    "fused_add_rms_norm",
)
