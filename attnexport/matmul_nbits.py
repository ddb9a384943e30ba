"""onnxruntime's ``com.microsoft.MatMulNBits`` node as attnexport writes it: ``A[M, K] @ B``
with ``B`` ``[N, blocks, block bytes]`` of ``bits``-bit weights in blocks of ``block_size``
along ``K`` and a float32 scale per block (torch-free and onnx-free until called)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import onnx


def matmulnbits_node(
    inputs: list[str],
    output: str,
    *,
    k: int,
    n: int,
    bits: int,
    block_size: int,
    accuracy_level: int,
    name: str | None = None,
) -> onnx.NodeProto:
    """A MatMulNBits node reading ``inputs`` (``A``, the packed weight, the scales[, zero
    points]) into ``output``."""
    from onnx import helper

    return helper.make_node(
        "MatMulNBits",
        inputs,
        [output],
        name=name,
        domain="com.microsoft",
        K=k,
        N=n,
        bits=bits,
        block_size=block_size,
        accuracy_level=accuracy_level,
    )
