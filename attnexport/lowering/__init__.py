"""Lowering: torch.export passes and ONNX translation of the attnexport ops."""
