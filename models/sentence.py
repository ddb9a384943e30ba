"""How a sentence-transformers checkpoint turns an encoder's hidden states into sentence
embeddings: its ``modules.json`` (the pipeline), ``1_Pooling/config.json`` (the pooling) and
``sentence_bert_config.json`` (the truncation length), read into a plain dict that an export's
manifest keeps (``embedding``) and the runtime applies.

Supported pipelines: ``Transformer`` -> ``Pooling`` (CLS or mean) -> optional ``Normalize``.
A checkpoint without ``modules.json`` is embedded the way sentence-transformers embeds a plain
Hugging Face model: mean pooling, no normalisation.
"""

from __future__ import annotations

from pathlib import Path

from attnexport.contained_files import contained_file, read_json
from attnexport.models.errors import UnsupportedModelError

_ST = "sentence_transformers.models."
_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean"}
_UNSUPPORTED_MODES = (
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
    "pooling_mode_lasttoken",
)
DEFAULT_EMBEDDING = {"pooling": "mean", "normalize": False, "max_seq_length": None}


def _read_json(path: Path):
    try:
        return read_json(path, UnsupportedModelError)
    except OSError as error:
        raise UnsupportedModelError(f"{path}: cannot read it ({error})") from None


def read_embedding_config(directory: str | Path) -> dict:
    """``{"pooling": "mean" | "cls", "normalize": bool, "max_seq_length": int | None}`` of the
    checkpoint in ``directory``.

    Raises:
        UnsupportedModelError: a pipeline module or pooling mode this runtime does not
            reproduce (``Dense``, max pooling, ...), named with its file.
    """
    directory = Path(directory)
    modules_file = contained_file(directory, "modules.json", hub_links=True)
    if not modules_file.is_file():
        return dict(DEFAULT_EMBEDDING)
    modules = _read_json(modules_file)
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise UnsupportedModelError(f"{modules_file}: expected a list of module objects")
    types = [str(m.get("type", "")).removeprefix(_ST) for m in modules]
    unsupported = [t for t in types if t not in ("Transformer", "Pooling", "Normalize")]
    if unsupported or types[:1] != ["Transformer"] or types.count("Pooling") != 1:
        raise UnsupportedModelError(
            f"{modules_file}: the pipeline {types} is not supported; supported: "
            "Transformer, Pooling (cls or mean), then optionally Normalize"
        )
    pooling_at = types.index("Pooling")
    if "Normalize" in types and types.index("Normalize") < pooling_at:
        raise UnsupportedModelError(f"{modules_file}: Normalize before Pooling is not supported")
    pooling_dir = str(modules[pooling_at].get("path", ""))
    pooling_file = contained_file(directory, Path(pooling_dir, "config.json"), hub_links=True)
    pooling = _read_json(pooling_file) if pooling_file.is_file() else {}
    if pooling.get("pooling_mode") is not None:  # sentence-transformers >= 3 may write this
        modes = [str(pooling["pooling_mode"])]
        if modes[0] not in ("cls", "mean"):
            raise UnsupportedModelError(
                f"{pooling_file}: pooling_mode {modes[0]!r} is not supported (cls or mean)"
            )
    else:
        on = [key for key in (*_MODES, *_UNSUPPORTED_MODES) if pooling.get(key)]
        if not on:
            on = ["pooling_mode_mean_tokens"]  # the Pooling module's default
        if len(on) != 1 or on[0] not in _MODES:
            raise UnsupportedModelError(
                f"{pooling_file}: pooling {on} is not supported; supported: one of "
                f"{', '.join(_MODES)}"
            )
        modes = [_MODES[on[0]]]
    max_seq_length = None
    bert_config = contained_file(directory, "sentence_bert_config.json", hub_links=True)
    if bert_config.is_file():
        value = _read_json(bert_config).get("max_seq_length")
        max_seq_length = None if value is None else int(value)
    return {
        "pooling": modes[0],
        "normalize": "Normalize" in types,
        "max_seq_length": max_seq_length,
    }
