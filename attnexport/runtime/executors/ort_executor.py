"""Runs an ONNX file from ``attnexport.lowering.to_onnx`` in onnxruntime, step by step, with
the KV caches updated in place.

A plain ``InferenceSession.run`` copies every cache input and allocates every cache output
(O(cache) per step, docs/traps.md). Here each cache tensor is wrapped once, zero-copy, in
an ``OrtValue`` that is bound *both* as the cache input ``X`` and as its output ``X_out`` of one
persistent ``IOBinding``; the cache write (``ScatterND``) then finds its output already holding
its input and writes only the new tokens. Per step only the small index inputs are re-bound.
The cache memory is a torch tensor as well, so block swaps and copy-on-write copies use the
shared torch code (:mod:`attnexport.backends.block_copy`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import torch

from attnexport.custom_ops.metadata import to_array
from attnexport.errors import UserError
from attnexport.model_interface import (
    DECODER_INPUT_NAMES,
    ENCODER_DECODER_INPUT_NAMES,
    CacheSpec,
)
from attnexport.runtime.executors.base import Executor
from attnexport.runtime.model_input import ModelInput

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}
KERNELS = ("auto", "native", "bodies")
_NUMPY_INDEX_TYPES = {"tensor(int64)": np.int64, "tensor(int32)": np.int32}
# Metadata keys (``metadata_props``) that may give the model's maximum length.
_MAX_LEN_KEYS = ("max_model_len", "max_position_embeddings")


def session_options(num_threads: int | None = None, spin: bool = True):
    """onnxruntime session options for step-by-step decoding: ``num_threads`` intra-op threads
    (default: torch's thread count), one inter-op thread, all graph optimizations.

    Idle worker threads spin (``spin=True``), as in onnxruntime's and onnxruntime-genai's
    defaults: on cores the process has to itself that saves a wake-up per parallel section
    (~10-20% decode speed on 2 cores). Pass ``spin=False`` when other processes share the
    cores: a spinning pool then burns the time slices the others need, and measured on 2 cores
    with two other busy processes (125M model, decode tokens/s) no spinning made 22-28 against
    16-23 at batch 1 and 122-147 against 84-112 at batch 8."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = num_threads or torch.get_num_threads()
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    return options


class OrtExecutor(Executor):
    """An attnexport ONNX decoder or encoder-decoder in onnxruntime.

    Args:
        model: path of the ``.onnx`` file written by ``attnexport.lowering.to_onnx`` (its
            ``metadata_props`` name the cache inputs/outputs and give the cache geometry).
        device: ``cpu`` (CPU execution provider) or ``cuda`` (CUDA execution provider; needs
            onnxruntime-gpu and a CUDA build of torch, which holds the cache memory).
        num_threads: intra-op threads (default: ``torch.get_num_threads()``).
        spin: let idle worker threads spin (see :func:`session_options`).
        session_options: an ``onnxruntime.SessionOptions`` replacing :func:`session_options`.
        max_model_len: the model's maximum length when its metadata does not give one.
        kernels: how the attnexport nodes run: ``native``, the C++ CPU kernels of
            :mod:`attnexport.runtime.ort_kernels` (an error if that library is not built or
            the device is cuda); ``bodies``, their standard-op function bodies; ``auto``
            (default), native on cpu when the library is built, else the bodies.
    """

    name = "onnxruntime"

    def __init__(
        self,
        model: str | os.PathLike,
        *,
        device: torch.device | str = "cpu",
        num_threads: int | None = None,
        spin: bool = True,
        session_options=None,
        max_model_len: int | None = None,
        kernels: str = "auto",
    ) -> None:
        import onnxruntime as ort

        from attnexport.lowering.ort_session import PagedOrtSession
        from attnexport.runtime import ort_kernels

        device = torch.device(device)
        if device.type not in PROVIDERS:
            raise UserError(f"device: expected 'cpu' or 'cuda', got {str(device)!r}")
        if kernels not in KERNELS:
            raise UserError(f"kernels: expected one of {KERNELS}, got {kernels!r}")
        if kernels == "native" and device.type != "cpu":
            raise UserError("kernels='native': the attnexport kernels are CPU kernels")
        provider = PROVIDERS[device.type]
        if provider not in ort.get_available_providers():
            raise UserError(
                f"device: {provider} is not in this onnxruntime build "
                f"(available: {ort.get_available_providers()}); install onnxruntime-gpu for cuda"
            )
        path = Path(model)
        if not path.is_file():
            raise UserError(f"model: no such .onnx file: {path}")
        options = session_options or globals()["session_options"](num_threads, spin)
        native = kernels == "native" or (
            kernels == "auto" and device.type == "cpu" and ort_kernels.unavailable_reason() is None
        )
        if native:
            ort_kernels.register(options)
        self.kernels = "native" if native else "bodies"
        # The lowering's session reads the attnexport metadata; the binding below is ours: it
        # persists across steps instead of being rebuilt for every run.
        paged = PagedOrtSession(path, providers=[provider], session_options=options)
        self.session, self.contract, self.path = paged.session, paged.contract, path
        meta = self.contract
        if meta.block_size is None or not meta.cache_inputs:
            raise UserError(f"model: {path} has no paged KV caches in its attnexport metadata")
        inputs = {i.name: i for i in self.session.get_inputs()}
        names = ENCODER_DECODER_INPUT_NAMES if meta.num_cross_layers else DECODER_INPUT_NAMES
        missing = [n for n in names if n not in inputs]
        if missing:
            kind = "an encoder-decoder" if meta.num_cross_layers else "a decoder"
            raise UserError(
                f"model: {path} is not {kind} in the attnexport convention; "
                f"inputs {missing} are missing (it takes {list(inputs)})"
            )
        unwritten = [n for n in meta.cache_inputs if n not in meta.cache_outputs]
        if unwritten:
            raise UserError(f"model: cache inputs {unwritten} have no '<name>_out' output")
        self._index_types = {n: _NUMPY_INDEX_TYPES[inputs[n].type] for n in names}
        self._logits_name = meta.outputs[0]
        logits = next(o for o in self.session.get_outputs() if o.name == self._logits_name)
        vocab_size = logits.shape[-1]
        if not isinstance(vocab_size, int) or len(logits.shape) != 2:
            raise UserError(
                f"model: expected logits [num_logits, vocab] with a static vocabulary dim, "
                f"got {logits.shape}"
            )
        if logits.type != "tensor(float)":
            raise UserError(f"model: expected float32 logits, got {logits.type}")
        spec = CacheSpec(
            num_layers=meta.num_layers,
            num_kv_heads=meta.num_kv_heads,
            head_size=meta.head_size,
            dtype=getattr(torch, meta.dtype),
            block_size=meta.block_size,
            num_cross_layers=meta.num_cross_layers,
        )
        found = next((int(meta.extra[k]) for k in _MAX_LEN_KEYS if k in meta.extra), None)
        super().__init__(spec, vocab_size, max_model_len or found, device)
        self._binding = None
        self._cache_values: list = []
        self._input_buffers: dict[str, np.ndarray] = {}
        self._logits: np.ndarray | None = None
        self._logits_refs = 0

    def _bind_caches(self) -> None:
        """Wraps every cache tensor once in an OrtValue (zero copy) and binds that same
        OrtValue as the cache input and as its ``_out`` output, for every later step."""
        from onnxruntime import OrtValue

        binding = self.session.io_binding()
        # Outputs come back in binding order: the logits first, copied to the host (they are
        # small and the sampler runs there) whatever the execution provider.
        binding.bind_output(self._logits_name, "cpu")
        values = []
        for name, cache in zip(self.contract.cache_inputs, self.kv_caches, strict=True):
            value = OrtValue.from_dlpack(cache)
            binding.bind_ortvalue_input(name, value)
            binding.bind_ortvalue_output(self.contract.cache_outputs[name], value)
            values.append(value)
        self._binding, self._cache_values = binding, values
        self._input_buffers, self._logits = {}, None

    @property
    def cache_ortvalues(self) -> list:
        """The OrtValues bound as both cache input and output (they share ``kv_caches``)."""
        return list(self._cache_values)

    def execute(self, model_input: ModelInput) -> torch.Tensor:
        return torch.from_numpy(self.execute_numpy(model_input))

    def execute_numpy(self, model_input: ModelInput) -> np.ndarray:
        """One step on the host values of ``model_input``; returns the ``[N, vocab_size]``
        float32 logits, which later steps never overwrite while they are referred to."""
        if self._binding is None:
            raise RuntimeError("OrtExecutor.execute: initialize_cache must run first")
        model_input.check_rows(self.vocab_size, self.max_model_len)
        self._bind_inputs(model_input)
        logits = self._logits_buffer(model_input.num_logits)
        self.session.run_with_iobinding(self._binding)
        return logits

    def _bind_inputs(self, model_input: ModelInput) -> None:
        """Copies the inputs into host buffers bound to the session: a buffer of an unchanged
        shape (a decode step of the same batch) is written in place, one of a new shape
        (another batch, a wider block table) is bound instead. A buffer stays bound (and alive)
        until replaced: onnxruntime reads it in place on the CPU. Elsewhere binding copies an
        input to the device at once, so every step binds new buffers."""
        reuse = self.device.type == "cpu"
        buffers = self._input_buffers
        for name in model_input.input_names:
            values, shape = model_input.values[name], model_input.shapes[name]
            buffer = buffers.get(name)
            if reuse and buffer is not None and buffer.shape == shape:
                buffer[...] = values
            else:
                from onnxruntime import OrtValue

                buffer = buffers[name] = to_array(name, values, self._index_types[name])
                self._binding.bind_ortvalue_input(name, OrtValue.ortvalue_from_numpy(buffer))

    def _logits_buffer(self, num_rows: int) -> np.ndarray:
        """The ``[num_rows, vocab]`` float32 host buffer the next run writes its logits into
        (bound by address, whatever the execution provider).

        The previous step's buffer is written again only when nothing but this executor refers
        to it (a tensor made from it, a slice or a view of it would); otherwise a fresh one is
        bound, so the logits a step returned are never overwritten while someone holds them."""
        logits = self._logits
        if (
            logits is None
            or logits.shape[0] != num_rows
            or sys.getrefcount(self._logits) > self._logits_refs
        ):
            logits = self._logits = np.empty((num_rows, self.vocab_size), np.float32)
            self._binding.bind_output(
                self._logits_name, "cpu", 0, logits.dtype, logits.shape, logits.ctypes.data
            )
            # The count with no reference but the executor's (this method's included), taken as
            # it is checked: what the interpreter counts for the call then cancels out.
            self._logits_refs = sys.getrefcount(self._logits)
        return logits

    def describe(self) -> str:
        provider = PROVIDERS[self.device.type]
        threads = self.session.get_session_options().intra_op_num_threads
        return f"onnxruntime {provider} ({threads} threads, {self.kernels} kernels): {self.path}"
