"""Reading a local Hugging Face checkpoint directory: ``config.json`` and the weights.

Weights come from ``model.safetensors``, a sharded ``model.safetensors.index.json``, any other
``*.safetensors`` files, or (when no safetensors file exists) ``pytorch_model.bin`` loaded with
``weights_only=True``. Nothing here reaches a model hub.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from models.errors import CheckpointError

SAFETENSORS_INDEX = "model.safetensors.index.json"


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
    config_path = checkpoint_dir(path) / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{config_path}: not valid JSON ({error})") from error
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_path}: expected a JSON object")
    return config


def weight_files(path: str | Path) -> list[Path]:
    """The weight files of a checkpoint directory, in load order."""
    directory = checkpoint_dir(path)
    index = directory / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (directory / s).is_file()]
        if missing:
            raise CheckpointError(f"{index}: shard files missing from the directory: {missing}")
        return [directory / s for s in shards]
    files = sorted(directory.glob("*.safetensors"))
    if files:
        return files
    legacy = directory / "pytorch_model.bin"
    if legacy.is_file():
        return [legacy]
    raise CheckpointError(
        f"{path}: expected model.safetensors, {SAFETENSORS_INDEX} or pytorch_model.bin in the "
        "checkpoint directory"
    )


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint directory ``path``, on the CPU, by its stored name."""
    weights: dict[str, torch.Tensor] = {}
    for file in weight_files(path):
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            part = load_file(str(file), device="cpu")
        else:
            part = torch.load(file, map_location="cpu", weights_only=True)
        duplicated = weights.keys() & part.keys()
        if duplicated:
            raise CheckpointError(f"{file}: tensors stored twice: {sorted(duplicated)[:5]}")
        weights.update(part)
    return weights
