"""The xformers backend's availability, per-call reasons and operator choice.

These run everywhere (no GPU, with or without xformers installed): availability is checked
against this machine for real, and the choice functions over named device profiles.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

import pytest
import torch

from attnexport.backends import xformers_choice as choice
from attnexport.backends.xformers_choice import DeviceFacts, Environment, PagedCase
from attnexport.custom_ops import (
    AttentionCall,
    BackendUnsupportedError,
    get_backend,
    select_backend,
    use_backend,
)
from tests.helpers import attention_call

HOPPER = DeviceFacts((9, 0), fa3=True, fa2=True, fa2_paged=False, triton=True)
AMPERE = DeviceFacts((8, 0), fa3=False, fa2=True, fa2_paged=False, triton=True)
AMPERE_FLASH_ATTN = DeviceFacts((8, 0), fa3=False, fa2=True, fa2_paged=True, triton=True)
AMPERE_NO_TRITON = DeviceFacts((8, 6), fa3=False, fa2=True, fa2_paged=False, triton=False)
HOPPER_WITHOUT_FA3 = DeviceFacts((9, 0), fa3=False, fa2=True, fa2_paged=False, triton=True)

HAS_XFORMERS = importlib.util.find_spec("xformers") is not None


def _call(**changes) -> AttentionCall:
    """A bfloat16 decode step on CUDA (head size 128, blocks of 16)."""
    cuda_decode = dict(device_type="cuda", dtype=torch.bfloat16, head_size=128, block_size=16)
    return attention_call(**(cuda_decode | {"decode_only": True} | changes))


# --------------------------------------------------------------------------- availability


def test_unavailable_reason_on_this_machine():
    backend = get_backend("xformers")
    reason = backend.unavailable_reason()
    if not HAS_XFORMERS:
        assert (
            reason
            == 'xformers is not installed; install it with: pip install "attnexport[xformers]"'
        )
    elif not torch.cuda.is_available():
        assert reason == (
            "no CUDA device (torch.cuda.is_available() is False): xFormers has no CPU kernels; "
            "the sdpa backend runs on CPU"
        )
    else:
        pytest.skip("a CUDA machine: availability is covered by test_xformers_gpu.py")
    assert backend.not_supported_reasons(_call()) == [reason]


@pytest.mark.skipif(not HAS_XFORMERS, reason="xformers is not installed in this environment")
def test_installed_xformers_matches_this_torch():
    """The Makefile installs the xformers release built for the environment's torch."""
    requires = importlib.metadata.requires("xformers") or []
    version = importlib.metadata.version("xformers")
    assert any(r.replace(" ", "").startswith("torch") for r in requires)
    assert choice.torch_requirement_problem(requires, torch.__version__, version) is None


def test_every_unavailable_reason():
    ok = Environment("2.8.0+cu128", "0.0.32.post2", ("torch==2.8.0", "numpy"), True, (9, 0))
    assert choice.unavailable_reason(ok) is None
    assert choice.unavailable_reason(Environment("2.13.0", None)) == (
        'xformers is not installed; install it with: pip install "attnexport[xformers]"'
    )
    mismatch = Environment("2.11.0+cu130", "0.0.32.post2", ("torch==2.8.0",), True)
    assert choice.unavailable_reason(mismatch) == (
        "torch/xformers version mismatch: xformers 0.0.32.post2 requires torch==2.8.0 but torch "
        "2.11.0+cu130 is installed; install the xformers release built for this torch "
        "(see docs/backends.md)"
    )
    no_cuda = Environment("2.8.0+cu128", "0.0.32.post2", ("torch==2.8.0",), False)
    assert choice.unavailable_reason(no_cuda).startswith("no CUDA device")
    broken = Environment(
        "2.11.0", "0.0.35", ("torch>=2.10",), True, import_error="OSError: libcudart.so.12"
    )
    assert choice.unavailable_reason(broken) == (
        "xformers 0.0.35 failed to import: OSError: libcudart.so.12"
    )
    old_gpu = Environment("2.8.0", "0.0.32.post2", ("torch==2.8.0",), True, (7, 5))
    assert choice.unavailable_reason(old_gpu) == (
        "GPU compute capability sm75 is too old: the xformers backend needs sm80 or newer "
        "(Ampere, Hopper, ...)"
    )


@pytest.mark.parametrize(
    "requires,torch_version,ok",
    [
        (["torch==2.8.0", "numpy"], "2.8.0+cu128", True),
        (["torch==2.8.0"], "2.8.1", False),
        (["torch>=2.10"], "2.11.0+cu130", True),
        (["torch>=2.10"], "2.8.0", False),
        (["torch>=2.10"], "2.10.0a0+git1234", True),
        (["torch (==2.8.0)"], "2.8.0", True),
        (["torch==2.8.*"], "2.8.3", True),
        (["torch>=2.8,<2.9"], "2.9.0", False),
        (["torch; extra == 'x'", "numpy"], "1.0", True),
    ],
)
def test_torch_requirement_check(requires, torch_version, ok):
    problem = choice.torch_requirement_problem(requires, torch_version, "0.0.x")
    assert (problem is None) == ok


def test_auto_falls_back_to_sdpa_when_xformers_cannot_run():
    if torch.cuda.is_available() and get_backend("xformers").is_available():
        pytest.skip("xformers runs here")
    with use_backend("auto"):
        assert select_backend(_call()).name == "sdpa"
    with use_backend("xformers"), pytest.raises(BackendUnsupportedError, match="xformers"):
        select_backend(_call())


def test_static_capabilities_report_each_reason():
    caps = get_backend("xformers").capabilities
    call = _call(device_type="cpu", dtype=torch.float64, head_size=512, soft_cap=True)
    assert caps.reasons(call) == [
        "device=cpu (supported: ['cuda'])",
        "dtype=torch.float64 (supported: ['torch.bfloat16', 'torch.float16', 'torch.float32'])",
        "head_size=512 (max: 256)",
        "logits soft-cap is not supported",
    ]
    assert caps.reasons(_call()) == []


# --------------------------------------------------------------------------- per-call reasons


def test_call_reasons_accept_the_common_cases():
    for facts in (HOPPER, AMPERE):
        assert choice.call_reasons(_call(block_size=64), facts) == []
        assert choice.call_reasons(_call(decode_only=False, alibi=True), facts) == []
        assert choice.call_reasons(_call(op="varlen_attention", dtype=torch.float32), facts) == []
    assert choice.call_reasons(_call(block_size=16), HOPPER) == []


def test_call_reason_head_alignment():
    assert choice.call_reasons(_call(head_size=20, decode_only=False), AMPERE) == [
        "head_size=20 (must be a multiple of 8 for float16/bfloat16, 4 for float32)"
    ]
    fp32 = _call(op="varlen_attention", dtype=torch.float32, head_size=20)
    assert choice.call_reasons(fp32, AMPERE) == []


def test_call_reason_non_causal_window():
    expected = "sliding window with non-causal attention: no xformers mask for it"
    for op in ("varlen_attention", "paged_attention"):
        call = _call(op=op, causal=False, sliding_window=True, decode_only=False)
        assert choice.call_reasons(call, HOPPER) == [expected]


def test_call_reason_non_contiguous_cache():
    call = _call(cache_contiguous=False, decode_only=False)
    assert choice.call_reasons(call, HOPPER) == [
        "the caches must be contiguous [num_blocks, block_size, num_kv_heads, head_size] tensors"
    ]


def test_call_reason_alibi_decode():
    assert choice.call_reasons(_call(alibi=True), HOPPER) == [
        "ALiBi in a decode-only batch: no paged xformers operator takes a tensor bias "
        "(ALiBi runs in prefill, through cutlass)"
    ]


def test_call_reason_no_paged_operator_for_decode():
    reasons = choice.call_reasons(_call(block_size=16), AMPERE)
    assert reasons == [
        "no paged xformers operator for this decode batch: "
        "fa3: needs a Hopper GPU (sm90), this GPU is sm80; "
        "triton_splitk: block_size=16 (must be a multiple of 64); "
        "fa2: paged KV needs the flash_attn package (2.7.1..2.8.2); the PyTorch "
        "FlashAttention-2 kernels that xformers uses otherwise take no block table; "
        "fa2: block_size=16 (paged KV needs a multiple of 256)"
    ]
    fp32 = choice.call_reasons(_call(dtype=torch.float32, block_size=64), HOPPER)
    assert "fa3: dtype=float32 (supported: float16, bfloat16)" in fp32[0]
    assert "triton_splitk: dtype=float32 (supported: float16, bfloat16)" in fp32[0]


# --------------------------------------------------------------------------- operators


def test_paged_operator_reasons():
    case = PagedCase(torch.float32, 20, 16, causal=True, sliding_window=True, query_len=None)
    assert choice.paged_op_reasons("fa3", case, AMPERE) == [
        "fa3: needs a Hopper GPU (sm90), this GPU is sm80",
        "fa3: dtype=float32 (supported: float16, bfloat16)",
        "fa3: head_size=20 (supported: 32..256, multiples of 8)",
        "fa3: xformers has no paged mask with a sliding window for several queries per sequence "
        "(windowed decode uses a gappy paged mask)",
    ]
    assert choice.paged_op_reasons("fa3", PagedCase(torch.float16, 64, 16), HOPPER_WITHOUT_FA3) == [
        "fa3: the FlashAttention-3 kernels are not in this xformers installation"
    ]
    assert choice.paged_op_reasons("triton_splitk", case, AMPERE_NO_TRITON) == [
        "triton_splitk: Triton is not available",
        "triton_splitk: dtype=float32 (supported: float16, bfloat16)",
        "triton_splitk: head_size=20 (supported: 16, 32, 64, 128, 256, 512)",
        "triton_splitk: block_size=16 (must be a multiple of 64)",
        "triton_splitk: causal paged attention needs the same query count in every sequence, "
        "at most 16",
        "triton_splitk: no paged sliding-window mask for several queries per sequence",
    ]
    assert choice.paged_op_reasons("fa2", case, AMPERE_FLASH_ATTN) == [
        "fa2: dtype=float32 (supported: float16, bfloat16)",
        "fa2: head_size=20 (supported: up to 256, multiples of 8)",
        "fa2: block_size=16 (paged KV needs a multiple of 256)",
        "fa2: xformers has no FlashAttention-2 paged sliding-window mask",
    ]
    with pytest.raises(ValueError, match="op: expected one of"):
        choice.paged_op_reasons("cudnn", case, HOPPER)


@pytest.mark.parametrize(
    "case,facts,expected",
    [
        (PagedCase(torch.bfloat16, 128, 16), HOPPER, "fa3"),
        (PagedCase(torch.bfloat16, 128, 16), AMPERE, None),
        (PagedCase(torch.bfloat16, 128, 64), AMPERE, "triton_splitk"),
        (PagedCase(torch.bfloat16, 80, 64), AMPERE, None),  # triton: power-of-two heads only
        (PagedCase(torch.float16, 128, 64, query_len=16), AMPERE, "triton_splitk"),
        (PagedCase(torch.float16, 128, 64, query_len=17), AMPERE, None),
        (PagedCase(torch.float16, 128, 64, query_len=None), AMPERE, None),
        (PagedCase(torch.float16, 128, 64, causal=False, query_len=None), AMPERE, "triton_splitk"),
        (PagedCase(torch.float16, 128, 256, query_len=None), AMPERE_FLASH_ATTN, "fa2"),
        (
            PagedCase(torch.float16, 128, 256, sliding_window=True),
            AMPERE_FLASH_ATTN,
            "triton_splitk",
        ),
        (PagedCase(torch.float16, 128, 64), AMPERE_NO_TRITON, None),
        (PagedCase(torch.float16, 128, 16, sliding_window=True), HOPPER, "fa3"),
        (PagedCase(torch.float16, 128, 16, sliding_window=True, query_len=None), HOPPER, None),
    ],
)
def test_paged_operator_choice(case, facts, expected):
    assert choice.choose_paged_op(case, facts) == expected


@pytest.mark.parametrize(
    "dtype,head_size,alibi,facts,expected",
    [
        (torch.bfloat16, 128, False, HOPPER, "fa3"),
        (torch.bfloat16, 16, False, HOPPER, "fa2"),  # fa3 needs head_size >= 32
        (torch.float16, 128, False, AMPERE, "fa2"),
        (torch.float16, 512, False, AMPERE, "cutlass"),
        (torch.float32, 128, False, HOPPER, "cutlass"),
        (torch.bfloat16, 128, True, HOPPER, "cutlass"),
    ],
)
def test_varlen_operator_choice(dtype, head_size, alibi, facts, expected):
    assert choice.varlen_op(dtype, head_size, alibi, facts) == expected


def _route(query_lens, facts, block_size=16, causal=True, window=False, alibi=False, dtype=None):
    return choice.route_paged(
        query_lens, dtype or torch.bfloat16, 128, block_size, causal, window, alibi, facts
    )


def test_paged_routes():
    mixed = [1, 9, 1, 17]
    # Hopper: one FA3 call over the whole batch, decode and chunked prefill alike.
    assert _route(mixed, HOPPER) == choice.PagedRoute("fa3", (0, 1, 2, 3), "fa3", ())
    # Ampere, block 64: decode rows on triton split-K, prefill rows gathered onto FA2.
    assert _route(mixed, AMPERE, 64) == choice.PagedRoute("triton_splitk", (0, 2), "fa2", (1, 3))
    # Ampere, block 16: nothing reads the cache; everything is gathered.
    assert _route(mixed, AMPERE) == choice.PagedRoute(None, (), "fa2", (0, 1, 2, 3))
    assert _route([4, 4], AMPERE, 64) == choice.PagedRoute("triton_splitk", (0, 1), "fa2", ())
    assert _route(mixed, AMPERE_FLASH_ATTN, 256).paged_op == "fa2"
    assert _route(mixed, AMPERE, 64, causal=False).paged_rows == (0, 1, 2, 3)
    # A window over several queries has no paged mask: those rows are gathered.
    assert _route(mixed, HOPPER, window=True) == choice.PagedRoute("fa3", (0, 2), "fa3", (1, 3))
    assert _route(mixed, HOPPER, alibi=True) == choice.PagedRoute(None, (), "cutlass", (0, 1, 2, 3))
    assert _route(mixed, HOPPER, dtype=torch.float32) == choice.PagedRoute(
        None, (), "cutlass", (0, 1, 2, 3)
    )
