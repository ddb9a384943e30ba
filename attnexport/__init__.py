"""attnexport: exportable LLM attention over a paged KV cache.

``import attnexport`` registers the ``torch.ops.attnexport`` ops and the built-in kernel
backends. Without torch it loads nothing else: the serving core (``attnexport.runtime``'s
engine and onnxruntime executor) runs without torch.
"""

from attnexport._version import __version__

try:
    import torch as _torch  # only to tell whether the torch side can load
except ImportError:
    _torch = None

if _torch is not None:
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

__all__ = ["__version__"]
if _torch is not None:
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
