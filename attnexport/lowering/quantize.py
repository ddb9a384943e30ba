"""Weight-only quantization of an exported ONNX file: each ``MatMul`` on a constant 2-D weight
(the projections, after :func:`~attnexport.lowering.onnx_passes.gemm_to_matmul`) becomes
``com.microsoft.MatMulNBits`` with int4 or int8 blocks, through onnxruntime's own quantizer
(``onnxruntime.quantization.matmul_nbits_quantizer``) and the algorithm it is asked for:

* ``rtn``: round to nearest per block (``DefaultWeightOnlyQuantConfig``, onnxruntime's C++
  block quantizer), symmetric or with a zero point per block;
* ``k_quant``: a zero point per block and a scale searched per block for the least weighted
  squared error (``KQuantWeightOnlyQuantConfig``, after llama.cpp's k-quants);
* ``hqq``: half-quadratic quantization (``HQQWeightOnlyQuantConfig``), a float zero point per
  block fitted to the weights: onnxruntime's CPU kernel has no packed path for float zero
  points and dequantizes the weights on every call, so they are moved onto the packed
  kernels (:mod:`attnexport.lowering.float_zero_points`).

A *layer* is named after its weight: ``model.layers.0.mlp.down_proj`` for the MatMul on
``model.layers.0.mlp.down_proj.weight``; the projection whose output is the model's logits
output is ``lm_head`` (whatever its weight, so that a tied embedding is found too). The logits
projection is quantized on its own terms (``lm_head``: float, int8 or int4; symmetric round to
nearest): a tied embedding stays one table, read by the logits projection and by the
embedding's ``Gather`` (:mod:`attnexport.lowering.lm_head`). Layers stay float when a
``keep_float`` pattern (``fnmatch``) matches their name.

docs/quantization.md has the options, the defaults and the measurements they come from.
"""

from __future__ import annotations

import contextlib
import fnmatch
import io
import logging
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import onnx
from onnx import external_data_helper

from attnexport.lowering.domain_functions import save_rewritten
from attnexport.lowering.quantization_error import QuantizationError
from attnexport.lowering.quiet import quieted

WEIGHT_FORMATS = {"float": None, "int4": 4, "int8": 8}
"""``export --weights``: the weight formats and their bits (``float``: not quantized)."""
ALGORITHMS = ("rtn", "k_quant", "hqq")
"""``export --weights-algorithm``: onnxruntime's weight-only quantization algorithms."""
FITTED = ("k_quant", "hqq")
"""The algorithms that fit a zero point per block (asymmetric only)."""
LM_HEAD_FORMATS = {"float": None, "int8": 8, "int4": 4}
"""``export --lm-head``: the logits projection's formats and their bits."""
LM_HEAD = "lm_head"
ZERO_POINT_OFFSETS = ("int8", "float32")
"""``export --weights-offsets``: how float zero points' offsets are stored
(:mod:`attnexport.lowering.float_zero_points`)."""
ACTIVATIONS = ("int16", "int8")
"""``export --weights-activations``: how finely the activations an 8-bit weight multiplies are
rounded, per block of the input dimension: to int16 (``attnexport.MatMul8Bits``,
:mod:`attnexport.lowering.matmul_8bits`) or to int8 (MatMulNBits at ``accuracy_level`` 4)."""
PREFILL_ACTIVATIONS = ("int16", "int8")
"""``export --weights-prefill-activations``: how finely ``attnexport.MatMul8Bits`` / ``MatMul4Bits``
round the activations of calls of :data:`PREFILL_ROWS` rows or more (a prefill's): as every
other call's (``int16``), or to int8 steps, multiplied 4 bytes a lane with vpdpbusd on
AVX512_VNNI (the node attribute ``int8_from_rows``)."""
PREFILL_ROWS = 128
"""The rows from which ``--weights-prefill-activations int8`` applies: above the decode batches
of the benchmarks (32) and a serving batch's usual size, at a 128-token prompt's prefill."""
DECODE_ACTIVATIONS = ("int16", "int8")
"""``export --weights-decode-activations``: with ``--weights-prefill-activations int8``, how finely
``attnexport.MatMul8Bits`` / ``MatMul4Bits`` round the activations of the other calls (a decode
step's): as int16 steps (the default), or to int8 steps as well (``int8_from_rows`` 1: every call
alike, so a row's numbers again do not depend on its batch; a batched decode's products with
vpdpbusd, SmolLM2 int4 at batch 32: 0.79x the step)."""
ACCURACY_LEVELS = range(5)  # MatMulNBits: 0 unset, 1 fp32, 2 fp16, 3 bf16, 4 int8 compute

DEFAULTS = {
    "int4": {
        "block_size": 32,
        "symmetric": False,
        "accuracy_level": 4,
        "algorithm": "hqq",
        "lm_head": "int8",
        "lm_head_block_size": 64,
        "offsets": "int8",
        "activations": "int16",
        "prefill_activations": "int16",
        "decode_activations": "int16",
    },
    "int8": {
        "block_size": 32,
        "symmetric": False,
        "accuracy_level": 4,
        "algorithm": "hqq",
        "lm_head": "int8",
        "offsets": "int8",
        "activations": "int16",
        "prefill_activations": "int16",
        "decode_activations": "int16",
    },
}
"""The defaults of each format (docs/quantization.md says why)."""


@dataclass(frozen=True)
class WeightQuantization:
    """How ``export --weights`` quantizes the weights. Options left None take the format's
    :data:`DEFAULTS`.

    Attributes:
        format: ``"int4"`` or ``"int8"`` (a key of :data:`WEIGHT_FORMATS` other than float).
        block_size: weights per scale along the input dimension (a power of 2, >= 16).
        symmetric: no zero points (True) or a zero point per block (False).
        accuracy_level: MatMulNBits' ``accuracy_level`` (4: int8 compute on the CPU).
        algorithm: one of :data:`ALGORITHMS`.
        lm_head: the logits projection's format, a key of :data:`LM_HEAD_FORMATS`.
        lm_head_block_size: the logits projection's block size (None: the format's default,
            else ``block_size``).
        offsets: how the offsets of float zero points (``hqq``) are stored, one of
            :data:`ZERO_POINT_OFFSETS` (:mod:`attnexport.lowering.float_zero_points`).
        activations: one of :data:`ACTIVATIONS`; ``"int16"`` writes every quantized layer as
            ``attnexport.MatMul8Bits`` or ``MatMul4Bits`` (``accuracy_level`` and ``offsets``
            then do not apply).
        prefill_activations: one of :data:`PREFILL_ACTIVATIONS`; ``"int8"`` (with
            ``activations="int16"`` only) rounds calls of :data:`PREFILL_ROWS` rows or more to
            int8 steps: a faster prefill, coarser numbers for its tokens.
        decode_activations: one of :data:`DECODE_ACTIVATIONS`; ``"int8"`` (with
            ``prefill_activations="int8"`` only) rounds every call to int8 steps.
        keep_float: ``fnmatch`` patterns of the layer names that stay float.
        batch_invariant: give every MatMulNBits at least two rows, so that a sequence's
            numbers do not depend on the batch it runs in
            (:mod:`attnexport.batch_invariance`).
    """

    format: str
    block_size: int | None = None
    symmetric: bool | None = None
    accuracy_level: int | None = None
    algorithm: str | None = None
    lm_head: str | None = None
    lm_head_block_size: int | None = None
    offsets: str | None = None
    activations: str | None = None
    prefill_activations: str | None = None
    decode_activations: str | None = None
    keep_float: tuple[str, ...] = field(default_factory=tuple)
    batch_invariant: bool = True

    def __post_init__(self) -> None:
        if WEIGHT_FORMATS.get(self.format) is None:
            formats = [k for k, v in WEIGHT_FORMATS.items() if v is not None]
            raise QuantizationError(
                f"--weights: expected {' or '.join(formats)}, got {self.format!r}"
            )
        defaults = dict(DEFAULTS[self.format])
        # The fitted algorithms fit zero points; asking for symmetric blocks asks for rtn.
        if self.algorithm in FITTED or (self.algorithm is None and defaults["algorithm"] in FITTED):
            defaults["symmetric"] = False
        if self.symmetric and self.algorithm is None:
            defaults["algorithm"] = "rtn"
        for name, value in defaults.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        if self.lm_head_block_size is None:
            object.__setattr__(self, "lm_head_block_size", self.block_size)
        for flag, size in (
            ("--weights-block-size", self.block_size),
            ("--lm-head-block-size", self.lm_head_block_size),
        ):
            if type(size) is not int or size < 16 or size & (size - 1):
                raise QuantizationError(
                    f"{flag}: expected a power of 2 >= 16 (MatMulNBits), got {size!r}"
                )
        if self.accuracy_level not in ACCURACY_LEVELS:
            raise QuantizationError(
                f"--weights-accuracy-level: expected 0 to 4, got {self.accuracy_level!r}"
            )
        for flag, value, choices in (
            ("--weights-algorithm", self.algorithm, ALGORITHMS),
            ("--lm-head", self.lm_head, tuple(LM_HEAD_FORMATS)),
            ("--weights-offsets", self.offsets, ZERO_POINT_OFFSETS),
            ("--weights-activations", self.activations, ACTIVATIONS),
            ("--weights-prefill-activations", self.prefill_activations, PREFILL_ACTIVATIONS),
            ("--weights-decode-activations", self.decode_activations, DECODE_ACTIVATIONS),
        ):
            if value not in choices:
                raise QuantizationError(f"{flag}: expected {', '.join(choices)}, got {value!r}")
        if self.prefill_activations == "int8" and self.activations != "int16":
            raise QuantizationError(
                "--weights-prefill-activations int8: only with --weights-activations int16 "
                "(attnexport.MatMul8Bits / MatMul4Bits)"
            )
        if self.decode_activations == "int8" and self.prefill_activations != "int8":
            raise QuantizationError(
                "--weights-decode-activations int8: only with --weights-prefill-activations int8"
            )
        if self.algorithm in FITTED and self.symmetric:
            raise QuantizationError(
                f"--weights-algorithm {self.algorithm}: fits a zero point per block; "
                "pass --weights-asymmetric"
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
            "algorithm": self.algorithm,
            "lm_head": self.lm_head,
            "lm_head_block_size": self.lm_head_block_size,
            "offsets": self.offsets,
            "activations": self.activations,
            "prefill_activations": self.prefill_activations,
            "decode_activations": self.decode_activations,
            "batch_invariant": self.batch_invariant,
            "quantized_layers": quantized,
            "float_layers": float_layers,
        }


def _layer_name(weight: str) -> str:
    for suffix in (".T", ".weight"):
        weight = weight.removesuffix(suffix)
    return weight


def _is_projection(node: onnx.NodeProto, initializers: dict) -> bool:
    """A MatMul on a constant 2-D weight, or the Gemm ``x @ W^T`` a tied logits projection
    keeps (:func:`~attnexport.lowering.onnx_passes.gemm_to_matmul`)."""
    if node.domain not in ("", "ai.onnx") or node.op_type not in ("MatMul", "Gemm"):
        return False
    weight = initializers.get(node.input[1])
    return weight is not None and len(weight.dims) == 2


def quantizable_layers(model: onnx.ModelProto) -> dict[str, str]:
    """``{layer name: node name}`` for every projection of the main graph on a constant 2-D
    weight (module doc for the names), in graph order. The logits projection is the one whose
    output is a graph output, or whose weight an embedding ``Gather`` also reads (a tied head
    followed by soft-capping)."""
    initializers = {i.name: i for i in model.graph.initializer}
    outputs = {o.name for o in model.graph.output}
    gathered = {n.input[0] for n in model.graph.node if n.op_type == "Gather"}
    layers = {}
    for node in model.graph.node:
        if not _is_projection(node, initializers):
            continue
        head = node.output[0] in outputs or node.input[1] in gathered
        layers[LM_HEAD if head else _layer_name(node.input[1])] = node.name
    return layers


@contextlib.contextmanager
def _quiet_quantizer():
    """The quantizer logs every node it visits at INFO, and importing it sets the root logger
    to INFO (``logging.basicConfig``), which would make every later library chatty: both are
    undone. Its k-quant path prints a progress bar to stdout and its HQQ path warns about
    read-only arrays it does not write: neither reaches the user."""
    root = logging.getLogger()
    root_level, root_handlers = root.level, list(root.handlers)
    try:
        with (
            quieted("onnxruntime.quantization.matmul_nbits_quantizer", logging.WARNING),
            quieted("neural_compressor", logging.WARNING),
            contextlib.redirect_stdout(io.StringIO()),
            warnings.catch_warnings(),
        ):
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
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
        or (name == LM_HEAD and quantization.lm_head == "float")
    ]


def _algorithm_config(nbits, quantization: WeightQuantization):
    """onnxruntime's config object of ``quantization.algorithm``."""
    if quantization.algorithm == "hqq":
        return nbits.HQQWeightOnlyQuantConfig(
            block_size=quantization.block_size, bits=quantization.bits
        )
    if quantization.algorithm == "k_quant":
        return nbits.KQuantWeightOnlyQuantConfig()
    return nbits.DefaultWeightOnlyQuantConfig(
        block_size=quantization.block_size,
        is_symmetric=quantization.symmetric,
        accuracy_level=quantization.accuracy_level,
        bits=quantization.bits,
    )


def _reading_each_weight(quantize, graph: onnx.GraphProto, base_dir: str):
    """onnxruntime's per-node ``quantize(node, graph_stack)`` with the node's weight read from
    its external data file for the call only, so that one float weight at a time is in memory.

    The weight is read into a scratch graph of its own, the innermost of the graph stack (where
    the quantizer looks for the weight first and adds what it makes): a tensor read into the
    model itself would stay in the model's protobuf arena, which frees nothing before the
    whole model goes. What the quantizer made moves to ``graph``, in the order it was made."""

    def quantize_reading_weight(node: onnx.NodeProto, graph_stack: list) -> list:
        name = node.input[1] if len(node.input) > 1 else None
        weight = next((i for i in graph.initializer if i.name == name), None)
        if weight is None or not external_data_helper.uses_external_data(weight):
            return quantize(node, graph_stack)
        scratch = onnx.GraphProto()
        scratch.initializer.add().CopyFrom(weight)
        external_data_helper.load_external_data_for_tensor(scratch.initializer[0], base_dir)
        nodes = quantize(node, [*graph_stack, scratch])
        graph.initializer.extend(scratch.initializer[1:])
        return nodes

    return quantize_reading_weight


def _quantize_layers(
    model: onnx.ModelProto, exclude: list[str], quantization, base_dir: str = ""
) -> onnx.ModelProto:
    """The projections but ``exclude`` (node names) rewritten by onnxruntime's quantizer.
    ``model``'s weights may stay in external data files under ``base_dir`` (the directory of
    its ``.onnx`` file; unused when they are in memory): the quantizers that
    work node by node (``rtn``, ``hqq``) read each weight as they quantize it; ``k_quant``'s
    whole-model pass gets them all first."""
    with _quiet_quantizer():
        from onnxruntime.quantization import matmul_nbits_quantizer as nbits

    quantizer = nbits.MatMulNBitsQuantizer(
        model,
        bits=quantization.bits,
        block_size=quantization.block_size,
        is_symmetric=quantization.symmetric,
        accuracy_level=quantization.accuracy_level,
        nodes_to_exclude=exclude,
        algo_config=_algorithm_config(nbits, quantization),
    )
    if quantizer.node_quantizer is not None:
        quantizer.node_quantizer.quantize = _reading_each_weight(
            quantizer.node_quantizer.quantize, model.graph, base_dir
        )
    else:
        external_data_helper.load_external_data_for_model(model, base_dir)
    with _quiet_quantizer():
        quantizer.process()
    quantized = quantizer.model.model
    # HQQ's nodes carry no accuracy_level; the MatMulNBits kernel reads it per node.
    for node in quantized.graph.node:
        if node.op_type == "MatMulNBits" and not any(
            a.name == "accuracy_level" for a in node.attribute
        ):
            node.attribute.append(
                onnx.helper.make_attribute("accuracy_level", quantization.accuracy_level)
            )
    return quantized


def quantize_weights(path: str | os.PathLike, quantization: WeightQuantization) -> dict:
    """Quantizes the weights of the ONNX file at ``path`` in place (module doc).

    Returns:
        The manifest's ``weights`` object (:meth:`WeightQuantization.manifest_entry`).

    Raises:
        QuantizationError: a ``keep_float`` pattern matches nothing, the model has no layer to
            quantize, or the quantizer left a layer it was asked to quantize.
    """
    from attnexport.batch_invariance import pad_matmulnbits_rows
    from attnexport.lowering import lm_head
    from attnexport.lowering.float_zero_points import split_float_zero_points
    from attnexport.lowering.lossless_weights import unpack_float_weights
    from attnexport.lowering.matmul_8bits import (
        fuse_qkv_rotary,
        fuse_silu_and_mul,
        to_matmul_8bits,
    )

    path = Path(path)
    base_dir = str(path.parent)
    # a float export's panels (attnexport.PackedMatMul) back to MatMul on [K, N] weights
    unpack_float_weights(path)
    # the graph alone: each float weight is read from model.onnx.data as it is quantized
    model = onnx.load(str(path), load_external_data=False)
    layers = quantizable_layers(model)
    if not layers:
        raise QuantizationError(f"{path}: no MatMul on a constant 2-D weight to quantize")
    keep = float_layers(layers, quantization)
    head_bits = LM_HEAD_FORMATS[quantization.lm_head]
    exclude = [layers[name] for name in keep]
    if LM_HEAD in layers and head_bits is not None:
        exclude.append(layers[LM_HEAD])
    quantized = _quantize_layers(model, exclude, quantization, base_dir)
    if LM_HEAD in layers and head_bits is not None:
        lm_head.quantize_lm_head(
            quantized,
            layers[LM_HEAD],
            bits=head_bits,
            block_size=quantization.lm_head_block_size,
            accuracy_level=quantization.accuracy_level,
            base_dir=base_dir,
        )
    # the weights that stay float, read before model.onnx.data is rewritten
    external_data_helper.load_external_data_for_model(quantized, base_dir)
    left = [name for name, node in quantizable_layers(quantized).items() if name not in keep]
    count = sum(n.op_type == "MatMulNBits" for n in quantized.graph.node)
    if left or count != len(layers) - len(keep):
        raise QuantizationError(
            f"{path}: onnxruntime's quantizer left {left or count} (expected "
            f"{len(layers) - len(keep)} MatMulNBits nodes)"
        )
    # Before the padding, so that only MatMulNBits gets the padding row: MatMul8Bits and
    # MatMul4Bits (batch-invariant unless told otherwise), AddBlockOffsets and the float32
    # offsets' standard ops compute every row alike and read the rows they are given.
    if quantization.activations == "int16":
        int8_from_rows = 0
        if quantization.prefill_activations == "int8":
            int8_from_rows = 1 if quantization.decode_activations == "int8" else PREFILL_ROWS
        to_matmul_8bits(quantized, quantization.batch_invariant, (4, 8), int8_from_rows)
        fuse_silu_and_mul(quantized)
        fuse_qkv_rotary(quantized)
    split_float_zero_points(quantized, quantization.offsets)
    if quantization.batch_invariant:
        pad_matmulnbits_rows(quantized)
    save_rewritten(quantized, path)
    return quantization.manifest_entry(keep, count)
