"""What a GPU machine offers the GPU suite (scripts/gpu_suite.sh writes this to env.txt): torch
and CUDA, the GPU, the versions of the packages the suite uses, whether xFormers' C++ library
loads, onnxruntime's execution providers, and the xformers backend's verdict and operators."""

from __future__ import annotations

import importlib.metadata

import torch

print(f"torch {torch.__version__} | CUDA {torch.version.cuda} | GPU {torch.cuda.is_available()}")
if torch.cuda.is_available():
    major, minor = torch.cuda.get_device_capability()
    print("GPU", torch.cuda.get_device_name(), f"sm{major}{minor}")
for name in ("xformers", "triton", "transformers", "onnx", "onnxscript", "onnx-ir", "numpy"):
    try:
        print(name, importlib.metadata.version(name))
    except importlib.metadata.PackageNotFoundError:
        print(name, "not installed")
try:
    import xformers

    print("xformers C++ library loaded:", xformers._has_cpp_library)
except Exception as error:  # a broken build raises anything
    print("import xformers failed:", repr(error))
try:
    import onnxruntime as ort

    print("onnxruntime", ort.__version__, ort.__file__, ort.get_available_providers())
except Exception as error:
    print("import onnxruntime failed:", repr(error))

import attnexport  # noqa: E402, F401
from attnexport.custom_ops import get_backend  # noqa: E402

reason = get_backend("xformers").unavailable_reason()
print("xformers backend:", reason or "available")
if reason is None:
    from attnexport.backends.xformers import device_facts

    print(device_facts(torch.cuda.current_device()))
