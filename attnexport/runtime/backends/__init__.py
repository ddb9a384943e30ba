"""Kernel backends for the attnexport ops; importing this package registers them."""

from attnexport.custom_ops.dispatch import register_backend
from attnexport.runtime.backends.sdpa import SdpaBackend

register_backend(SdpaBackend())

__all__ = ["SdpaBackend"]
