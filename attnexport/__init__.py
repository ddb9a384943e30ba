"""attnexport: exportable LLM attention over a paged KV cache.

``import attnexport`` registers the ``torch.ops.attnexport`` ops and the built-in kernel
backends.
"""

from attnexport._version import __version__
from attnexport.custom_ops import (
    AttentionMetadata,
    BackendUnsupportedError,
    ScheduledSequence,
    build_attention_metadata,
    fused_add_rms_norm,
    paged_attention,
    qkv_rotary_embedding,
    reshape_and_cache,
    reshape_and_cache_functional,
    rotary_embedding,
    set_default_backend,
    silu_and_mul,
    use_backend,
    varlen_attention,
)
from attnexport.runtime import backends as _backends  # noqa: F401  (registers the backends)
from attnexport.runtime.block_copy import copy_blocks, swap_blocks

__all__ = [
    "AttentionMetadata",
    "BackendUnsupportedError",
    "ScheduledSequence",
    "__version__",
    "build_attention_metadata",
    "copy_blocks",
    "fused_add_rms_norm",
    "paged_attention",
    "qkv_rotary_embedding",
    "reshape_and_cache",
    "reshape_and_cache_functional",
    "rotary_embedding",
    "set_default_backend",
    "silu_and_mul",
    "swap_blocks",
    "use_backend",
    "varlen_attention",
]
