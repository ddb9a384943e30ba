"""Runs a paged decoder in PyTorch: an eager ``nn.Module`` or a ``torch.export`` program
(``.pt2``), on a chosen attention backend and device."""

from __future__ import annotations

import os

import torch

from attnexport.artifact import load_pt2
from attnexport.custom_ops.dispatch import (
    AUTO,
    BackendUnsupportedError,
    get_backend,
    use_backend,
)
from attnexport.custom_ops.planning import step_plan
from attnexport.errors import UserError
from attnexport.model_interface import (
    DECODER_INPUT_NAMES,
    ENCODER_DECODER_INPUT_NAMES,
    CacheSpec,
)
from attnexport.runtime.config import checked_max_model_len
from attnexport.runtime.executors.base import Executor
from attnexport.runtime.executors.torch_cache_pool import TorchCachePool
from attnexport.runtime.model_input import ModelInput, pack_decoder_step
from attnexport.runtime.torch_inputs import StepTensors


def check_backend(backend: str, device: torch.device) -> str:
    """``backend`` normalised; raises ValueError if it is unknown or cannot run on ``device``."""
    name = backend.strip().lower()
    if name == AUTO:
        return name
    implementation = get_backend(name)  # raises with the valid names
    reason = implementation.unavailable_reason()
    if reason is not None:
        raise UserError(f"backend: {name!r} is not available here: {reason}")
    if device.type not in implementation.capabilities.devices:
        devices = sorted(implementation.capabilities.devices)
        raise UserError(f"backend: {name!r} does not run on {device.type} (devices: {devices})")
    return name


class TorchExecutor(Executor):
    """A decoder forward (``model_interface``) run eagerly, step by step.

    Args:
        model: an ``nn.Module``, a ``torch.export.ExportedProgram``, or the path of a ``.pt2``
            file saved from one.
        backend: attention backend the ops dispatch to: ``auto``, ``sdpa``, ``ipex``,
            ``xformers`` (any registered name).
        device: ``cpu`` or ``cuda`` (caches and inputs are placed there; an eager module is moved
            there).
        block_size: tokens per cache block, for a module whose ``cache_spec(block_size)``
            accepts any (an exported program has its own).
        kv_cache_dtype: the caches' dtype for a module whose ``cache_spec`` takes one
            (float16, bfloat16, int8 with scale caches; None: the model's dtype); an exported
            program has its own.
        cache_spec, vocab_size, max_model_len: the model's cache geometry, output width and
            length limit. Found on the model when not given: a ``cache_spec`` attribute or
            method and ``config.vocab_size`` / ``config.max_position_embeddings`` of a module,
            or the input and output shapes of an exported program. A ``max_model_len`` above
            the one found is refused (UserError).
        trust_pickle: load a ``.pt2`` path even when its archive holds entries that loading
            would unpickle (they can run code); see :func:`attnexport.artifact.load_pt2`.
        rope_switch_length: the LongRoPE switch length (see
            :attr:`Executor.rope_switch_length`): a module's ``rope_switch_length`` when not
            given; an exported program does not record it (the export manifest does, which
            :func:`~attnexport.runtime.loading.load_executor` passes here).
    """

    name = "torch"

    def __init__(
        self,
        model: torch.nn.Module | torch.export.ExportedProgram | str | os.PathLike,
        *,
        backend: str = AUTO,
        device: torch.device | str = "cpu",
        block_size: int | None = None,
        kv_cache_dtype: torch.dtype | None = None,
        cache_spec: CacheSpec | None = None,
        vocab_size: int | None = None,
        max_model_len: int | None = None,
        trust_pickle: bool = False,
        rope_switch_length: int | None = None,
    ) -> None:
        device = torch.device(device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise UserError("device: 'cuda' was asked for but torch sees no CUDA device")
        self.backend = check_backend(backend, device)
        if isinstance(model, (str, os.PathLike)):
            model = load_pt2(model, trust_pickle=trust_pickle)
        if isinstance(model, torch.export.ExportedProgram):
            found = _program_facts(model)
            self.source = "exported program"
            module = model.module()
        elif isinstance(model, torch.nn.Module):
            found = _module_facts(model, block_size, kv_cache_dtype)
            self.source = type(model).__name__
            module = model
        else:
            raise TypeError(
                "model: expected an nn.Module, an ExportedProgram or a .pt2 path, "
                f"got {type(model).__name__}"
            )
        cache_spec = cache_spec or found.get("cache_spec")
        vocab_size = vocab_size or found.get("vocab_size")
        if cache_spec is None:
            raise ValueError("cache_spec: the model does not describe its caches; pass cache_spec")
        if block_size is not None and cache_spec.block_size != block_size:
            raise ValueError(
                f"block_size: the model's caches use blocks of {cache_spec.block_size} tokens, "
                f"got block_size={block_size}"
            )
        if vocab_size is None:
            raise ValueError("vocab_size: the model does not state its vocabulary; pass it")
        super().__init__(
            cache_spec,
            vocab_size,
            checked_max_model_len(
                max_model_len, found.get("max_model_len"), f"{self.source}'s config"
            ),
            device,
            rope_switch_length or found.get("rope_switch_length"),
        )
        if isinstance(model, torch.nn.Module):
            module = module.to(device).eval()
        elif device.type != "cpu":
            module = module.to(device)
        self.module = module
        self.decoder_start_token_id = found.get("decoder_start_token_id")
        if self.backend != AUTO and not cache_spec.num_cross_layers:
            self._check_backend_runs_the_model()

    def _check_backend_runs_the_model(self) -> None:
        """Runs a two-token prefill and a one-token decode of the model on scratch caches under
        the chosen backend, so that a backend that cannot run this model's steps (a decode batch
        no xFormers operator reads from this cache, a cache dtype IPEX refuses, ...) is refused
        here with its reasons, instead of failing every request of the first such step."""
        block_size = self.cache_spec.block_size
        tokens = [0, 0, 0]
        blocks = list(range(-(-len(tokens) // block_size)))
        caches = TorchCachePool(self.cache_spec, len(blocks), 0, self.device).kv_caches
        try:
            for start, count in ((0, 2), (2, 1)):
                step = pack_decoder_step([start], [count], [blocks], [tokens], [1], block_size)
                args = StepTensors(step, self.device).index_args()
                with use_backend(self.backend), torch.no_grad(), step_plan(args):
                    self.module(*args, caches)
        except BackendUnsupportedError as error:
            raise UserError(
                f"backend: {self.backend!r} cannot run this model's steps ({error}); "
                f"use backend 'auto', which runs each call on the best backend that can"
            ) from error

    def _make_cache_pool(self, num_blocks: int, num_cpu_blocks: int) -> TorchCachePool:
        return TorchCachePool(self.cache_spec, num_blocks, num_cpu_blocks, self.device)

    def execute(self, model_input: ModelInput) -> torch.Tensor:
        model_input.check_rows(self.vocab_size, self.max_model_len)
        args = StepTensors(model_input, self.device).index_args()
        # The step's plan: every layer reuses what the first one checked and planned about
        # these (fresh, never rewritten) metadata tensors.
        with use_backend(self.backend), torch.no_grad(), step_plan(args):
            logits = self.module(*args, self.kv_caches)
        return logits.to(device="cpu", dtype=torch.float32)

    def describe(self) -> str:
        return f"torch ({self.source}) on {self.device}, backend {self.backend}"


def _module_facts(
    module: torch.nn.Module, block_size: int | None, kv_cache_dtype: torch.dtype | None = None
) -> dict:
    facts = {}
    spec = getattr(module, "cache_spec", None)
    if callable(spec):
        kwargs = {} if block_size is None else {"block_size": block_size}
        if kv_cache_dtype is not None:
            kwargs["kv_cache_dtype"] = kv_cache_dtype
        spec = spec(**kwargs)
    if isinstance(spec, CacheSpec):
        facts["cache_spec"] = spec
    config = getattr(module, "config", None)
    for key, names in (
        ("vocab_size", ("vocab_size",)),
        ("max_model_len", ("max_model_len", "max_position_embeddings")),
        ("decoder_start_token_id", ("decoder_start_token_id",)),
        ("rope_switch_length", ("rope_switch_length",)),
    ):
        for owner in (module, config):
            value = next((getattr(owner, n) for n in names if hasattr(owner, n)), None)
            if isinstance(value, int):
                facts[key] = value
                break
    return facts


def _program_facts(program: torch.export.ExportedProgram) -> dict:
    """Cache geometry and vocabulary read from an exported (encoder-)decoder's example shapes.

    An encoder-decoder is told by its input count: its ``kv_caches`` (self then cross caches,
    as many of each) follow the ``ENCODER_DECODER_INPUT_NAMES``. int8 caches come 4 per layer
    (key, value, then their 3-D float32 scale caches)."""
    user_inputs = program.graph_signature.user_inputs
    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    values = [placeholders[name].meta.get("val") for name in user_inputs]
    facts = {}
    for names, cross in ((ENCODER_DECODER_INPUT_NAMES, True), (DECODER_INPUT_NAMES, False)):
        caches = values[len(names) :]
        if not caches or not all(isinstance(c, torch.Tensor) for c in caches):
            continue
        per_layer = 4 if caches[0].dtype == torch.int8 else 2
        ranks = [3 if i % per_layer >= 2 else 4 for i in range(len(caches))]
        if [c.dim() for c in caches] != ranks:
            continue
        dims = [int(d) if isinstance(d, int) else None for d in caches[0].shape[1:]]
        if None in dims or len(caches) % (per_layer * (2 if cross else 1)):
            continue
        block_size, num_kv_heads, head_size = dims
        layers = len(caches) // (per_layer * (2 if cross else 1))
        facts["cache_spec"] = CacheSpec(
            num_layers=layers,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            dtype=caches[0].dtype,
            block_size=block_size,
            num_cross_layers=layers if cross else 0,
        )
        break
    # The graph's outputs list mutated inputs first; the logits are the user output.
    user_outputs = set(program.graph_signature.user_outputs)
    output = next(n for n in program.graph.nodes if n.op == "output")
    for node in output.args[0]:
        value = getattr(node, "meta", {}).get("val") if hasattr(node, "name") else None
        if node.name in user_outputs and isinstance(value, torch.Tensor) and value.dim() == 2:
            if isinstance(value.shape[1], int):
                facts["vocab_size"] = int(value.shape[1])
            break
    return facts
