"""The attnexport ops layer: one slice per op (schema, fake kernel, checks, float64 reference;
``attnexport.custom_ops.<op>``), the backend registry they dispatch to, the step's attention
metadata and its per-step plan.

Importing this package registers ``torch.ops.attnexport.*``. It imports no kernel backend
(``import attnexport`` registers those) and nothing of the runtime or the lowering. The
registries below are built by iterating :data:`~.slices.OP_SLICES`.
"""

from __future__ import annotations

from attnexport.custom_ops.backend import AttentionBackend
from attnexport.custom_ops.dispatch import (
    OPS,
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
from attnexport.custom_ops.planning import StepPlan, step_plan
from attnexport.custom_ops.registry import CACHE_ARGUMENTS, OP_SPECS
from attnexport.custom_ops.slices import OP_SLICES
from attnexport.custom_ops.spec import OpSpec

__all__ = [
    "CACHE_ARGUMENTS",
    "OPS",
    "OP_SLICES",
    "OP_SPECS",
    "AttentionBackend",
    "AttentionCall",
    "AttentionMetadata",
    "BackendCapabilities",
    "BackendUnsupportedError",
    "OpSpec",
    "ScheduledSequence",
    "StepPlan",
    "build_attention_metadata",
    "current_backend_name",
    "get_backend",
    "register_backend",
    "registered_backends",
    "select_backend",
    "set_default_backend",
    "step_plan",
    "use_backend",
]
