"""What every zoo model shares: construction from a config (seeded weights), loading a Hugging
Face checkpoint directory, its cache geometry, and a sample batch for ``torch.export``.

A model class sets ``config_class`` (a frozen dataclass with ``from_hf(dict)`` and ``tiny()``),
``kind``, its zoo name and the HF ``model_type`` it imports, and implements ``hf_weight_names``
(local parameter name -> candidate names in the checkpoint) where the names differ.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from attnexport.custom_ops import ScheduledSequence, build_attention_metadata
from attnexport.errors import UserError
from attnexport.model_interface import CacheSpec
from attnexport.models import loader
from attnexport.models.empty_init import parameters_on_meta_device
from attnexport.models.errors import CheckpointError
from attnexport.models.layers import LayerCache, RMSNorm, ScaledCache


@dataclass(frozen=True)
class ExportSample:
    """Positional arguments of ``forward`` for ``torch.export`` and their dynamic shapes.

    Every dynamic dim of the sample is >= 2 (export specialises 0/1-sized dims); dims that must
    agree share one ``torch.export.Dim`` (``num_tokens``, ``num_seqs``, ``num_blocks``,
    ``max_blocks_per_seq``, ...).
    """

    args: tuple
    dynamic_shapes: tuple
    input_names: tuple[str, ...]
    """The forward's argument names, in order (the last one is ``kv_caches`` for paged models)."""

    def export(self, model: nn.Module) -> torch.export.ExportedProgram:
        """``torch.export.export`` of ``model`` on this sample (non-strict)."""
        return torch.export.export(
            model, self.args, dynamic_shapes=self.dynamic_shapes, strict=False
        )


@dataclass(frozen=True)
class ModelConfig:
    """Base of the config dataclasses: serialisable, comparable, with a tiny default."""

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict of the fields (nested dataclasses become dicts)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]):
        """Inverse of :meth:`to_dict`."""
        kwargs = {}
        hints = typing.get_type_hints(cls)
        names = {f.name for f in dataclasses.fields(cls)}
        for name, value in values.items():
            if name not in names:
                raise ValueError(f"{cls.__name__}: unknown field {name!r}")
            hint = hints[name]
            # ``X | None`` of a dataclass X: the dataclass
            options = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
            if dataclasses.is_dataclass(options[0]) and isinstance(value, dict):
                value = options[0](**value)
            elif isinstance(value, list):
                value = tuple(value)
            kwargs[name] = value
        return cls(**kwargs)


class PagedModel(nn.Module):
    """Base class of the zoo models."""

    config_class: ClassVar[type]
    kind: ClassVar[str] = "decoder"
    """``decoder``, ``encoder`` or ``encoder-decoder``."""
    zoo_name: ClassVar[str]
    impl: ClassVar[str] = "zoo"
    """``zoo`` (a network of this zoo) or ``transformers`` (:mod:`attnexport.models.generic`)."""
    zoo_refusal: str | None = None
    """Why the zoo did not load a checkpoint the transformers path then loaded (``impl``
    ``auto``); None otherwise."""
    hf_model_types: ClassVar[tuple[str, ...]] = ()
    hf_architectures: ClassVar[tuple[str, ...]] = ()
    """Accepted ``architectures`` entries of config.json (others are refused)."""
    ignored_hf_weights: tuple[str, ...] = ()
    """Regexes of checkpoint tensors that carry nothing this model computes."""
    max_model_len: int | None = None
    """Longest sequence the model can position (learned position tables), if any."""
    rope_switch_length: int | None = None
    """LongRoPE: the length past which a sequence's keys are rotated with other frequencies
    (``original_max_position_embeddings``); the engine recomputes a sequence that grows past
    it (docs/runtime.md, "RoPE regime switch"). None: the rotation never depends on the
    sequence's length."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config

    # ----------------------------------------------------------------------- construction

    @classmethod
    def from_config(
        cls, config=None, *, dtype: torch.dtype = torch.float32, seed: int = 0
    ) -> PagedModel:
        """A model of ``config`` (default: the tiny config) with deterministic random weights:
        matrices and embeddings N(0, 0.02), biases N(0, 0.02), norm weights 1 + N(0, 0.02) and
        norm biases N(0, 0.02), drawn in parameter-name order from a generator seeded ``seed``."""
        model = cls(config if config is not None else cls.config_class.tiny())
        generator = torch.Generator().manual_seed(seed)
        norm_weights = {
            f"{name}.weight"
            for name, module in model.named_modules()
            if isinstance(module, (nn.LayerNorm, RMSNorm))
        }
        with torch.no_grad():
            for name, param in sorted(model.named_parameters()):
                noise = torch.randn(param.shape, generator=generator) * 0.02
                param.copy_(noise + 1.0 if name in norm_weights else noise)
        return model.to(dtype).eval()

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype: torch.dtype = torch.float32):
        """Loads a local Hugging Face checkpoint directory (config.json + weights).

        Raises UnsupportedModelError for an architecture or config option this class does not
        implement and CheckpointError for weights that do not fit the config.
        """
        hf_config = loader.read_config(path)
        config_path = Path(path) / "config.json"
        try:
            config = cls.config_class.from_hf(hf_config)
        except UserError as error:
            raise type(error)(f"{config_path}: {error}") from None
        except (TypeError, ValueError) as error:
            # from_hf only converts the user's config.json fields: a value it cannot convert
            # (a string where a number belongs, ...) is that file's mistake.
            raise CheckpointError(f"{config_path}: {error}") from None
        with parameters_on_meta_device():  # every one is loaded next, or refused
            model = cls(config)
        with loader.read_weights(path) as weights:
            model.load_hf_weights(weights, source=str(path))
        return model.to(dtype).eval()

    def hf_weight_names(self, name: str) -> tuple[str | tuple[str, ...], ...]:
        """Checkpoint names that may hold local parameter/buffer ``name``, in preference order.
        A tuple candidate names tensors concatenated along dim 0 (a fused projection).
        Default: the same name. Architectures override this for renamed, tied or fused
        weights."""
        return (name,)

    def convert_hf_weight(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Turns the checkpoint tensor found for local ``name`` into the local layout."""
        return tensor

    def optional_weights(self) -> dict[str, float]:
        """Local tensors that checkpoints may omit, with the constant they then take."""
        return {}

    def load_hf_weights(self, weights: Mapping[str, torch.Tensor], source: str = "checkpoint"):
        """Loads checkpoint tensors into this model (each becomes its parameter, also on a
        model built on the meta device), checking that every local tensor is found with the
        right shape and that no checkpoint tensor is left unused (which would mean a feature
        this implementation lacks)."""
        used: set[str] = set()
        missing: list[str] = []
        optional = self.optional_weights()
        local = dict(self.named_parameters())
        local.update((n, b) for n, b in self.named_buffers() if n in optional)
        values: dict[int, torch.Tensor] = {}  # by id of the local tensor
        with torch.no_grad():
            for name, target in local.items():
                candidates = [(c,) if isinstance(c, str) else c for c in self.hf_weight_names(name)]
                found = next((c for c in candidates if all(n in weights for n in c)), None)
                if found is None:
                    if name in optional:
                        values[id(target)] = torch.full(
                            target.shape, optional[name], dtype=target.dtype, device="cpu"
                        )
                        continue
                    missing.append(name)
                    continue
                parts = [weights[n] for n in found]
                tensor = self.convert_hf_weight(
                    name, torch.cat(parts) if len(parts) > 1 else parts[0]
                )
                if tuple(tensor.shape) != tuple(target.shape):
                    stored = " + ".join(f"{n} {tuple(weights[n].shape)}" for n in found)
                    raise CheckpointError(
                        f"{source}: checkpoint tensor {stored} gives shape "
                        f"{tuple(tensor.shape)} for {name}, expected "
                        f"{tuple(target.shape)} from config.json"
                    )
                values[id(target)] = tensor.to(target.dtype).contiguous()
                used.update(found)
        if missing:
            raise CheckpointError(
                f"{source}: weights missing for {', '.join(missing[:8])}"
                + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            )
        ignored = [re.compile(p) for p in self.ignored_hf_weights]
        unused = sorted(
            n for n in weights if n not in used and not any(p.fullmatch(n) for p in ignored)
        )
        if unused:
            raise CheckpointError(
                f"{source}: the checkpoint has tensors {self.__class__.__name__} does not use "
                f"(an unsupported variant?): {', '.join(unused[:8])}"
            )
        self._assign(values)

    def _assign(self, values: dict[int, torch.Tensor]) -> None:
        """Makes each value (by ``id`` of the local tensor it is for) the parameter or buffer
        itself: no copy into the one the model was built with, which has no storage on the
        meta device and is never touched otherwise (its pages never become resident). A module
        shared under several names (tied embeddings) takes its value under each of them."""
        state = self.state_dict(keep_vars=True)
        unset = [
            name
            for name, tensor in itertools.chain(state.items(), self.named_buffers())
            if tensor.is_meta and id(tensor) not in values
        ]
        if unset:
            # the model class's mistake, not the checkpoint's: a tensor neither loaded nor filled
            raise RuntimeError(
                f"{self.__class__.__name__}: no value for {sorted(set(unset))[:8]} (a buffer "
                "that forward does not compute must be listed in optional_weights)"
            )
        self.load_state_dict({n: values.get(id(t), t) for n, t in state.items()}, assign=True)

    # ----------------------------------------------------------------------- interface

    def cache_spec(
        self, block_size: int = 16, kv_cache_dtype: torch.dtype | None = None
    ) -> CacheSpec:
        """The geometry of this model's paged KV caches (of ``kv_cache_dtype``; None: the
        model's dtype)."""
        raise NotImplementedError

    def export_sample(
        self, block_size: int = 16, kv_cache_dtype: torch.dtype | None = None
    ) -> ExportSample:
        """A valid batch for ``torch.export`` with every dynamic dim >= 2 (caches of
        ``kv_cache_dtype``; None: the model's dtype)."""
        raise NotImplementedError

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the weights (and of the caches)."""
        return next(self.parameters()).dtype


def _scaled(kv_caches: list[torch.Tensor]) -> bool:
    return bool(kv_caches) and kv_caches[0].dtype == torch.int8


def check_kv_caches(kv_caches: list[torch.Tensor], expected: int) -> None:
    """Raises ValueError unless ``kv_caches`` holds ``expected`` tensors (twice as many for
    int8 caches, which come with their scale caches)."""
    if _scaled(kv_caches):
        if len(kv_caches) != 2 * expected:
            raise ValueError(
                f"kv_caches: expected {2 * expected} tensors [k_0, v_0, ks_0, vs_0, k_1, ...] "
                f"(int8 caches and their scale caches), got {len(kv_caches)}"
            )
        return
    if len(kv_caches) != expected:
        raise ValueError(
            f"kv_caches: expected {expected} tensors [k_0, v_0, k_1, v_1, ...], "
            f"got {len(kv_caches)}"
        )


def layer_caches(kv_caches: list[torch.Tensor]) -> list[tuple[LayerCache, LayerCache]]:
    """The ``(key cache, value cache)`` of each layer of the forward's ``kv_caches``, which
    interleaves them: ``[k_0, v_0, k_1, v_1, ...]``; int8 caches come as
    :class:`~attnexport.models.layers.ScaledCache` of ``[k_0, v_0, ks_0, vs_0, k_1, ...]``."""
    if not _scaled(kv_caches):
        return list(zip(kv_caches[0::2], kv_caches[1::2], strict=True))
    keys = [ScaledCache(c, s) for c, s in zip(kv_caches[0::4], kv_caches[2::4], strict=True)]
    values = [ScaledCache(c, s) for c, s in zip(kv_caches[1::4], kv_caches[3::4], strict=True)]
    return list(zip(keys, values, strict=True))


# ----------------------------------------------------------------------------- export samples

# The sample batch: (cached tokens, new tokens) per sequence, one prefill and one chunk with
# context; encoder-decoder samples also encode 4 and 5 encoder tokens. Its dynamic dims are all
# >= 2 and pairwise distinct (num_tokens 5, num_seqs 2, num_seqs + 1 = 3, num_logits 4,
# max_blocks_per_seq >= 6, num_encoder_tokens 9, max_cross_blocks_per_seq >= 8, num_blocks
# larger than any) so that tracing cannot unify two of them by value.
SAMPLE_LENGTHS = ((0, 3), (4, 2))
SAMPLE_ENCODER_LENGTHS = (4, 5)
SAMPLE_LOGITS_INDICES = (0, 2, 3, 4)
_MIN_WIDTH, _MIN_CROSS_WIDTH = 6, 8


def decoder_dims() -> dict[str, Any]:
    """The shared ``torch.export.Dim`` objects of the decoder and encoder-decoder forwards."""
    from torch.export import Dim

    return {
        "num_tokens": Dim("num_tokens", min=1),
        "num_seqs": Dim("num_seqs", min=1),
        "num_logits": Dim("num_logits", min=1),
        "num_blocks": Dim("num_blocks", min=1),
        "max_blocks_per_seq": Dim("max_blocks_per_seq", min=1),
        "num_encoder_tokens": Dim("num_encoder_tokens", min=0),
        "max_cross_blocks_per_seq": Dim("max_cross_blocks_per_seq", min=1),
    }


@dataclass(frozen=True)
class SampleBatch:
    """Metadata and positions of the export sample batch."""

    metadata: Any
    """AttentionMetadata of the sample (with the encoder fields when encoder lengths are given)."""
    positions: torch.Tensor
    encoder_positions: torch.Tensor
    num_blocks: int


def _blocks(free: list[int], count: int, width: int | None) -> list[int]:
    blocks = [free.pop() for _ in range(count)]
    return blocks + [0] * (width - count) if width else blocks


def sample_batch(block_size: int, encoder_lengths: tuple[int, ...] = ()) -> SampleBatch:
    """The export sample's metadata: blocks taken in descending order, the first sequence's
    tables padded so that the block tables are wider than any sequence needs."""
    needed = [-(-(c + n) // block_size) for c, n in SAMPLE_LENGTHS]
    cross_needed = [-(-n // block_size) for n in encoder_lengths]
    width = max(_MIN_WIDTH, *needed)
    cross_width = max(_MIN_CROSS_WIDTH, *cross_needed) if encoder_lengths else 0
    taken = {5, 2, 3, 4, width, sum(encoder_lengths), cross_width}
    num_blocks = max(width, cross_width, sum(needed), sum(cross_needed)) + 1
    while num_blocks in taken:
        num_blocks += 1
    free = list(range(num_blocks))  # popped from the end
    cross_free = list(range(num_blocks))  # cross caches are separate tensors
    sequences = []
    for i, (cached, new) in enumerate(SAMPLE_LENGTHS):
        encoder_len = encoder_lengths[i] if encoder_lengths else 0
        pad = i == 0
        sequences.append(
            ScheduledSequence(
                cached,
                new,
                _blocks(free, needed[i], width if pad else None),
                encoder_len=encoder_len,
                encoder_block_ids=(
                    _blocks(cross_free, cross_needed[i], cross_width if pad else None)
                    if encoder_lengths
                    else ()
                ),
                encode_now=bool(encoder_lengths),
            )
        )
    return SampleBatch(
        metadata=build_attention_metadata(sequences, block_size),
        positions=torch.cat([torch.arange(c, c + n) for c, n in SAMPLE_LENGTHS]),
        encoder_positions=torch.cat(
            [torch.arange(n) for n in encoder_lengths] or [torch.zeros(0)]
        ).long(),
        num_blocks=num_blocks,
    )
