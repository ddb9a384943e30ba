"""Kernel backends for the attnexport ops; importing this package registers them."""

from attnexport.custom_ops.dispatch import register_backend
from attnexport.runtime.backends.sdpa import SdpaBackend
from attnexport.runtime.backends.xformers import XformersBackend

register_backend(SdpaBackend())
register_backend(XformersBackend())

__all__ = ["SdpaBackend"]
