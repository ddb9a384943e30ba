"""Quieting the libraries the lowering drives (torch.onnx, onnxruntime's quantizer), which log
at levels meant for their own developers."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator


@contextlib.contextmanager
def quieted(logger_name: str, level: int) -> Iterator[None]:
    """Raises logger ``logger_name`` to ``level`` for the block, then restores its level."""
    logger = logging.getLogger(logger_name)
    previous = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(previous)
