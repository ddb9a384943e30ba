"""The attnexport ops: schemas, fake kernels, validation, reference semantics and dispatch.

Importing this package registers ``torch.ops.attnexport.*``.
"""

from attnexport.custom_ops.dispatch import (
    AttentionBackend,
    AttentionCall,
    BackendCapabilities,
    BackendUnsupportedError,
    current_backend_name,
    get_backend,
    register_backend,
    registered_backends,
    select_backend,
    set_default_backend,
    use_backend,
)
from attnexport.custom_ops.metadata import (
    AttentionMetadata,
    ScheduledSequence,
    build_attention_metadata,
)
from attnexport.custom_ops.ops import (
    fused_add_rms_norm,
    paged_attention,
    qkv_rotary_embedding,
    reshape_and_cache,
    reshape_and_cache_functional,
    rotary_embedding,
    silu_and_mul,
    varlen_attention,
)
from attnexport.custom_ops.planning import StepPlan, step_plan

__all__ = [
    "AttentionBackend",
    "AttentionCall",
    "AttentionMetadata",
    "BackendCapabilities",
    "BackendUnsupportedError",
    "ScheduledSequence",
    "StepPlan",
    "build_attention_metadata",
    "current_backend_name",
    "fused_add_rms_norm",
    "get_backend",
    "paged_attention",
    "qkv_rotary_embedding",
    "register_backend",
    "registered_backends",
    "reshape_and_cache",
    "reshape_and_cache_functional",
    "rotary_embedding",
    "select_backend",
    "set_default_backend",
    "silu_and_mul",
    "step_plan",
    "use_backend",
    "varlen_attention",
]
