"""Loading a checkpoint (or a transformers config with seeded weights) as a
:class:`~attnexport.models.generic.model.TransformersDecoder`: the static refusals of
:mod:`.support`, transformers' own loading with the paged attention function, the layer probe
and the parity probe of :mod:`.parity`."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

import torch

from attnexport.errors import MissingDependencyError
from attnexport.models import loader
from attnexport.models.errors import CheckpointError, UnsupportedModelError
from attnexport.models.generic.attention import ATTENTION, register_attention
from attnexport.models.generic.model import TransformersDecoder
from attnexport.models.generic.parity import check_against_transformers
from attnexport.models.generic.support import refusals

MIN_TRANSFORMERS = 5


def _transformers():
    try:
        import transformers
    except ModuleNotFoundError:
        raise MissingDependencyError(
            'the transformers path needs transformers >= 5: pip install "attnexport[hf]"'
        ) from None
    if int(transformers.__version__.split(".")[0]) < MIN_TRANSFORMERS:
        raise MissingDependencyError(
            f"the transformers path needs transformers >= {MIN_TRANSFORMERS} (its attention "
            f"interface forwards model keyword arguments); {transformers.__version__} is "
            'installed: pip install -U "transformers>=5"'
        )
    transformers.utils.logging.disable_progress_bar()
    return transformers


def _refuse(config, source: str) -> None:
    reasons = refusals(config)
    if reasons:
        raise UnsupportedModelError(
            f"{source}: the transformers path cannot export {config.model_type!r}: "
            + "; ".join(reasons)
        )


def _causal_lm_class(transformers, config, source: str):
    """transformers' causal-LM class for ``config`` (UnsupportedModelError when it has none)."""
    try:
        return transformers.AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError:
        raise UnsupportedModelError(
            f"{source}: transformers has no causal LM class for model_type "
            f"{config.model_type!r} (an encoder, or a task model without a language-model head)"
        ) from None


def read_hf_config(path: str | Path):
    """transformers' config of the checkpoint directory ``path`` (never the checkpoint's own
    code); UnsupportedModelError when transformers does not know its model type."""
    transformers = _transformers()
    directory = loader.checkpoint_dir(path)
    loader.read_config(directory)  # the zoo's checks of config.json's sizes
    try:
        return transformers.AutoConfig.from_pretrained(directory, trust_remote_code=False)
    except ValueError as error:
        reason = str(error).splitlines()[0]
        raise UnsupportedModelError(
            f"{directory / 'config.json'}: transformers cannot read it: {reason}"
        ) from None


def _quiet_loading():
    """transformers' loading logs (unused-weight reports, which we turn into errors)."""
    return _LoggingLevel("transformers", logging.ERROR)


class _LoggingLevel:
    def __init__(self, name: str, level: int) -> None:
        self.logger, self.level = logging.getLogger(name), level

    def __enter__(self) -> None:
        self.saved = self.logger.level
        self.logger.setLevel(self.level)

    def __exit__(self, *_) -> None:
        self.logger.setLevel(self.saved)


def _check_loading_info(info: dict, source: str) -> None:
    """Missing, unexpected or mis-shaped weights are errors (transformers only logs them and
    initialises the missing ones at random: a silent wrong model)."""
    problems = []
    for key, what in (
        ("missing_keys", "missing"),
        ("unexpected_keys", "not used by the transformers model"),
        ("mismatched_keys", "of another shape than the config implies"),
    ):
        names = sorted(str(n if isinstance(n, str) else n[0]) for n in info.get(key) or ())
        if names:
            more = f" and {len(names) - 8} more" if len(names) > 8 else ""
            problems.append(f"weights {what}: {', '.join(names[:8])}{more}")
    if problems:
        raise CheckpointError(f"{source}: " + "; ".join(problems))


def load_transformers_checkpoint(
    path: str | Path, *, dtype: torch.dtype = torch.float32, probe: bool = True
) -> TransformersDecoder:
    """The checkpoint directory ``path`` as transformers loads it, every attention layer on the
    paged ops, in ``dtype`` and eval mode; checked against transformers' own attention
    (:func:`~.parity.check_against_transformers`) unless ``probe`` is False.

    Raises:
        UnsupportedModelError: the config or the model is one the paged ops cannot run (the
            message lists why).
        CheckpointError: weights missing, unused or of the wrong shape.
    """
    transformers = _transformers()
    directory = loader.checkpoint_dir(path)
    config = read_hf_config(directory)
    _refuse(config, str(directory))
    cls = _causal_lm_class(transformers, config, str(directory))
    # Named errors before transformers opens anything: no weight file (transformers' OSError),
    # a shard that is a link or a path out of the directory.
    loader.weight_files(directory)
    register_attention()
    with _quiet_loading(), _building(cls):
        hf_model, info = cls.from_pretrained(
            directory,
            config=config,
            dtype=dtype,
            attn_implementation=ATTENTION,
            # routed experts as batched matmuls on gathered weights: grouped_mm has no ONNX
            # lowering, the eager loop over experts is data-dependent (torch.export cannot trace it)
            experts_implementation="batched_mm",
            output_loading_info=True,
        )
    _check_loading_info(info, str(directory))
    return _wrap(hf_model, probe)


def transformers_model_from_config(
    config, *, dtype: torch.dtype = torch.float32, seed: int = 0, probe: bool = True
) -> TransformersDecoder:
    """A model of transformers config ``config`` with weights seeded ``seed`` (transformers'
    own initialisation under ``torch.manual_seed``), on the paged ops."""
    transformers = _transformers()
    _refuse(config, "config")
    cls = _causal_lm_class(transformers, config, "config")
    register_attention()
    config._attn_implementation = ATTENTION
    config._experts_implementation = "batched_mm"
    with torch.random.fork_rng(devices=[]), _building(cls):
        torch.manual_seed(seed)
        hf_model = cls._from_config(config, dtype=dtype)
    return _wrap(hf_model, probe)


@contextlib.contextmanager
def _building(cls) -> Iterator[None]:
    """transformers building ``cls`` with the paged attention: a model that looks its attention
    class up by implementation name in a table of its own (GIT) has no entry for ours, a
    KeyError, which is a refusal."""
    try:
        yield
    except KeyError as error:
        if error.args != (ATTENTION,):
            raise
        raise UnsupportedModelError(
            f"{cls.__name__}: its attention is written without transformers' AttentionInterface "
            f"(it picks its attention class from a table of its own, which has no {ATTENTION!r})"
        ) from None


def _wrap(hf_model, probe: bool) -> TransformersDecoder:
    model = TransformersDecoder(hf_model.eval())
    if probe:
        check_against_transformers(model)
    return model
