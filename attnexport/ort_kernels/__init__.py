"""Native onnxruntime CPU kernels for the attnexport domain (``libattnexport_ort.so``).

Stock onnxruntime runs an attnexport node through its standard-op function body. Registering
this library with a session replaces the bodies of ``PagedAttention``, ``ReshapeAndCache`` and
``NeoxRotaryEmbedding`` by C++ kernels (float32, float16, bfloat16 on the CPU execution provider;
the KV caches may be float32, float16, bfloat16 or int8 with float32 scale caches, whatever the
activations' dtype): attention reads the key and value rows where they lie in the paged cache
instead of gathering them into a padded batch first, and the rotation is one node instead of
seven. Nodes the
kernels do not cover (``VarlenAttention``, nodes placed on another execution provider) keep
their bodies. ``scripts/build_ort_kernels.sh`` (run by ``make``) builds the library next to
this file.
"""

from __future__ import annotations

from pathlib import Path

LIBRARY = Path(__file__).with_name("libattnexport_ort.so")
BUILD_HINT = "build it with `bash scripts/build_ort_kernels.sh` (needs g++; `make` runs it)"


def unavailable_reason() -> str | None:
    """Why the kernel library cannot be used here, or None when it can."""
    if not LIBRARY.is_file():
        return f"{LIBRARY.name} is not built; {BUILD_HINT}"
    return None


def register(session_options) -> None:
    """Registers the kernels with an ``onnxruntime.SessionOptions`` (raises when unbuilt)."""
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"attnexport onnxruntime kernels: {reason}")
    session_options.register_custom_ops_library(str(LIBRARY))
