"""Kernel backends for the attnexport ops; importing this package registers them.

Registering a backend never imports its optional dependency: ``ipex`` imports
intel_extension_for_pytorch on first use (``unavailable_reason()`` says why it cannot).
"""

from attnexport.custom_ops.dispatch import register_backend
from attnexport.runtime.backends.ipex import IpexBackend
from attnexport.runtime.backends.sdpa import SdpaBackend

register_backend(SdpaBackend())
register_backend(IpexBackend())

__all__ = ["IpexBackend", "SdpaBackend"]
