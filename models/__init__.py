"""The attnexport model zoo: architectures written on the attnexport ops, importable from
local Hugging Face checkpoints::

    from attnexport.models import load_model
    model = load_model("llama")                    # tiny config, seeded weights ("zoo:llama")
    model = load_model("/path/to/hf_checkpoint")   # config.json + *.safetensors
    sample = model.export_sample(block_size=16)     # args + dynamic shapes for torch.export
    program = sample.export(model)

See ``docs/models.md`` for the architectures, the Hugging Face configs they import and the
options they refuse.
"""

from attnexport.models.base import ExportSample, PagedModel
from attnexport.models.errors import CheckpointError, ModelRefError, UnsupportedModelError
from attnexport.models.registry import (
    class_for_hf_config,
    load_checkpoint,
    load_model,
    load_zoo_model,
    model_class,
    resolve_model_ref,
    zoo_names,
)

__all__ = [
    "CheckpointError",
    "ExportSample",
    "ModelRefError",
    "PagedModel",
    "UnsupportedModelError",
    "class_for_hf_config",
    "load_checkpoint",
    "load_model",
    "load_zoo_model",
    "model_class",
    "resolve_model_ref",
    "zoo_names",
]
