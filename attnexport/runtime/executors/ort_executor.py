"""Runs an ONNX file from ``attnexport.lowering.to_onnx`` in onnxruntime, step by step, with
the KV caches updated in place.

A plain ``InferenceSession.run`` copies every cache input and allocates every cache output
(O(cache) per step, docs/traps.md). Here each cache tensor is wrapped once, zero-copy, in
an ``OrtValue`` that is bound *both* as the cache input ``X`` and as its output ``X_out`` of one
persistent ``IOBinding``; the cache write (``ScatterND``) then finds its output already holding
its input and writes only the new tokens. Per step only the small index inputs are re-bound.

On the CPU the caches are NumPy arrays the executor owns (block swaps and copy-on-write copies
are NumPy copies) and this module needs no torch. On CUDA the cache memory is torch's (a CUDA
build of torch holds it, and :mod:`attnexport.backends.block_copy` moves its blocks).
"""

from __future__ import annotations

import os
import sys
import weakref
from pathlib import Path
from typing import Any

import numpy as np

from attnexport.errors import UserError
from attnexport.model_contract import read_contract
from attnexport.model_interface import (
    DECODER_INPUT_NAMES,
    ENCODER_DECODER_INPUT_NAMES,
    CacheSpec,
)
from attnexport.paged_inputs import to_array
from attnexport.runtime.config import checked_max_model_len
from attnexport.runtime.executors.base import Device, Executor
from attnexport.runtime.executors.cache_pool import CachePool, NumpyCachePool, numpy_dtype
from attnexport.runtime.model_input import ModelInput

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}
KERNELS = ("auto", "native", "bodies")
_NUMPY_INDEX_TYPES = {"tensor(int64)": np.int64, "tensor(int32)": np.int32}
# Cache dtypes the caches can hold (a bfloat16 model is refused at export: no CPU kernels; a
# bfloat16 cache under float32 activations runs); int8 caches come with float32 scale caches.
_CACHE_DTYPES = ("float32", "float16", "float64", "bfloat16", "int8")
_BFLOAT16 = 16  # onnx.TensorProto.BFLOAT16, without importing onnx
# Metadata keys (``metadata_props``) that may give the model's maximum length.
_MAX_LEN_KEYS = ("max_model_len", "max_position_embeddings")


def default_num_threads() -> int:
    """The intra-op thread count of a session: torch's when torch is loaded (the process's
    setting, e.g. ``torch.set_num_threads``), else ``OMP_NUM_THREADS``, else the cores this
    process may run on."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return torch.get_num_threads()
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        return int(threads)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def default_session_options(num_threads: int | None = None, spin: bool = True):
    """onnxruntime session options for step-by-step decoding: ``num_threads`` intra-op threads
    (default: :func:`default_num_threads`), one inter-op thread, all graph optimizations.

    Idle worker threads spin (``spin=True``), as in onnxruntime's and onnxruntime-genai's
    defaults: on cores the process has to itself that saves a wake-up per parallel section
    (~10-20% decode speed on 2 cores). Pass ``spin=False`` when other processes share the
    cores: a spinning pool then burns the time slices the others need, and measured on 2 cores
    with two other busy processes (125M model, decode tokens/s) no spinning made 22-28 against
    16-23 at batch 1 and 122-147 against 84-112 at batch 8."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = num_threads or default_num_threads()
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
            onnxruntime-gpu and a CUDA build of torch, which holds the cache memory), as a name
            or a ``torch.device``.
        num_threads: intra-op threads (default: :func:`default_num_threads`).
        spin: let idle worker threads spin (see :func:`default_session_options`).
        session_options: an ``onnxruntime.SessionOptions`` replacing
            :func:`default_session_options`.
        max_model_len: the model's maximum length when its metadata does not give one (at
            most the metadata's when it does).
        kernels: how the attnexport nodes run: ``native``, the C++ CPU kernels of
            :mod:`attnexport.ort_kernels` (an error if that library is not built or
            the device is cuda); ``bodies``, their standard-op function bodies; ``auto``
            (default), native on cpu when the library is built, else the bodies.
        rope_switch_length: the LongRoPE switch length when the file's contract does not
            record one (see :attr:`Executor.rope_switch_length`).
    """

    name = "onnxruntime"

    def __init__(
        self,
        model: str | os.PathLike,
        *,
        device: Any = "cpu",
        num_threads: int | None = None,
        spin: bool = True,
        session_options=None,
        max_model_len: int | None = None,
        kernels: str = "auto",
        rope_switch_length: int | None = None,
    ) -> None:
        import onnxruntime as ort

        from attnexport import ort_kernels

        device = Device.parse(device)
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
        options = session_options or default_session_options(num_threads, spin)
        unavailable = None
        if device.type == "cpu" and kernels != "bodies":
            ort_kernels.check_forced_isa()
            unavailable = ort_kernels.unavailable_reason()
        native = kernels == "native" or (
            kernels == "auto" and device.type == "cpu" and not unavailable
        )
        if native:
            ort_kernels.register(options)
        elif kernels == "auto" and unavailable:
            ort_kernels.warn_fallback(unavailable)
        self.kernels = "native" if native else "bodies"
        self.kernel_isa = ort_kernels.kernel_isa() if native else None
        self.fallback_reason = unavailable if kernels == "auto" and not native else None
        """Why ``auto`` chose the function bodies on cpu (the native kernels' unavailable
        reason), else None."""
        from attnexport.batch_invariance import session_source

        # The batch-invariance rows this CPU's MatMulNBits kernels do not need are dropped
        # (the probe is of the CPU's kernels; another provider keeps the file as it is).
        source = session_source(path, options) if device.type == "cpu" else str(path)
        # The binding below persists across steps instead of being rebuilt for every run.
        self.session = ort.InferenceSession(source, sess_options=options, providers=[provider])
        self.contract, self.path = read_contract(self.session), path
        meta = self.contract
        cache_dtype = meta.cache_dtype
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
        if cache_dtype not in _CACHE_DTYPES:
            raise UserError(
                f"model: cache dtype {cache_dtype!r} is not one onnxruntime runs here "
                f"(expected one of {sorted(_CACHE_DTYPES)})"
            )
        spec = CacheSpec(
            num_layers=meta.num_layers,
            num_kv_heads=meta.num_kv_heads,
            head_size=meta.head_size,
            dtype=numpy_dtype(cache_dtype),
            block_size=meta.block_size,
            num_cross_layers=meta.num_cross_layers,
        )
        found = next((int(meta.extra[k]) for k in _MAX_LEN_KEYS if k in meta.extra), None)
        super().__init__(
            spec,
            vocab_size,
            checked_max_model_len(max_model_len, found, f"the metadata of {path}"),
            device,
            rope_switch_length or meta.rope_switch_length,
        )
        self._binding = None
        self._cache_values: list = []
        self._input_buffers: dict[str, np.ndarray] = {}
        self._logits = _LogitsBuffers(self.vocab_size)

    def _make_cache_pool(self, num_blocks: int, num_cpu_blocks: int) -> CachePool:
        if self.device.type == "cpu":
            return NumpyCachePool(self.cache_spec, num_blocks, num_cpu_blocks)
        from attnexport.runtime.executors.torch_cache_pool import TorchCachePool

        return TorchCachePool(self.cache_spec, num_blocks, num_cpu_blocks, str(self.device))

    def _bind_caches(self) -> None:
        """Wraps every cache once in an OrtValue (zero copy) and binds that same OrtValue as
        the cache input and as its ``_out`` output, for every later step."""
        from onnxruntime import OrtValue

        binding = self.session.io_binding()
        # Outputs come back in binding order: the logits first, copied to the host (they are
        # small and the sampler runs there) whatever the execution provider.
        binding.bind_output(self._logits_name, "cpu")
        values = []
        for name, cache in zip(self.contract.cache_inputs, self.kv_caches, strict=True):
            if isinstance(cache, np.ndarray) and cache.dtype.name == "bfloat16":
                # onnxruntime takes no ml_dtypes array: the same memory, typed bfloat16.
                value = OrtValue.ortvalue_from_numpy_with_onnx_type(
                    cache.view(np.uint16), _BFLOAT16
                )
            elif isinstance(cache, np.ndarray):
                value = OrtValue.ortvalue_from_numpy(cache)
            else:
                value = OrtValue.from_dlpack(cache)
            binding.bind_ortvalue_input(name, value)
            binding.bind_ortvalue_output(self.contract.cache_outputs[name], value)
            values.append(value)
        self._binding, self._cache_values = binding, values
        self._input_buffers, self._logits = {}, _LogitsBuffers(self.vocab_size)

    @property
    def cache_ortvalues(self) -> list:
        """The OrtValues bound as both cache input and output (they share ``kv_caches``)."""
        return list(self._cache_values)

    def execute(self, model_input: ModelInput):
        """:meth:`execute_numpy` as a torch tensor sharing its memory, as every executor's
        ``execute`` returns (the torch-facing API: the engine calls :meth:`execute_numpy`)."""
        import torch

        return torch.from_numpy(self.execute_numpy(model_input))

    def execute_numpy(self, model_input: ModelInput) -> np.ndarray:
        """One step on the host values of ``model_input``; returns the ``[N, vocab_size]``
        float32 logits, which later steps never overwrite while they are referred to."""
        if self._binding is None:
            raise RuntimeError("OrtExecutor.execute: initialize_cache must run first")
        model_input.check_rows(self.vocab_size, self.max_model_len)
        self._bind_inputs(model_input)
        logits = self._logits.next(model_input.num_logits)
        if self._logits.rebind:
            self._binding.bind_output(
                self._logits_name, "cpu", 0, logits.dtype, logits.shape, logits.ctypes.data
            )
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

    def describe(self) -> str:
        provider = PROVIDERS[self.device.type]
        threads = self.session.get_session_options().intra_op_num_threads
        kernels = f"{self.kernels} kernels"
        if self.kernel_isa:
            kernels = f"native kernels ({self.kernel_isa})"
        if self.fallback_reason:
            kernels += f"; native kernels unavailable: {self.fallback_reason}"
        return f"onnxruntime {provider} ({threads} threads, {kernels}): {self.path}"


class _LogitsBuffers:
    """The host memory the session writes a step's ``[rows, vocab]`` float32 logits into.

    The executor owns the memory (a ``bytearray``); each step's logits are the one array made
    over it, and every view or tensor made from that array refers to it (NumPy points views at
    the array over foreign memory, torch keeps the array it shares). The memory is written
    again only once that array is gone (a weak reference tells); while someone holds it, the
    next step gets new memory, so the logits a step returned are never overwritten."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.rebind = True
        """The last :meth:`next` gave new memory or a new shape: the output must be bound."""
        self._memory = bytearray()
        self._returned: weakref.ref[np.ndarray] | None = None
        self._shape: tuple[int, int] | None = None

    def next(self, num_rows: int) -> np.ndarray:
        """The array the next run writes its logits into."""
        shape = (num_rows, self.vocab_size)
        nbytes = num_rows * self.vocab_size * 4
        held = self._returned is not None and self._returned() is not None
        if held or len(self._memory) < nbytes:
            self._memory = bytearray(nbytes)
            self._shape = None
        logits = np.ndarray(shape, np.float32, buffer=self._memory)
        self.rebind = shape != self._shape
        self._shape = shape
        self._returned = weakref.ref(logits)
        return logits
