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

__all__ = ["__version__"]
if _torch is not None:
    from attnexport import backends as _backends  # noqa: F401  (registers the backends)
    from attnexport.backends.block_copy import copy_blocks, swap_blocks
    from attnexport.custom_ops import (
        AttentionMetadata,
        BackendUnsupportedError,
        ScheduledSequence,
        build_attention_metadata,
        set_default_backend,
        use_backend,
    )
    from attnexport.custom_ops.fused_add_rms_norm import fused_add_rms_norm
    from attnexport.custom_ops.paged_attention import paged_attention
    from attnexport.custom_ops.qkv_rotary_embedding import qkv_rotary_embedding
    from attnexport.custom_ops.reshape_and_cache import (
        reshape_and_cache,
        reshape_and_cache_functional,
    )
    from attnexport.custom_ops.rotary_embedding import rotary_embedding
    from attnexport.custom_ops.silu_and_mul import silu_and_mul
    from attnexport.custom_ops.varlen_attention import varlen_attention

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
