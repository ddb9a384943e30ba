"""The file names of an export directory and which model file each executor reads; no torch.

An export directory holds ``model.onnx`` and/or ``model.pt2`` (``model.onnx.data`` when the
ONNX weights went to external data), the tokenizer files of the checkpoint (when it has them)
and ``manifest.json`` (see :mod:`attnexport.artifact.manifest`).
"""

from __future__ import annotations

import os
from pathlib import Path

MANIFEST = "manifest.json"
ONNX_FILE = "model.onnx"
ONNX_DATA_FILE = f"{ONNX_FILE}.data"
PT2_FILE = "model.pt2"
MODEL_FILES = {"onnx": ONNX_FILE, "pt2": PT2_FILE}
"""The model file of each format; the manifest's ``files`` maps formats to these names."""
EXPORT_FILES = (MANIFEST, *MODEL_FILES.values(), ONNX_DATA_FILE)
"""The files an export writes besides the tokenizer files it copies."""
FORMATS = (*MODEL_FILES, "both")
"""What ``attnexport export --format`` accepts: one model file format, or both."""
EXECUTORS = ("auto", "ort", "torch")
"""The executors an artifact runs on (``auto``: the one its files allow)."""
EXECUTOR_FORMAT = {"ort": "onnx", "torch": "pt2"}
"""The model file format each executor loads."""
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
"""The files of a checkpoint that an export copies (when present) for the tokenizer."""


def artifact_dir(path: str | os.PathLike) -> Path:
    """The export directory of ``path`` (itself, or the directory holding a model file)."""
    path = Path(path)
    return path if path.is_dir() else path.parent
