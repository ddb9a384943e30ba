"""Which class implements a zoo name or a Hugging Face checkpoint, and loading either.

Zoo names give the tiny default config with seeded weights (demos, tests); a path gives the
checkpoint's own config and weights.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import torch

from attnexport.models import loader
from attnexport.models.base import PagedModel
from attnexport.models.errors import ModelRefError, UnsupportedModelError

# zoo name -> "module:Class"; imported on first use so that ``import attnexport.models``
# stays light.
_ZOO = {
    "llama": "attnexport.models.llama:LlamaForCausalLM",
    "mistral": "attnexport.models.mistral:MistralForCausalLM",
    "qwen2": "attnexport.models.qwen2:Qwen2ForCausalLM",
    "qwen3": "attnexport.models.qwen3:Qwen3ForCausalLM",
    "gemma2": "attnexport.models.gemma:Gemma2ForCausalLM",
    "gemma3": "attnexport.models.gemma:Gemma3ForCausalLM",
    "phi3": "attnexport.models.phi3:Phi3ForCausalLM",
    "bloom": "attnexport.models.bloom:BloomForCausalLM",
    "gpt2": "attnexport.models.gpt2:GPT2LMHeadModel",
    "bert": "attnexport.models.bert:BertModel",
    "bart": "attnexport.models.bart:BartForConditionalGeneration",
}


def zoo_names() -> list[str]:
    """The names :func:`load_model` accepts besides checkpoint paths."""
    return list(_ZOO)


def model_class(name: str) -> type[PagedModel]:
    """The class of zoo name ``name``; ModelRefError listing the valid names otherwise."""
    if name not in _ZOO:
        raise ModelRefError(f"model: unknown zoo name {name!r}; expected one of {', '.join(_ZOO)}")
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


ZOO_PREFIX = "zoo:"


def resolve_model_ref(ref: str | Path) -> tuple[str, str | Path]:
    """``("zoo", name)`` or ``("checkpoint", directory)`` for a model reference.

    ``zoo:NAME`` is always the zoo model; a reference with a path separator, or starting with
    ``.`` or ``~``, is always a checkpoint directory. A bare name is the zoo model of that name
    unless a checkpoint directory (one with ``config.json``) of that name exists in the working
    directory, which is refused as ambiguous: the reference must say which it means.

    Raises:
        ModelRefError: an unknown zoo name, a path that is not a directory, or an ambiguous
            bare name.
    """
    text = str(ref)
    if text.startswith(ZOO_PREFIX):
        name = text[len(ZOO_PREFIX) :]
        if name not in _ZOO:
            raise ModelRefError(
                f"model: unknown zoo name {name!r}; expected one of {', '.join(_ZOO)}"
            )
        return "zoo", name
    path = Path(text).expanduser()
    pathlike = isinstance(ref, Path) or "/" in text or os.sep in text or text[:1] in (".", "~")
    if text in _ZOO and not isinstance(ref, Path):
        if (path / "config.json").is_file():
            raise ModelRefError(
                f"model: {text!r} is both a zoo model and the checkpoint directory ./{text}; "
                f"write {ZOO_PREFIX}{text} for the zoo model or ./{text} for the checkpoint"
            )
        return "zoo", text
    if path.is_dir():
        return "checkpoint", path
    if pathlike:
        raise ModelRefError(
            f"model: {text} is not a directory, so neither a checkpoint directory nor a zoo "
            f"name (a checkpoint directory has config.json; zoo names: {', '.join(_ZOO)}, "
            f"or {ZOO_PREFIX}NAME)"
        )
    raise ModelRefError(
        f"model: {text!r} is neither a checkpoint directory nor a zoo name ({', '.join(_ZOO)})"
    )


def is_checkpoint(name_or_path: str | Path) -> bool:
    """True if ``name_or_path`` resolves to a checkpoint directory (see
    :func:`resolve_model_ref`)."""
    return resolve_model_ref(name_or_path)[0] == "checkpoint"


def load_zoo_model(name: str, *, dtype: torch.dtype = torch.float32, seed: int = 0) -> PagedModel:
    """Zoo model ``name``: its tiny config with weights seeded ``seed``, in ``dtype``."""
    return model_class(name).from_config(dtype=dtype, seed=seed)


IMPLS = ("auto", "zoo", "transformers")
"""How a checkpoint is loaded: ``zoo`` (the zoo's own network), ``transformers`` (transformers'
model with its attention on the paged ops, :mod:`attnexport.models.generic`), or ``auto``: the
zoo when it implements the family and the config's options, else transformers."""


def load_checkpoint(
    path: str | Path, *, dtype: torch.dtype = torch.float32, impl: str = "auto"
) -> PagedModel:
    """The local Hugging Face checkpoint directory ``path``, in ``dtype`` and eval mode, by
    ``impl`` (one of :data:`IMPLS`); the model's ``impl`` says which loaded it.

    Raises:
        UnsupportedModelError: neither implementation can load it (``auto``: the message gives
            both reasons), or the chosen one cannot.
    """
    if impl not in IMPLS:
        raise ModelRefError(f"impl: expected one of {', '.join(IMPLS)}, got {impl!r}")
    if impl == "transformers":
        return _load_transformers(path, dtype)
    try:
        cls = class_for_hf_config(loader.read_config(path))
        model = cls.from_pretrained(path, dtype=dtype)
    except UnsupportedModelError as zoo_refusal:
        if impl == "zoo":
            raise
        try:
            model = _load_transformers(path, dtype)
        except UnsupportedModelError as refusal:
            raise UnsupportedModelError(f"{refusal} (the zoo: {zoo_refusal})") from None
        model.zoo_refusal = str(zoo_refusal)
    return model


def _load_transformers(path: str | Path, dtype: torch.dtype) -> PagedModel:
    from attnexport.models.generic import load_transformers_checkpoint

    return load_transformers_checkpoint(path, dtype=dtype)


def load_model(
    name_or_path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    impl: str = "auto",
) -> PagedModel:
    """A zoo model by name (tiny config, weights seeded with ``seed``) or a local Hugging Face
    checkpoint directory (loaded by ``impl``, see :func:`load_checkpoint`), in ``dtype`` and
    eval mode; see :func:`resolve_model_ref` for how a reference is read."""
    kind, ref = resolve_model_ref(name_or_path)
    if kind == "checkpoint":
        return load_checkpoint(ref, dtype=dtype, impl=impl)
    return load_zoo_model(str(ref), dtype=dtype, seed=seed)
