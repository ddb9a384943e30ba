"""Reading fields of a Hugging Face ``config.json`` dict with the defaults transformers uses,
and refusing the options the zoo does not implement with a message naming them."""

from __future__ import annotations

from typing import Any

from attnexport.models.errors import UnsupportedModelError


def field(hf: dict, name: str, default: Any = None, *aliases: str) -> Any:
    """``hf[name]`` (or the first alias present), ``default`` when absent or null."""
    for key in (name, *aliases):
        if hf.get(key) is not None:
            return hf[key]
    return default


def required(hf: dict, name: str, *aliases: str) -> Any:
    """``hf[name]`` (or an alias); UnsupportedModelError when absent."""
    value = field(hf, name, None, *aliases)
    if value is None:
        raise UnsupportedModelError(f"config.json: missing required field {name!r}")
    return value


def check_model_type(hf: dict, model_types: tuple[str, ...], architectures: tuple[str, ...]):
    """Raises UnsupportedModelError unless ``hf`` declares one of ``model_types`` and, when it
    lists ``architectures``, one of ``architectures``."""
    model_type = hf.get("model_type")
    if model_type not in model_types:
        raise UnsupportedModelError(
            f"model_type: expected {' or '.join(map(repr, model_types))}, got {model_type!r}"
        )
    declared = hf.get("architectures") or []
    if declared and not any(a in architectures for a in declared):
        raise UnsupportedModelError(
            f"architectures: {declared} is not supported for model_type {model_type!r}; "
            f"supported: {', '.join(architectures)}"
        )


def refuse(hf: dict, name: str, allowed: Any, why: str = "") -> None:
    """Raises UnsupportedModelError if ``hf[name]`` is set to something other than
    ``allowed`` (a value or a tuple of values; null always passes)."""
    value = hf.get(name)
    options = allowed if isinstance(allowed, tuple) else (allowed,)
    if value is not None and value not in options:
        expected = " or ".join(repr(o) for o in options)
        suffix = f": {why}" if why else ""
        raise UnsupportedModelError(
            f"{name}: unsupported value {value!r} (supported: {expected}){suffix}"
        )
