"""Which class implements a zoo name or a Hugging Face checkpoint, and loading either.

Zoo names give the tiny default config with seeded weights (demos, tests); a path gives the
checkpoint's own config and weights.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import torch

from models import loader
from models.base import PagedModel
from models.errors import UnsupportedModelError

# zoo name -> "module:Class"; imported on first use so that ``import models`` stays light.
_ZOO = {
    "llama": "models.llama:LlamaForCausalLM",
    "mistral": "models.mistral:MistralForCausalLM",
    "qwen2": "models.qwen2:Qwen2ForCausalLM",
    "bloom": "models.bloom:BloomForCausalLM",
    "gpt2": "models.gpt2:GPT2LMHeadModel",
    "bert": "models.bert:BertModel",
    "bart": "models.bart:BartForConditionalGeneration",
}


def zoo_names() -> list[str]:
    """The names :func:`load_model` accepts besides checkpoint paths."""
    return list(_ZOO)


def model_class(name: str) -> type[PagedModel]:
    """The class of zoo name ``name``; ValueError listing the valid names otherwise."""
    if name not in _ZOO:
        raise ValueError(f"model: unknown zoo name {name!r}; expected one of {', '.join(_ZOO)}")
    module, cls = _ZOO[name].split(":")
    return getattr(importlib.import_module(module), cls)


def model_classes() -> list[type[PagedModel]]:
    """Every zoo class, in zoo order."""
    return [model_class(name) for name in _ZOO]


def class_for_hf_config(hf_config: dict) -> type[PagedModel]:
    """The class that imports a checkpoint with this ``config.json``, chosen by ``model_type``
    (and checked against ``architectures``). Raises UnsupportedModelError naming the
    unsupported model type or architecture."""
    model_type = hf_config.get("model_type")
    architectures = hf_config.get("architectures") or []
    for cls in model_classes():
        if model_type in cls.hf_model_types:
            if architectures and not any(a in cls.hf_architectures for a in architectures):
                raise UnsupportedModelError(
                    f"architectures: {architectures} is not supported for model_type "
                    f"{model_type!r}; supported: {', '.join(cls.hf_architectures)}"
                )
            return cls
    supported = sorted(t for cls in model_classes() for t in cls.hf_model_types)
    raise UnsupportedModelError(
        f"model_type: unsupported architecture {model_type!r}"
        + (f" ({', '.join(architectures)})" if architectures else "")
        + f"; supported model types: {', '.join(supported)}"
    )


def is_checkpoint(name_or_path: str | Path) -> bool:
    """True if ``name_or_path`` is a directory (taken as a checkpoint, not a zoo name)."""
    return Path(name_or_path).is_dir()


def load_model(
    name_or_path: str | Path, *, dtype: torch.dtype = torch.float32, seed: int = 0
) -> PagedModel:
    """A zoo model by name (tiny config, weights seeded with ``seed``) or a local Hugging Face
    checkpoint directory, in ``dtype`` and eval mode."""
    if is_checkpoint(name_or_path):
        cls = class_for_hf_config(loader.read_config(name_or_path))
        return cls.from_pretrained(name_or_path, dtype=dtype)
    if str(name_or_path) not in _ZOO:
        raise ValueError(
            f"model: {str(name_or_path)!r} is neither a checkpoint directory nor a zoo name "
            f"({', '.join(_ZOO)})"
        )
    return model_class(str(name_or_path)).from_config(dtype=dtype, seed=seed)
