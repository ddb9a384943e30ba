"""Small helpers shared by test modules."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import onnxruntime as ort
import pytest
import torch

from attnexport import ort_kernels
from attnexport.custom_ops import AttentionCall, BackendUnsupportedError
from attnexport.tolerances import tolerance

# Tests of the native onnxruntime kernels skip, with the reason, where the library is not built
# (make's test targets require it: ATTNEXPORT_REQUIRE_ORT_KERNELS=1).
requires_ort_kernels = pytest.mark.skipif(
    ort_kernels.unavailable_reason() is not None,
    reason=f"native kernels: {ort_kernels.unavailable_reason()}",
)
# How onnxruntime runs the attnexport nodes: their standard-op bodies, or the native kernels.
ORT_KERNEL_MODES = ["bodies", pytest.param("native", marks=requires_ort_kernels)]
# Where the AVX-512 variant of the native kernels is the default: a module's tests of kernels with
# an AVX2 path of their own run again under that variant (rerun_with).
requires_avx512_kernels = pytest.mark.skipif(
    ort_kernels.unavailable_reason() is not None or ort_kernels.kernel_isa() != "avx512",
    reason="the AVX2 variant is the default on this CPU (or the kernels are not built)",
)


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux names them (``avx512f``, ``avx512_vnni``, ...); empty
    where /proc/cpuinfo is not there."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            line = next((x for x in cpuinfo if x.startswith("flags")), "")
    except OSError:
        return set()
    return set(line.split(":", 1)[-1].split())


# Where the AVX-512 variant runs on a CPU with AVX512_VNNI: its MatMul8Bits/MatMul4Bits products
# take vpdpwssd, and the tests run again without it (ATTNEXPORT_VNNI=0).
requires_vnni_kernels = pytest.mark.skipif(
    ort_kernels.unavailable_reason() is not None
    or ort_kernels.kernel_isa() != "avx512"
    or "avx512_vnni" not in cpu_flags()
    or os.environ.get("ATTNEXPORT_VNNI") == "0",
    reason="the kernels' AVX-512 variant does not run with AVX512_VNNI here",
)


def bf16_pairs_run(head_size: int) -> bool:
    """Whether the native PagedAttention's prefills take bfloat16 pairs here with prefill_bf16:
    the AVX-512 variant on a CPU with AVX512_BF16, heads a multiple of 16."""
    return (
        ort_kernels.unavailable_reason() is None
        and ort_kernels.kernel_isa() == "avx512"
        and "avx512_bf16" in cpu_flags()
        and head_size % 16 == 0
    )


def one_model_session(model, kernels: str, threads: int = 2):
    """An onnxruntime CPU session of the in-memory ONNX ``model`` whose attnexport nodes run as
    ``kernels`` says (one of ORT_KERNEL_MODES: ``"native"`` registers the kernel library)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    if kernels == "native":
        ort_kernels.register(options)
    return ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )


def rerun_with(module: str, skip: str, **variables: str) -> None:
    """Runs the test module at ``module`` again in a process of its own with the environment
    ``variables`` set (the native kernels read ATTNEXPORT_ISA when a session registers the
    library, ATTNEXPORT_VNNI once a process), but the tests whose names contain ``skip`` (the
    caller); asserts that they pass."""
    env = {**os.environ, **variables}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", module]
    done = subprocess.run(
        [*command, "-k", f"not ({skip})"], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stdout[-3000:]


def assert_close_to_reference(actual: torch.Tensor, reference: torch.Tensor) -> None:
    """Compares an op output (any dtype) with the float64 reference at the op dtype's tolerance."""
    assert actual.dtype != torch.float64 or reference.dtype == torch.float64
    torch.testing.assert_close(
        actual.to(torch.float64), reference.to(torch.float64), **tolerance(actual.dtype)
    )


def attention_call(**fields) -> AttentionCall:
    """The dispatch record of a paged_attention call (float16 on the CPU, 8 query and 2 KV
    heads of 64, blocks of 64) with ``fields`` changed."""
    base = dict(
        op="paged_attention",
        device_type="cpu",
        dtype=torch.float16,
        num_heads=8,
        num_kv_heads=2,
        head_size=64,
        block_size=64,
    )
    return AttentionCall(**(base | fields))


def opcheck(op_name: str, args: tuple, kwargs: dict | None = None) -> None:
    """``torch.library.opcheck`` of ``torch.ops.attnexport.<op_name>.default``: its schema,
    autograd registration, fake kernel and AOT dispatch with dynamic shapes."""
    torch.library.opcheck(
        getattr(torch.ops.attnexport, op_name).default,
        args,
        kwargs,
        test_utils=(
            "test_schema",
            "test_autograd_registration",
            "test_faketensor",
            "test_aot_dispatch_dynamic",
        ),
    )


@contextlib.contextmanager
def skip_unsupported():
    """Turns a backend's refusal of a case into a skip that shows its reasons."""
    try:
        yield
    except BackendUnsupportedError as error:
        pytest.skip(str(error))


def layer_args(x: dict) -> tuple:
    """The tensors of one attention layer (new keys and values, their cache write, then the
    paged attention) from a :func:`make_paged_inputs` dict."""
    names = ("query", "key", "value", "key_cache", "value_cache", "slot_mapping")
    return (*(x[name] for name in names), *paged_args(x)[3:])


def paged_args(x: dict) -> tuple:
    """The positional tensors of ``paged_attention`` from a :func:`make_paged_inputs` dict."""
    return (
        x["query"],
        x["key_cache"],
        x["value_cache"],
        x["block_tables"],
        x["seq_lens"],
        x["query_start_loc"],
    )


ROOT = Path(__file__).resolve().parents[1]
MEMORY_STATUS = """
import json

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
"""
"""The prelude of a :func:`resident_growth` script: ``status("VmRSS")``, ``status("VmHWM")``."""


def resident_growth(script: str, *args: str) -> int:
    """Runs ``MEMORY_STATUS + script`` with ``args`` in a fresh Python process (this tree on
    its path, one thread); the script prints ``{"before": bytes, "peak": bytes}`` as its last
    line. Returns ``peak - before``: what the measured work added to the resident set."""
    done = subprocess.run(
        [sys.executable, "-c", MEMORY_STATUS + script, *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    return measured["peak"] - measured["before"]
