"""Weight-only quantization of an exported ONNX file: each ``MatMul`` on a constant 2-D weight
(the projections, after :func:`~attnexport.lowering.onnx_passes.gemm_to_matmul`) becomes
``com.microsoft.MatMulNBits`` with int4 or int8 blocks, through onnxruntime's own quantizer
(``onnxruntime.quantization.matmul_nbits_quantizer``, round-to-nearest per block).

A *layer* is named after its weight: ``model.layers.0.mlp.down_proj`` for the MatMul on
``model.layers.0.mlp.down_proj.weight``; the MatMul whose output is the model's logits output
is ``lm_head`` (whatever its weight, so that a tied embedding is found too). Layers stay float
when a ``keep_float`` pattern (``fnmatch``) matches their name, and ``lm_head`` when
``quantize_lm_head`` is off. The defaults follow onnxruntime-genai's builder for the CPU
(``-p int4 -e cpu``): block size 32, symmetric, accuracy level 4 (int8 activations in the
MatMulNBits kernels), lm_head quantized.
"""

from __future__ import annotations

import contextlib
import fnmatch
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from attnexport.lowering.onnx_export import EXTERNAL_DATA_BYTES
from attnexport.lowering.quiet import quieted

WEIGHT_FORMATS = {"float": None, "int4": 4, "int8": 8}
"""``export --weights``: the weight formats and their bits (``float``: not quantized)."""
DEFAULT_BLOCK_SIZE = 32
DEFAULT_ACCURACY_LEVEL = 4
LM_HEAD = "lm_head"
ACCURACY_LEVELS = range(5)  # MatMulNBits: 0 unset, 1 fp32, 2 fp16, 3 bf16, 4 int8 compute


class QuantizationError(ValueError):
    """A bad quantization option or a model the quantizer cannot rewrite as asked."""


@dataclass(frozen=True)
class WeightQuantization:
    """How ``export --weights`` quantizes the weights.

    Attributes:
        format: ``"int4"`` or ``"int8"`` (a key of :data:`WEIGHT_FORMATS` other than float).
        block_size: weights per scale along the input dimension (a power of 2, >= 16).
        symmetric: no zero points (True) or a zero point per block (False).
        accuracy_level: MatMulNBits' ``accuracy_level`` (4: int8 compute on the CPU).
        keep_float: ``fnmatch`` patterns of the layer names that stay float.
        quantize_lm_head: quantize the logits projection too.
    """

    format: str
    block_size: int = DEFAULT_BLOCK_SIZE
    symmetric: bool = True
    accuracy_level: int = DEFAULT_ACCURACY_LEVEL
    keep_float: tuple[str, ...] = field(default_factory=tuple)
    quantize_lm_head: bool = True

    def __post_init__(self) -> None:
        if WEIGHT_FORMATS.get(self.format) is None:
            formats = [k for k, v in WEIGHT_FORMATS.items() if v is not None]
            raise QuantizationError(
                f"--weights: expected {' or '.join(formats)}, got {self.format!r}"
            )
        size = self.block_size
        if type(size) is not int or size < 16 or size & (size - 1):
            raise QuantizationError(
                f"--weights-block-size: expected a power of 2 >= 16 (MatMulNBits), got {size!r}"
            )
        if self.accuracy_level not in ACCURACY_LEVELS:
            raise QuantizationError(
                f"--weights-accuracy-level: expected 0 to 4, got {self.accuracy_level!r}"
            )

    @property
    def bits(self) -> int:
        return WEIGHT_FORMATS[self.format]

    def manifest_entry(self, float_layers: list[str], quantized: int) -> dict:
        """The manifest's ``weights`` object."""
        return {
            "format": self.format,
            "bits": self.bits,
            "block_size": self.block_size,
            "symmetric": self.symmetric,
            "accuracy_level": self.accuracy_level,
            "quantized_layers": quantized,
            "float_layers": float_layers,
        }


def _layer_name(weight: str) -> str:
    for suffix in (".T", ".weight"):
        weight = weight.removesuffix(suffix)
    return weight


def quantizable_layers(model: onnx.ModelProto) -> dict[str, str]:
    """``{layer name: MatMul node name}`` for every MatMul of the main graph on a constant 2-D
    weight (module doc for the names), in graph order."""
    initializers = {i.name: i for i in model.graph.initializer}
    outputs = {o.name for o in model.graph.output}
    layers = {}
    for node in model.graph.node:
        if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx"):
            continue
        weight = initializers.get(node.input[1])
        if weight is None or len(weight.dims) != 2:
            continue
        name = LM_HEAD if node.output[0] in outputs else _layer_name(weight.name)
        layers[name] = node.name
    return layers


@contextlib.contextmanager
def _quiet_quantizer():
    """The quantizer logs every node it visits at INFO, and importing it sets the root logger
    to INFO (``logging.basicConfig``), which would make every later library chatty: both are
    undone."""
    root = logging.getLogger()
    root_level, root_handlers = root.level, list(root.handlers)
    try:
        with quieted("onnxruntime.quantization.matmul_nbits_quantizer", logging.WARNING):
            yield
    finally:
        root.setLevel(root_level)
        root.handlers[:] = root_handlers


def float_layers(layers: dict[str, str], quantization: WeightQuantization) -> list[str]:
    """The layers that stay float; QuantizationError for a ``keep_float`` pattern that matches
    no layer (a typo would otherwise quantize what it meant to keep)."""
    for pattern in quantization.keep_float:
        if not fnmatch.filter(layers, pattern):
            raise QuantizationError(
                f"--weights-keep-float {pattern!r} matches no layer; the layers are "
                f"{', '.join(layers)}"
            )
    return [
        name
        for name in layers
        if any(fnmatch.fnmatchcase(name, p) for p in quantization.keep_float)
        or (name == LM_HEAD and not quantization.quantize_lm_head)
    ]


def quantize_weights(path: str | os.PathLike, quantization: WeightQuantization) -> dict:
    """Quantizes the weights of the ONNX file at ``path`` in place (module doc).

    Returns:
        The manifest's ``weights`` object (:meth:`WeightQuantization.manifest_entry`).

    Raises:
        QuantizationError: a ``keep_float`` pattern matches nothing, the model has no layer to
            quantize, or the quantizer left a layer it was asked to quantize.
    """
    with _quiet_quantizer():
        from onnxruntime.quantization import matmul_nbits_quantizer as nbits

    path = Path(path)
    model = onnx.load(str(path))
    layers = quantizable_layers(model)
    if not layers:
        raise QuantizationError(f"{path}: no MatMul on a constant 2-D weight to quantize")
    keep = float_layers(layers, quantization)
    config = nbits.DefaultWeightOnlyQuantConfig(
        block_size=quantization.block_size,
        is_symmetric=quantization.symmetric,
        accuracy_level=quantization.accuracy_level,
        bits=quantization.bits,
    )
    quantizer = nbits.MatMulNBitsQuantizer(
        model,
        bits=quantization.bits,
        block_size=quantization.block_size,
        is_symmetric=quantization.symmetric,
        accuracy_level=quantization.accuracy_level,
        nodes_to_exclude=[layers[name] for name in keep],
        algo_config=config,
    )
    with _quiet_quantizer():
        quantizer.process()
    quantized = quantizer.model.model
    left = [name for name, node in quantizable_layers(quantized).items() if name not in keep]
    count = sum(n.op_type == "MatMulNBits" for n in quantized.graph.node)
    if left or count != len(layers) - len(keep):
        raise QuantizationError(
            f"{path}: onnxruntime's quantizer left {left or count} (expected "
            f"{len(layers) - len(keep)} MatMulNBits nodes)"
        )
    external = sum(len(i.raw_data) for i in quantized.graph.initializer) > EXTERNAL_DATA_BYTES
    data = path.with_name(f"{path.name}.data")
    if data.exists():
        data.unlink()
    onnx.save(quantized, str(path), save_as_external_data=external, location=data.name)
    onnx.checker.check_model(str(path), full_check=True)
    return quantization.manifest_entry(keep, count)
