"""The error of weight quantization, in a module of its own so that the quantizer's parts
(:mod:`attnexport.lowering.quantize`, :mod:`attnexport.lowering.lm_head`) share it without
importing each other."""

from __future__ import annotations


class QuantizationError(ValueError):
    """A bad quantization option or a model the quantizer cannot rewrite as asked."""
