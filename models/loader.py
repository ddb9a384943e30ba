"""Reading a local Hugging Face checkpoint directory: ``config.json`` and the weights.

Weights come from ``model.safetensors``, a sharded ``model.safetensors.index.json``, any other
``*.safetensors`` files, or (when no safetensors file exists) ``pytorch_model.bin`` loaded with
``weights_only=True``. Nothing here reaches a model hub, and nothing outside the checkpoint
directory is read: a file that is a link out of it is refused (a hub cache snapshot's links
into its ``blobs`` excepted; :mod:`attnexport.contained_files`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from attnexport.contained_files import contained_file, read_json
from attnexport.errors import require
from attnexport.models.errors import CheckpointError

SAFETENSORS_INDEX = "model.safetensors.index.json"

POSITIVE_INT_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "n_embd",
    "n_head",
    "n_layer",
    "n_positions",
    "n_inner",
    "d_model",
    "encoder_layers",
    "decoder_layers",
    "encoder_attention_heads",
    "decoder_attention_heads",
    "encoder_ffn_dim",
    "decoder_ffn_dim",
)
"""config.json sizes that must be positive integers when present (0 or a negative size
would build an empty or malformed model, or divide by zero)."""
EPS_FIELDS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon")
"""config.json normalisation epsilons: finite and > 0 when present (a negative one turns a
near-zero variance into NaN)."""


def checkpoint_dir(path: str | Path) -> Path:
    """``path`` as a directory holding ``config.json``; raises CheckpointError otherwise."""
    directory = Path(path)
    if not directory.is_dir():
        raise CheckpointError(f"{path}: expected a checkpoint directory, got no such directory")
    if not (directory / "config.json").is_file():
        raise CheckpointError(f"{path}: expected a config.json in the checkpoint directory")
    return directory


def read_config(path: str | Path) -> dict:
    """The parsed ``config.json`` of the checkpoint directory ``path``."""
    config_path = checkpoint_file(checkpoint_dir(path), "config.json")
    config = read_json(config_path, CheckpointError)
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_path}: expected a JSON object")
    check_config_values(config, config_path)
    return config


def checkpoint_file(directory: Path, name: str) -> Path:
    """``directory / name``, refused (UnsafePathError) when it is a link out of the
    checkpoint or not a regular file (a hub cache snapshot's links into its ``blobs`` are
    read: :func:`attnexport.contained_files.contained_file`)."""
    return contained_file(directory, name, hub_links=True)


def check_config_values(config: dict, config_path: Path) -> None:
    """Refuses sizes that are not positive integers and epsilons that are not finite and
    positive, naming ``config_path`` and the field (CheckpointError)."""
    for name in POSITIVE_INT_FIELDS:
        value = config.get(name)
        if value is not None and (type(value) is not int or value < 1):
            raise CheckpointError(
                f"{config_path}: field {name!r}: expected a positive integer, got {value!r}"
            )
    for name in EPS_FIELDS:
        value = config.get(name)
        if value is not None and (
            type(value) not in (int, float) or not math.isfinite(value) or value <= 0
        ):
            raise CheckpointError(
                f"{config_path}: field {name!r}: expected a finite number > 0, got {value!r}"
            )


def weight_files(path: str | Path) -> list[Path]:
    """The weight files of a checkpoint directory, in load order."""
    directory = checkpoint_dir(path)
    index = checkpoint_file(directory, SAFETENSORS_INDEX)
    if index.is_file():
        weight_map = read_json(index, CheckpointError)
        weight_map = weight_map.get("weight_map", {}) if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) for v in weight_map.values()
        ):
            raise CheckpointError(f"{index}: weight_map: expected an object of file names")
        shards = sorted(set(weight_map.values()))
        outside = [s for s in shards if Path(s).name != s or not s.endswith(".safetensors")]
        if outside:
            # a shard is a file of this directory: a path could read any file on the machine
            raise CheckpointError(
                f"{index}: weight_map names files that are not *.safetensors files of the "
                f"checkpoint directory: {outside[:3]}"
            )
        files = [checkpoint_file(directory, s) for s in shards]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index}: shard files missing from the directory: {missing}")
        return files
    files = [checkpoint_file(directory, f.name) for f in sorted(directory.glob("*.safetensors"))]
    if files:
        return files
    legacy = checkpoint_file(directory, "pytorch_model.bin")
    if legacy.is_file():
        return [legacy]
    raise CheckpointError(
        f"{path}: expected model.safetensors, {SAFETENSORS_INDEX} or pytorch_model.bin in the "
        "checkpoint directory"
    )


MAPPED_BYTES_PER_HANDLE = 32 * 2**20
"""Bytes a checkpoint load reads through one open ``*.safetensors`` handle before it closes it
(and opens the file again for the next tensor). A handle maps the whole file and the pages read
through it stay resident until it closes: one handle per load would hold the whole file
resident beside the copies, one per tensor parsed the header again for every tensor."""


class CheckpointWeights(Mapping[str, torch.Tensor]):
    """The tensors of a checkpoint's weight files by stored name, each read from its
    ``*.safetensors`` file when it is looked up (and not kept): a model copying them in holds
    one checkpoint tensor at a time, never a second copy of every weight. Use it in a ``with``
    block (or :meth:`close` it): the file handle it keeps between lookups closes at its end."""

    def __init__(self, files: list[Path]) -> None:
        self._where: dict[str, Path] = {}
        self._loaded: dict[str, torch.Tensor] = {}  # pytorch_model.bin: read whole
        self._open: tuple[Path, Any] | None = None
        self._mapped_bytes = 0
        for file in files:
            if file.suffix == ".safetensors":
                with _safe_open(file) as handle:
                    names = list(handle.keys())
            else:
                part = torch.load(file, map_location="cpu", weights_only=True)
                self._loaded.update(part)
                names = list(part)
            duplicated = self._where.keys() & set(names)
            if duplicated:
                raise CheckpointError(f"{file}: tensors stored twice: {sorted(duplicated)[:5]}")
            self._where.update(dict.fromkeys(names, file))

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self._loaded:
            return self._loaded[name]
        # cloned into torch's 64-byte aligned allocator, as copying into a parameter did:
        # safetensors' buffer is only 8-byte aligned, and the matmul kernels may take other
        # paths (and round otherwise) on a misaligned weight
        tensor = self._handle(self._where[name]).get_tensor(name).clone()
        self._mapped_bytes += tensor.nbytes
        if self._mapped_bytes >= MAPPED_BYTES_PER_HANDLE:
            self.close()
        return tensor

    def _handle(self, file: Path):
        if self._open is not None and self._open[0] != file:
            self.close()
        if self._open is None:
            self._open = (file, _safe_open(file).__enter__())
        return self._open[1]

    def close(self) -> None:
        """Closes the open file handle (unmapping the file); a later lookup opens it again."""
        if self._open is not None:
            self._open[1].__exit__(None, None, None)
        self._open = None
        self._mapped_bytes = 0

    def __enter__(self) -> CheckpointWeights:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def _safe_open(file: Path):
    safetensors = require("safetensors", "hf", "reading *.safetensors checkpoints")
    return safetensors.safe_open(str(file), framework="pt", device="cpu")


def read_weights(path: str | Path) -> CheckpointWeights:
    """Every tensor of the checkpoint directory ``path``, on the CPU, by its stored name (each
    ``*.safetensors`` tensor read when it is looked up)."""
    return CheckpointWeights(weight_files(path))
