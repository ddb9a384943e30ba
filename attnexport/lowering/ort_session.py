"""Running an exported model in onnxruntime with the caches updated in place.

A plain ``InferenceSession.run`` copies every cache input and allocates every cache output:
O(cache size) per step (docs/traps.md). With IO binding, and the *same* buffer bound as
cache input ``X`` and output ``X_out``, the ``ScatterND`` that writes the cache finds its output
already holding its input and writes only the new tokens. The recipe, in onnxruntime terms::

    binding = session.io_binding()
    for name, tensor in inputs.items():        # torch tensors, contiguous, zero copy
        binding.bind_input(name, device, index, onnx_type(tensor), tensor.shape,
                           tensor.data_ptr())
    for name, out in cache_outputs.items():    # from the graph contract
        cache = inputs[name]
        binding.bind_output(out, device, index, onnx_type(cache), cache.shape,
                            cache.data_ptr())  # the input's own buffer
    binding.bind_output("output", device)      # other outputs: onnxruntime allocates
    session.run_with_iobinding(binding)

:class:`PagedOrtSession` does exactly that; the runtime's onnxruntime executor builds on it.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import onnx
import torch

from attnexport.model_contract import GraphContract, read_contract

if TYPE_CHECKING:
    import onnxruntime as ort

_ONNX_TYPES = {
    torch.float32: onnx.TensorProto.FLOAT,
    torch.float16: onnx.TensorProto.FLOAT16,
    torch.bfloat16: onnx.TensorProto.BFLOAT16,
    torch.float64: onnx.TensorProto.DOUBLE,
    torch.int64: onnx.TensorProto.INT64,
    torch.int32: onnx.TensorProto.INT32,
    torch.int8: onnx.TensorProto.INT8,
    torch.uint8: onnx.TensorProto.UINT8,
    torch.bool: onnx.TensorProto.BOOL,
}
_TORCH_TYPES = {v: k for k, v in _ONNX_TYPES.items()}
_TYPE_STRINGS = {
    f"tensor({onnx.helper.tensor_dtype_to_string(v).removeprefix('TensorProto.').lower()})": k
    for k, v in _ONNX_TYPES.items()
}


def _check_fits(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> None:
    """Raises ValueError naming input ``name`` when a value of the integer ``tensor`` lies
    outside ``dtype``: ``Tensor.to`` would wrap it (an int64 slot 2^32 + 5 becomes slot 5)."""
    if tensor.numel() == 0 or torch.bool in (tensor.dtype, dtype):
        return
    info, source = torch.iinfo(dtype), torch.iinfo(tensor.dtype)
    if info.min <= source.min and source.max <= info.max:
        return
    low, high = int(tensor.min()), int(tensor.max())
    if low < info.min or high > info.max:
        bad = low if low < info.min else high
        raise ValueError(
            f"{name}: value {bad} does not fit the model's {dtype} input "
            f"(range [{info.min}, {info.max}])"
        )


def flatten_inputs(inputs: Mapping[str, object]) -> dict[str, torch.Tensor]:
    """Flattens list/tuple/dict values the way the exporter names graph inputs:
    ``{"kv_caches": [a, b]}`` -> ``{"kv_caches_0": a, "kv_caches_1": b}``."""
    flat: dict[str, torch.Tensor] = {}

    def visit(name: str, value) -> None:
        if isinstance(value, torch.Tensor):
            flat[name] = value
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                visit(f"{name}_{i}", item)
        elif isinstance(value, Mapping):
            for key, item in value.items():
                visit(f"{name}_{key}", item)
        else:
            raise TypeError(f"{name}: expected a tensor (or a list/dict of them), got {value!r}")

    for name, value in inputs.items():
        visit(name, value)
    return flat


def _device(tensor: torch.Tensor) -> tuple[str, int]:
    return tensor.device.type, tensor.device.index or 0


def ortvalue_to_torch(value) -> torch.Tensor:
    """A torch tensor (a copy) of a CPU onnxruntime ``OrtValue``, bfloat16 included."""
    onnx_type = value.element_type()
    dtype = _TORCH_TYPES.get(onnx_type)
    if dtype is None:
        raise TypeError(f"output of ONNX element type {onnx_type} has no torch dtype here")
    if dtype != torch.bfloat16:
        return torch.from_numpy(np.asarray(value.numpy())).clone()
    # numpy has no bfloat16: read the raw buffer.
    shape = value.shape()
    count = int(np.prod(shape))
    if count == 0:
        return torch.empty(shape, dtype=torch.bfloat16)
    raw = (ctypes.c_uint16 * count).from_address(value.data_ptr())
    return torch.frombuffer(raw, dtype=torch.bfloat16).reshape(shape).clone()


@dataclass(frozen=True)
class BoundStep:
    """One step's ``IOBinding`` and the tensors bound into it zero-copy (converted index
    copies included): the binding holds only their addresses, so the step owns them for as
    long as it can run."""

    session: ort.InferenceSession
    binding: ort.IOBinding
    tensors: dict[str, torch.Tensor]

    def run(self) -> list[ort.OrtValue]:
        """Runs the step (caches are written in place); its outputs in session order."""
        self.session.run_with_iobinding(self.binding)
        return self.binding.get_outputs()


class PagedOrtSession:
    """An onnxruntime session of an attnexport model whose steps update the caches in place.

    Args:
        model: path of the ``.onnx`` file, or its ``onnx.ModelProto``.
        providers: onnxruntime execution providers (default: CPU).
        session_options: an ``onnxruntime.SessionOptions``.
    """

    def __init__(
        self,
        model: str | os.PathLike | onnx.ModelProto,
        *,
        providers: Sequence[str] | None = None,
        session_options=None,
    ) -> None:
        import onnxruntime as ort

        from attnexport.batch_invariance import session_source

        providers = list(providers or ["CPUExecutionProvider"])
        if isinstance(model, onnx.ModelProto):
            source = model.SerializeToString()
        elif providers == ["CPUExecutionProvider"]:
            # The batch-invariance rows this CPU's MatMulNBits kernels do not need are dropped.
            session_options = session_options or ort.SessionOptions()
            source = session_source(model, session_options)
        else:
            source = str(model)
        self.session = ort.InferenceSession(
            source, sess_options=session_options, providers=providers
        )
        self.contract: GraphContract = read_contract(self.session)
        self.input_types = {i.name: _TYPE_STRINGS.get(i.type) for i in self.session.get_inputs()}
        self.output_names = [o.name for o in self.session.get_outputs()]

    @property
    def input_names(self) -> list[str]:
        return list(self.input_types)

    def bind(self, inputs: Mapping[str, object]) -> BoundStep:
        """One step bound to an ``IOBinding``: every input bound zero-copy, each written cache's
        output bound to the cache's own buffer, other outputs allocated by onnxruntime.

        Args:
            inputs: ``{name: tensor}``, lists/dicts flattened as in :func:`flatten_inputs`.
                Index inputs of another integer dtype are converted; caches must be contiguous
                and of the model's dtype.
        """
        flat = flatten_inputs(inputs)
        missing = [name for name in self.input_types if name not in flat]
        if missing:
            raise ValueError(f"inputs: missing {missing}; the model takes {self.input_names}")
        unknown = sorted(set(flat) - set(self.input_types))
        if unknown:
            raise ValueError(f"inputs: unknown {unknown}; the model takes {self.input_names}")
        caches = set(self.contract.cache_inputs)
        binding = self.session.io_binding()
        for name, tensor in flat.items():
            tensor = self._conform(name, tensor, is_cache=name in caches)
            flat[name] = tensor
            binding.bind_input(
                name,
                *_device(tensor),
                _ONNX_TYPES[tensor.dtype],
                list(tensor.shape),
                tensor.data_ptr(),
            )
        # Outputs in session order, so that binding.get_outputs() lines up with output_names.
        # Non-cache outputs land on the CPU (onnxruntime copies them from the device).
        cache_of = {output: name for name, output in self.contract.cache_outputs.items()}
        for output in self.output_names:
            if output in cache_of:
                cache = flat[cache_of[output]]
                binding.bind_output(
                    output,
                    *_device(cache),
                    _ONNX_TYPES[cache.dtype],
                    list(cache.shape),
                    cache.data_ptr(),
                )
            else:
                binding.bind_output(output, "cpu")
        return BoundStep(self.session, binding, flat)

    def _conform(self, name: str, tensor: torch.Tensor, is_cache: bool) -> torch.Tensor:
        expected = self.input_types[name]
        if is_cache:
            if tensor.dtype != expected:
                raise TypeError(f"{name}: expected cache dtype {expected}, got {tensor.dtype}")
            if not tensor.is_contiguous():
                raise ValueError(f"{name}: expected a contiguous cache (it is updated in place)")
            return tensor
        if expected is not None and tensor.dtype != expected:
            if tensor.dtype.is_floating_point or expected.is_floating_point:
                raise TypeError(f"{name}: expected dtype {expected}, got {tensor.dtype}")
            _check_fits(name, tensor, expected)
            tensor = tensor.to(expected)
        return tensor.contiguous()

    def run(self, inputs: Mapping[str, object]) -> dict[str, torch.Tensor]:
        """Runs one step; caches are updated in place. Returns the non-cache outputs
        ``{name: tensor}`` (on CPU)."""
        outputs = self.bind(inputs).run()
        written = set(self.contract.cache_outputs.values())
        return {
            name: ortvalue_to_torch(value)
            for name, value in zip(self.output_names, outputs, strict=True)
            if name not in written
        }
