"""Float32 weights in fewer bytes, bit for bit: ``attnexport.LosslessMatMul4Bits`` and kin.

A checkpoint de-quantized from a GGUF file's Q4_1, Q4_0 or Q8_0 tensors (the real SmolLM2
benchmark checkpoint: Q4_1 and Q8_0) is float32, but each block of 32 weights along ``K`` of a
column is exactly

    W[k, n] = fl32(d[b, n] * q[k, n] + m[b, n])        (k in block b = k // 32)

with ``q`` a 4-bit (0..15: Q4_1) or 8-bit (-128..127, ``m`` = -0.0: Q8_0, and Q4_0's -8..7,
whose negative-scale blocks hold -0.0, ``d * 0``, which only ``m`` = -0.0 gives back) integer
and ``d``, ``m`` float16 numbers. Such a weight is stored as its codes and block parameters,
0.625 bytes a weight (4 bits) or 1.125 (8 bits) instead of 4, and the native kernel decodes it
in registers to the very float32 numbers the checkpoint holds, then multiplies as
``attnexport.PackedMatMul`` does (same panels, same order of fused multiply-adds): the outputs
are bit for bit those of the float32 panels. A batch-1 decode step, which reads every weight
once from memory, reads 3.5-6x fewer bytes.

Exactness by construction: ``d * q`` has at most 11 + 8 significant bits, so the kernel's one
rounding (``fma(q, d, m)``) and the function body's two (``Mul`` then ``Add``, the product exact)
give the same float32; :func:`code_weight` keeps a code only when decoding it reproduces every
weight of the matrix bit for bit, else the matrix stays float32 panels. A matrix of trained
float32 (or bfloat16) weights has no such form and is left as it was; nor has a K-quant's (its
block scales are not float16 numbers).

Layout (``P = N / 32`` panels of :data:`~attnexport.lowering.packed_matmul.PANEL` columns, as
``PackedMatMul``'s, ``K`` a multiple of :data:`BLOCK`):

- ``codes``: 4 bits ``[P, K, 16]`` uint8, byte ``j`` of row ``k`` of panel ``p`` holding column
  ``32p + j`` in its low nibble and ``32p + 16 + j`` in its high one; 8 bits ``[P, K, 32]`` int8.
- ``params``: ``[P, K / 32, 2, 32]`` float16: ``d`` then ``m`` of each block of each column.

A ``SiluAndMul`` that alone reads a gate/up projection joins it, the panels in (gate, up) pairs
(``LosslessMatMul4BitsSiluAndMul``), as ``PackedMatMulSiluAndMul``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
from onnx import helper, numpy_helper

from attnexport.lowering import packed_matmul
from attnexport.lowering.domain_functions import (
    add_function_body,
    add_used_function_bodies,
    save_rewritten,
)
from attnexport.lowering.packed_matmul import (
    PANEL,
    from_pairs,
    from_panels,
    packed_matmul_body,
    packed_matmul_function,
    packed_matmul_silu_and_mul_function,
    to_matmul,
    to_pairs,
)
from attnexport.model_contract import DOMAIN

BLOCK = 32
"""Weights along ``K`` that share a ``d`` and an ``m`` (GGUF's Q4_0/Q4_1/Q8_0 block)."""
OP_TYPES = {4: "LosslessMatMul4Bits", 8: "LosslessMatMul8Bits"}
FUSED_OP_TYPES = {4: "LosslessMatMul4BitsSiluAndMul", 8: "LosslessMatMul8BitsSiluAndMul"}
_PACKED_OP_TYPES = (packed_matmul.OP_TYPE, packed_matmul.FUSED_OP_TYPE)
_CODE_RANGES = {4: (0, 15), 8: (-128, 127)}
_SAMPLE = 256
_CHUNK_BLOCKS = 1 << 18


@dataclass(frozen=True)
class CodedWeight:
    """A ``[K, N]`` float32 weight as codes and block parameters (module doc's layout)."""

    bits: int
    codes: np.ndarray  # [P, K, 16] uint8 (4 bits) or [P, K, 32] int8
    params: np.ndarray  # [P, K / 32, 2, 32] float16

    @property
    def shape(self) -> tuple[int, int]:
        """``(K, N)``."""
        count, k, _ = self.codes.shape
        return k, count * PANEL


def _float16_neighbours(values: np.ndarray) -> list[np.ndarray]:
    """float16 numbers at and beside ``values`` (float64): the candidates for a block's ``d``."""
    nearest = values.astype(np.float16)
    below = np.nextafter(nearest, np.float16(-np.inf))
    above = np.nextafter(nearest, np.float16(np.inf))
    return [nearest, below, above]


def _solve_blocks(blocks: np.ndarray, bits: int):
    """``blocks [B, 32]`` float32 -> ``(q [B, 32] int64, d [B] float16, m [B] float16, solved
    [B] bool)``: each block's codes and parameters where ``fl32(d * q + m)`` is the block exactly
    (``solved``, bit for bit). ``d`` is tried as the float16 numbers nearest each candidate
    step. 4 bits: code 0 is the block's least weight, the steps its span over each possible top
    code (a block need not use code 15: Q4_1). 8 bits: ``m`` = -0.0 (``fma(q, d, -0.0)`` is
    ``d * q`` to the sign of a zero), the steps the largest magnitude over 127 (Q8_0) or the
    weight of largest magnitude over -8 (Q4_0, whose codes -8..7 fit 8 bits: its negative-scale
    blocks' -0.0 comes back, which 4-bit codes with an offset cannot give)."""
    wide = blocks.astype(np.float64)
    low, high = _CODE_RANGES[bits]
    least, greatest = wide.min(axis=1), wide.max(axis=1)
    if bits == 4:
        offset = least
        steps = [(greatest - least) / top for top in range(high, 0, -1)]
    else:
        offset = np.full(len(wide), -0.0)
        extreme = wide[np.arange(len(wide)), np.abs(wide).argmax(axis=1)]
        steps = [np.abs(extreme) / high, extreme / -8]
    q = np.zeros(blocks.shape, np.int64)
    d = np.zeros(len(wide), np.float16)
    m = np.zeros(len(wide), np.float16)
    solved = np.zeros(len(wide), bool)
    exact_offset = offset.astype(np.float16).astype(np.float64) == offset
    # d = 0, every code 0: blocks of one number, m (not a block of -0.0: fma(0, 0, m) is +0.0)
    flat = exact_offset & (greatest == least) & (offset == least)
    flat &= ~np.signbit(blocks).any(axis=1)
    m[flat], solved[flat] = offset[flat], True
    for step_values in steps:
        for candidate in _float16_neighbours(step_values):
            todo = exact_offset & ~solved & (candidate != 0) & np.isfinite(candidate)
            if not todo.any():
                continue
            step = candidate[todo].astype(np.float64)[:, None]
            # (+ 0.0: integer codes, as the kernel converts them: no -0.0 code)
            codes = np.rint((wide[todo] - offset[todo, None]) / step) + 0.0
            decoded = (step * codes + offset[todo, None]).astype(np.float32)
            exact = (
                (codes >= low).all(axis=1)
                & (codes <= high).all(axis=1)
                # bits, not values: a -0.0 weight must come back as -0.0
                & (decoded.view(np.uint32) == blocks[todo].view(np.uint32)).all(axis=1)
            )
            rows = np.flatnonzero(todo)[exact]
            q[rows], d[rows], m[rows] = codes[exact], candidate[rows], offset[rows]
            solved[rows] = True
    return q, d, m, solved


def code_weight(weight: np.ndarray) -> CodedWeight | None:
    """The lossless code of ``weight [K, N]`` float32 (4 bits where every block has one, else 8
    bits), or None when some block has neither, ``K`` is not a multiple of :data:`BLOCK` or
    ``N`` of ``PANEL``. Decoding it (:func:`decode_weight`) gives ``weight`` bit for bit."""
    k, n = weight.shape
    if weight.dtype != np.float32 or k % BLOCK or n % PANEL or not np.isfinite(weight).all():
        return None
    # [K/32, 32, N] -> blocks [K/32 * N, 32], block (b, n) at b * N + n
    blocks = np.ascontiguousarray(weight.reshape(k // BLOCK, BLOCK, n).transpose(0, 2, 1))
    blocks = blocks.reshape(-1, BLOCK)
    for bits in (4, 8):
        # a sample first: a matrix without the form (trained weights) is turned down quickly
        if not _solve_blocks(blocks[:: max(1, len(blocks) // _SAMPLE)], bits)[3].all():
            continue
        # in chunks: the search holds a few float64 copies of what it solves (a 128K-token
        # vocabulary's table would take gigabytes at once)
        parts = []
        for start in range(0, len(blocks), _CHUNK_BLOCKS):
            q, d, m, solved = _solve_blocks(blocks[start : start + _CHUNK_BLOCKS], bits)
            if not solved.all():
                break
            parts.append((q, d, m))
        else:
            q, d, m = (np.concatenate(p) for p in zip(*parts, strict=True))
            return _to_panels(bits, q, d, m, k, n)
    return None


def _to_panels(bits: int, q, d, m, k: int, n: int) -> CodedWeight:
    """The module doc's layout of block codes ``q [K/32 * N, 32]`` and ``d``, ``m`` ``[K/32 *
    N]`` (block (b, n) at b * N + n)."""
    panels = n // PANEL
    # q: [K/32, N, 32] -> [K, N] -> [P, K, 32]
    codes = q.reshape(k // BLOCK, n, BLOCK).transpose(0, 2, 1).reshape(k, panels, PANEL)
    codes = codes.transpose(1, 0, 2)
    if bits == 4:
        half = PANEL // 2
        codes = (codes[..., :half] | (codes[..., half:] << 4)).astype(np.uint8)
    else:
        codes = codes.astype(np.int8)

    # d, m: [K/32, N] -> [P, K/32, 32] each -> [P, K/32, 2, 32]
    def per_panel(values: np.ndarray) -> np.ndarray:
        return values.reshape(k // BLOCK, panels, PANEL).transpose(1, 0, 2)

    params = np.stack([per_panel(d), per_panel(m)], axis=2).astype(np.float16)
    return CodedWeight(bits, np.ascontiguousarray(codes), np.ascontiguousarray(params))


def decode_panels(coded: CodedWeight) -> np.ndarray:
    """The float32 panels ``[P, K, 32]`` of ``coded`` (PackedMatMul's layout)."""
    codes = coded.codes
    if coded.bits == 4:
        codes = np.concatenate([codes & 0x0F, codes >> 4], axis=-1)
    count, k, _ = codes.shape
    q = codes.astype(np.float64).reshape(count, k // BLOCK, BLOCK, PANEL)
    params = coded.params.astype(np.float64)
    scale, offset = params[:, :, 0:1, :], params[:, :, 1:2, :]
    return (q * scale + offset).astype(np.float32).reshape(count, k, PANEL)


def decode_weight(coded: CodedWeight) -> np.ndarray:
    """``[K, N]`` float32: the weight ``coded`` was made from, bit for bit."""
    panels = decode_panels(coded)
    count, k, _ = panels.shape
    return np.ascontiguousarray(panels.transpose(1, 0, 2).reshape(k, count * PANEL))


def lossless_matmul_function(
    opset: int, bits: int, silu_and_mul: bool = False
) -> onnx.FunctionProto:
    """The function body of ``attnexport.LosslessMatMul{bits}Bits[SiluAndMul]`` in standard ops
    of ``opset`` (>= 18): the codes decoded to ``PackedMatMul``'s float32 panels ``B`` (module
    doc), then ``PackedMatMul[SiluAndMul]``'s body. Stock onnxruntime folds the decoding into a
    constant at load."""

    def const(name: str, values, dtype) -> onnx.NodeProto:
        return helper.make_node(
            "Constant", [], [name], value=numpy_helper.from_array(np.array(values, dtype))
        )

    if bits == 4:
        unpack = [
            const("low_mask", 0x0F, np.uint8),
            const("nibble", 4, np.uint8),
            helper.make_node("BitwiseAnd", ["codes", "low_mask"], ["low"]),
            helper.make_node("BitShift", ["codes", "nibble"], ["high"], direction="RIGHT"),
            helper.make_node("Concat", ["low", "high"], ["code_values"], axis=-1),
        ]
    else:
        unpack = [helper.make_node("Identity", ["codes"], ["code_values"])]
    nodes = [
        *unpack,
        helper.make_node("Cast", ["code_values"], ["q"], to=onnx.TensorProto.FLOAT),
        const("block_shape", [0, -1, BLOCK, PANEL], np.int64),
        const("panel_shape", [0, -1, PANEL], np.int64),
        helper.make_node("Reshape", ["q", "block_shape"], ["q_blocks"]),  # [P, K/32, 32, 32]
        helper.make_node("Cast", ["params"], ["params_float"], to=onnx.TensorProto.FLOAT),
        helper.make_node("Split", ["params_float"], ["d", "m"], axis=2, num_outputs=2),
        helper.make_node("Mul", ["q_blocks", "d"], ["scaled"]),  # exact (see module doc)
        helper.make_node("Add", ["scaled", "m"], ["weights"]),
        helper.make_node("Reshape", ["weights", "panel_shape"], ["B"]),  # [P, K, 32]
        *packed_matmul_body(silu_and_mul),
    ]
    op_type = (FUSED_OP_TYPES if silu_and_mul else OP_TYPES)[bits]
    return helper.make_function(
        DOMAIN,
        op_type,
        ["A", "codes", "params"],
        ["Y"],
        nodes,
        [helper.make_opsetid("", opset)],
        ["K", "N"],
    )


CODES_SUFFIX, PARAMS_SUFFIX = ".codes", ".params"
"""A coded weight's initializers: ``<panels' name>.codes`` and ``<panels' name>.params``."""


def code_packed_weights(model: ir.Model) -> int:
    """Rewrites, in place, every ``PackedMatMul[SiluAndMul]`` of the main graph whose float32
    panels have a lossless code (:func:`code_weight`) into
    ``LosslessMatMul{4,8}Bits[SiluAndMul]`` on the codes (the panels dropped when nothing else
    reads them); adds the function bodies. Returns how many nodes. Runs after
    :func:`~attnexport.lowering.packed_matmul.pack_float_weights`."""
    coded = 0
    for node in list(model.graph):
        if node.domain != DOMAIN or node.op_type not in _PACKED_OP_TYPES:
            continue
        fused = node.op_type == packed_matmul.FUSED_OP_TYPE
        panels_value = node.inputs[1]
        panels = panels_value.const_value.numpy()
        code = code_weight(from_panels(from_pairs(panels) if fused else panels))
        if code is None:
            continue
        codes, params = code.codes, code.params
        if fused:
            codes, params = to_pairs(codes), to_pairs(params)
        node.resize_inputs(3)  # A, codes, params
        for index, (suffix, array) in enumerate(
            ((CODES_SUFFIX, codes), (PARAMS_SUFFIX, params)), start=1
        ):
            name = panels_value.name + suffix
            tensor = ir.tensor(array, name=name)
            value = ir.Value(name=name, shape=tensor.shape, type=ir.TensorType(tensor.dtype))
            value.const_value = tensor
            model.graph.register_initializer(value)
            node.replace_input_with(index, value)
        if not panels_value.uses():
            model.graph.initializers.pop(panels_value.name)
        node.op_type = (FUSED_OP_TYPES if fused else OP_TYPES)[code.bits]
        coded += 1
    bodies = {OP_TYPES[bits]: partial(lossless_matmul_function, bits=bits) for bits in OP_TYPES}
    for bits, op_type in FUSED_OP_TYPES.items():
        bodies[op_type] = partial(lossless_matmul_function, bits=bits, silu_and_mul=True)
    add_used_function_bodies(model, bodies)
    return coded


def to_packed_matmul(model: onnx.ModelProto) -> int:
    """The inverse of :func:`code_packed_weights` on a proto: every ``LosslessMatMul*`` back to
    ``PackedMatMul[SiluAndMul]`` on float32 panels (the name its panels had), its codes decoded
    bit for bit; drops the function bodies. Returns how many."""
    graph = model.graph
    initializers = {i.name: i for i in graph.initializer}
    lossless = {op: (bits, False) for bits, op in OP_TYPES.items()}
    lossless |= {op: (bits, True) for bits, op in FUSED_OP_TYPES.items()}
    dropped, added = set(), {}
    for node in graph.node:
        if node.domain != DOMAIN or node.op_type not in lossless:
            continue
        bits, fused = lossless[node.op_type]
        codes_name, params_name = node.input[1], node.input[2]
        codes = numpy_helper.to_array(initializers[codes_name])
        params = numpy_helper.to_array(initializers[params_name])
        if fused:
            codes, params = from_pairs(codes), from_pairs(params)
        panels = decode_panels(CodedWeight(bits, codes, params))
        name = codes_name.removesuffix(CODES_SUFFIX)
        if name not in initializers and name not in added:
            added[name] = numpy_helper.from_array(to_pairs(panels) if fused else panels, name)
        dropped |= {codes_name, params_name}
        del node.input[1:]
        node.input.append(name)
        node.op_type = packed_matmul.FUSED_OP_TYPE if fused else packed_matmul.OP_TYPE
    if not dropped:
        return 0
    kept = [i for i in graph.initializer if i.name not in dropped]
    del graph.initializer[:]
    graph.initializer.extend([*kept, *added.values()])
    functions = [f for f in model.functions if not (f.domain == DOMAIN and f.name in lossless)]
    del model.functions[:]
    model.functions.extend(functions)
    add_function_body(model, packed_matmul.OP_TYPE, packed_matmul_function)
    if any(n.op_type == packed_matmul.FUSED_OP_TYPE for n in graph.node):
        add_function_body(model, packed_matmul.FUSED_OP_TYPE, packed_matmul_silu_and_mul_function)
    return len({n for n in dropped if n.endswith(CODES_SUFFIX)})


def to_float_matmul(model: onnx.ModelProto) -> int:
    """A float32 export's projections of either form (codes, panels) back to ``MatMul`` /
    ``Gemm`` on float32 weights: :func:`to_packed_matmul`, then
    :func:`~attnexport.lowering.packed_matmul.to_matmul`. Returns how many."""
    to_packed_matmul(model)
    return to_matmul(model)


def _has_float_projections(model: onnx.ModelProto) -> bool:
    op_types = {*_PACKED_OP_TYPES, *OP_TYPES.values(), *FUSED_OP_TYPES.values()}
    return any(n.domain == DOMAIN and n.op_type in op_types for n in model.graph.node)


def unpack_float_weights(path: str | os.PathLike) -> int:
    """:func:`to_float_matmul` on the ONNX file at ``path``, rewritten in place (the quantizer's
    first step). Returns the nodes rewritten."""
    path = Path(path)
    if not _has_float_projections(onnx.load(str(path), load_external_data=False)):
        return 0
    model = onnx.load(str(path))
    unpacked = to_float_matmul(model)
    if unpacked:
        save_rewritten(model, path)
    return unpacked
