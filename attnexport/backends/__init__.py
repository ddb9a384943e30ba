"""Kernel backends for the attnexport ops; importing this package registers them.

Registering a backend never imports its optional dependency: ``ipex`` imports
intel_extension_for_pytorch and ``xformers`` imports xformers on first use
(``unavailable_reason()`` says why one cannot run here).
"""

from attnexport.backends.ipex import IpexBackend
from attnexport.backends.sdpa import SdpaBackend
from attnexport.backends.xformers import XformersBackend
from attnexport.custom_ops.dispatch import register_backend

register_backend(SdpaBackend())
register_backend(IpexBackend())
register_backend(XformersBackend())

__all__ = ["IpexBackend", "SdpaBackend", "XformersBackend"]
