"""Native onnxruntime CPU kernels for the attnexport domain (``libattnexport_ort.so``).

Stock onnxruntime runs an attnexport node through its standard-op function body. Registering
this library with a session replaces the bodies of ``PagedAttention``, ``ReshapeAndCache``,
``NeoxRotaryEmbedding``, ``NeoxQKVRotaryEmbedding``, ``SiluAndMul`` and ``FusedAddRMSNorm`` by
C++ kernels (float32, float16, bfloat16 activations on the CPU execution provider; the KV caches
may be float32, float16, bfloat16 or int8 with float32 scale caches, whatever the activations'
dtype): attention reads the key and value rows where they lie in the paged cache instead of
gathering them into a padded batch first, and the rotation is one node instead of seven. Nodes
the kernels do not cover (``VarlenAttention``, nodes placed on another execution provider) keep
their bodies.

The package build (``pip install``, ``pip wheel``, ``python -m build``; ``make`` in a checkout)
compiles the library next to this file with ``scripts/build_ort_kernels.sh``, for every x86-64
CPU with AVX2: ``libattnexport_ort.so`` loads the AVX2 or the AVX-512 build of the kernels
(``libattnexport_ort_avx2.so``, ``libattnexport_ort_avx512.so``), chosen with cpuid when a
session registers it (``ATTNEXPORT_ISA=avx2`` forces the AVX2 one). When the build could not
compile them (no compiler, no onnxruntime header), the package still installs and
:func:`unavailable_reason` says why.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from pathlib import Path

from attnexport.errors import UserError

LIBRARY = Path(__file__).with_name("libattnexport_ort.so")
"""The library sessions register (it loads the variant this CPU runs, beside it)."""
BUILD_FAILURE = Path(__file__).with_name("build-failure.txt")
"""Written by the package build instead of the library when it could not compile it: why."""
ISA_VARIABLE = "ATTNEXPORT_ISA"
ISAS = ("avx2", "avx512")
"""The variants the library holds, the values ``ATTNEXPORT_ISA`` takes."""
BUILD_HINT = (
    "build it with `bash scripts/build_ort_kernels.sh` in a checkout (needs g++ and the "
    "onnxruntime C API header: see docs/runtime.md#building-the-kernels), or reinstall "
    "attnexport where they are available"
)
FALLBACK_COST = (
    "on the 125M Llama they run 1422 instead of 143 onnxruntime nodes per step and measured "
    "14-16% fewer decode tokens/s and up to 1.2x the time to first token (docs/benchmarks.md)"
)
"""What running the attnexport nodes through their function bodies costs (warnings say it)."""


@functools.cache
def _library(path: str) -> ctypes.CDLL:
    return ctypes.CDLL(path)


def kernel_isa() -> str | None:
    """The instruction set the kernels run with here: ``"avx512"`` or ``"avx2"`` (what a session
    registering the library gets; ``ATTNEXPORT_ISA`` forces one), ``"unsupported: <why>"`` when
    this CPU (or the forced value) cannot run them, None when the library is not built."""
    if not LIBRARY.is_file():
        return None
    try:
        read = _library(str(LIBRARY)).AttnexportKernelIsa
    except OSError as error:  # not a loadable library (another architecture, damaged)
        return f"unsupported: {LIBRARY.name} does not load: {error}"
    except AttributeError:
        return f"unsupported: {LIBRARY.name} predates the ISA dispatch; {BUILD_HINT}"
    read.restype = ctypes.c_char_p
    return read().decode()


def unavailable_reason() -> str | None:
    """Why the kernel library cannot be used here, or None when it can."""
    if not LIBRARY.is_file():
        if BUILD_FAILURE.is_file():
            why = " ".join(BUILD_FAILURE.read_text().split())
            return f"{LIBRARY.name} was not built with attnexport: {why}; {BUILD_HINT}"
        return f"{LIBRARY.name} is not built; {BUILD_HINT}"
    isa = kernel_isa()
    if isa is not None and isa.startswith("unsupported: "):
        return isa.removeprefix("unsupported: ")
    return None


def status() -> dict:
    """The kernels' state for reports: ``available``, ``path`` (the library, or None), ``isa``
    (``avx512``/``avx2`` when available, else None) and ``unavailable_reason``."""
    reason = unavailable_reason()
    return {
        "available": reason is None,
        "path": str(LIBRARY) if LIBRARY.is_file() else None,
        "isa": kernel_isa() if reason is None else None,
        "unavailable_reason": reason,
    }


class KernelIsaError(UserError):
    """``ATTNEXPORT_ISA`` names no variant, or one this CPU cannot run."""


def check_forced_isa() -> None:
    """Raises :class:`KernelIsaError` when ``ATTNEXPORT_ISA`` is set but cannot be honoured (an
    unknown name, or AVX-512 on a CPU without it): a forced choice is never silently replaced
    by the function bodies."""
    forced = os.environ.get(ISA_VARIABLE)
    if not forced:
        return
    if forced not in ISAS:
        raise KernelIsaError(f"{ISA_VARIABLE}={forced!r}: expected one of {ISAS} (or unset)")
    isa = kernel_isa()
    if isa is not None and isa.startswith("unsupported: "):
        raise KernelIsaError(isa.removeprefix("unsupported: "))


def register(session_options) -> None:
    """Registers the kernels with an ``onnxruntime.SessionOptions`` (raises when unbuilt)."""
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"attnexport onnxruntime kernels: {reason}")
    session_options.register_custom_ops_library(str(LIBRARY))


_warned = False


def warn_fallback(reason: str) -> None:
    """Says once per process, on stderr, that attnexport nodes run through their function
    bodies because the native kernels are unavailable (``reason``), and what that costs. On
    stderr rather than through :mod:`warnings`: the CLI silences warnings unless ``--debug``,
    and this one is for every user."""
    global _warned
    if _warned:
        return
    _warned = True
    print(
        f"attnexport: warning: the native onnxruntime kernels are unavailable ({reason}); "
        f"the attnexport nodes run through their standard-op function bodies: {FALLBACK_COST}",
        file=sys.stderr,
    )
