"""The values the CLI's flags accept, each taken from the registry that owns it (never a copy),
so that a new backend, target, dtype or executor reaches the command line by itself."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from attnexport.artifact import DTYPE_NAMES, EXECUTORS, FORMATS
from attnexport.errors import installed

TORCH_EXTRA = "export"
"""The extra that installs torch (and the rest of what exporting needs)."""


class RegistryChoices(Sequence):
    """A flag's choices read from a registry the first time argparse needs them (checking a
    value, writing ``--help``), so that building the parser imports no registry that is slow
    to load (the lowering) for the commands that never use it. The flag needs a
    ``metavar``: without one, ``add_argument`` formats the choices at once."""

    def __init__(self, read: Callable[[], Sequence[str]]) -> None:
        self._read = read

    @functools.cached_property
    def names(self) -> tuple[str, ...]:
        return tuple(self._read())

    def __getitem__(self, index):
        return self.names[index]

    def __len__(self) -> int:
        return len(self.names)


def export_formats() -> tuple[str, ...]:
    """``export --format``: each model file format of an export directory, or both."""
    return FORMATS


def model_dtypes() -> tuple[str, ...]:
    """``export --dtype``: the dtype names a manifest records."""
    return DTYPE_NAMES


def kv_cache_dtypes() -> tuple[str, ...]:
    """``export --kv-cache-dtype``: ``auto`` (the model's dtype) or a cache dtype."""
    from attnexport.model_interface import KV_CACHE_DTYPES

    return KV_CACHE_DTYPES


def prefill_attention() -> tuple[str, ...]:
    """``export --prefill-attention``: the native PagedAttention kernel's prefill precisions."""
    from attnexport.model_contract import PREFILL_ATTENTION

    return PREFILL_ATTENTION


def onnx_targets() -> Sequence[str]:
    """``export --target``: the lowering's ONNX targets (read on first use)."""

    def read() -> Sequence[str]:
        from attnexport.lowering import TARGETS

        return TARGETS

    return RegistryChoices(read)


def weight_formats() -> Sequence[str]:
    """``export --weights``: float and the lowering's quantized weight formats (read on first
    use)."""

    def read() -> Sequence[str]:
        from attnexport.lowering import WEIGHT_FORMATS

        return tuple(WEIGHT_FORMATS)

    return RegistryChoices(read)


def weight_algorithms() -> Sequence[str]:
    """``export --weights-algorithm``: onnxruntime's quantization algorithms the lowering
    drives (read on first use)."""

    def read() -> Sequence[str]:
        from attnexport.lowering import ALGORITHMS

        return ALGORITHMS

    return RegistryChoices(read)


def lm_head_formats() -> Sequence[str]:
    """``export --lm-head``: the logits projection's formats (read on first use)."""

    def read() -> Sequence[str]:
        from attnexport.lowering import LM_HEAD_FORMATS

        return tuple(LM_HEAD_FORMATS)

    return RegistryChoices(read)


def zero_point_offsets() -> Sequence[str]:
    """``export --weights-offsets``: how float zero points' offsets are stored (read on first
    use)."""

    def read() -> Sequence[str]:
        from attnexport.lowering import ZERO_POINT_OFFSETS

        return ZERO_POINT_OFFSETS

    return RegistryChoices(read)


def weight_activations() -> Sequence[str]:
    """``export --weights-activations``: how finely 8-bit weights' activations are rounded
    (read on first use)."""

    def read() -> Sequence[str]:
        from attnexport.lowering import ACTIVATIONS

        return ACTIVATIONS

    return RegistryChoices(read)


def weight_prefill_activations() -> Sequence[str]:
    """``export --weights-prefill-activations``: how finely a prefill's activations are rounded
    (read on first use)."""

    def read() -> Sequence[str]:
        from attnexport.lowering import PREFILL_ACTIVATIONS

        return PREFILL_ACTIVATIONS

    return RegistryChoices(read)


def model_impls() -> Sequence[str]:
    """``export --impl``: how a checkpoint is loaded, the zoo's network or transformers' (read
    on first use: the models' registry imports torch)."""

    def read() -> Sequence[str]:
        from attnexport.models.registry import IMPLS

        return IMPLS

    return RegistryChoices(read)


def zoo_models() -> tuple[str, ...]:
    """The zoo's model names (``export MODEL``, ``demo --model``; not a closed choice: ``export``
    also takes checkpoint directories and ``zoo:NAME``)."""
    from attnexport.models.registry import zoo_names

    return tuple(zoo_names())


def zoo_model_list() -> str:
    """The zoo's model names for a help line; without torch (a deployment install: the zoo's
    models are torch modules) the extra that installs it."""
    if not installed("torch"):
        return f'the zoo needs torch: pip install "attnexport[{TORCH_EXTRA}]"'
    return ", ".join(zoo_models())


def executors() -> tuple[str, ...]:
    """``run --executor``: ``auto`` and the executors an artifact's files run on."""
    return EXECUTORS


def attention_backends() -> Sequence[str]:
    """``run --backend``: ``auto`` and every registered kernel backend (available here or
    not: an unavailable one is refused with its reason when the command runs); read on first
    use. The backends are torch's: without torch (a deployment install) only ``auto``."""

    def read() -> Sequence[str]:
        if not installed("torch"):
            return ("auto",)
        import attnexport  # noqa: F401  (registers the built-in backends)
        from attnexport.custom_ops.dispatch import AUTO, registered_backends

        return (AUTO, *(backend.name for backend in registered_backends()))

    return RegistryChoices(read)


def devices() -> tuple[str, ...]:
    """``run --device``: the devices the executors run on (onnxruntime's execution providers
    decide: the torch executor runs on the same ones)."""
    from attnexport.runtime.executors.ort_executor import PROVIDERS

    return tuple(PROVIDERS)


def weight_decode_activations() -> Sequence[str]:
    """``export --weights-decode-activations``: how finely the other calls' activations are
    rounded with int8 prefill activations (read on first use)."""

    def read() -> Sequence[str]:
        from attnexport.lowering import DECODE_ACTIVATIONS

        return DECODE_ACTIVATIONS

    return RegistryChoices(read)
