"""Backend registry and selection: names, env var, context manager, reasons, auto fallback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import attnexport
from attnexport.custom_ops import (
    AttentionBackend,
    BackendCapabilities,
    BackendUnsupportedError,
    current_backend_name,
    dispatch,
    get_backend,
    register_backend,
    registered_backends,
    select_backend,
    use_backend,
)
from tests.attention_cases import AttentionCase, make_paged_inputs
from tests.helpers import attention_call, paged_args


class _Fp16OnlyBackend(AttentionBackend):
    """A real (delegating) backend with narrow capabilities, to exercise selection."""

    name = "narrow"
    priority = 100
    capabilities = BackendCapabilities(
        ops=frozenset({"paged_attention"}),
        devices=frozenset({"cpu"}),
        dtypes=frozenset({torch.float16}),
        head_sizes=frozenset({64, 128}),
        block_size_multiple=64,
        alibi=False,
    )
    calls = 0

    def reshape_and_cache(self, *args):
        raise NotImplementedError

    def paged_attention(self, *args):
        type(self).calls += 1
        return get_backend("sdpa").paged_attention(*args)

    def varlen_attention(self, *args):
        raise NotImplementedError


@pytest.fixture
def narrow_backend():
    backend = register_backend(_Fp16OnlyBackend())
    yield backend
    del dispatch._REGISTRY["narrow"]
    dispatch._selection_cache.clear()


def test_capabilities_report_each_reason(narrow_backend):
    call = attention_call(dtype=torch.float32, head_size=80, block_size=16, alibi=True)
    reasons = narrow_backend.not_supported_reasons(call)
    assert any(r.startswith("dtype=torch.float32 (supported: ['torch.float16'])") for r in reasons)
    assert any("head_size=80" in r for r in reasons)
    assert any("block_size=16 (must be a multiple of 64)" in r for r in reasons)
    assert "ALiBi is not supported" in reasons
    assert narrow_backend.not_supported_reasons(attention_call()) == []


def test_auto_prefers_priority_and_falls_back_with_reasons(narrow_backend):
    alibi = attention_call(alibi=True)
    # The next backend by priority that can run the call (ipex where it is installed, else sdpa).
    fallback = next(
        b
        for b in registered_backends()
        if b.name != "narrow" and not b.not_supported_reasons(alibi)
    )
    with use_backend("auto"):
        assert select_backend(attention_call()).name == "narrow"
        assert select_backend(alibi) is fallback


def test_forced_backend_lists_reasons(narrow_backend):
    with use_backend("narrow"), pytest.raises(BackendUnsupportedError) as error:
        select_backend(attention_call(alibi=True, dtype=torch.bfloat16))
    message = str(error.value)
    assert "backend 'narrow' cannot run paged_attention" in message
    assert "ALiBi is not supported" in message and "dtype=torch.bfloat16" in message


def test_ops_dispatch_to_the_selected_backend(narrow_backend):
    case = AttentionCase("mixed", (1, 3), (4, 60), head_size=64, block_size=64, dtype=torch.float16)
    x = make_paged_inputs(case)
    args = paged_args(x)
    before = _Fp16OnlyBackend.calls
    with use_backend("auto"):
        attnexport.paged_attention(*args, **x["kwargs"])
    assert _Fp16OnlyBackend.calls == before + 1
    with use_backend("sdpa"):
        attnexport.paged_attention(*args, **x["kwargs"])
    assert _Fp16OnlyBackend.calls == before + 1
    with use_backend("narrow"), pytest.raises(BackendUnsupportedError, match="op=varlen"):
        attnexport.varlen_attention(
            x["query"],
            x["key"][:3],
            x["value"][:3],
            x["query_start_loc"],
            x["query_start_loc"].clamp(max=3),
            0.1,
        )


def test_unknown_backend_name_lists_valid_names():
    with pytest.raises(ValueError, match="unknown attention backend 'nope'; expected one of: auto"):
        use_backend("nope").__enter__()


def test_context_manager_nests_and_restores():
    outer = current_backend_name()
    with use_backend("sdpa"):
        assert current_backend_name() == "sdpa"
        with use_backend("auto"):
            assert current_backend_name() == "auto"
        assert current_backend_name() == "sdpa"
    assert current_backend_name() == outer


@pytest.mark.parametrize("value,expected", [("sdpa", "sdpa"), ("AUTO", "auto")])
def test_environment_variable_selects_the_default(value, expected):
    code = "import attnexport.custom_ops as c; print(c.current_backend_name())"
    env = dict(os.environ, ATTNEXPORT_BACKEND=value)
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip().lower() == expected


def test_environment_variable_with_unknown_name_fails_clearly():
    code = (
        "import attnexport, torch\n"
        "from tests.attention_cases import AttentionCase, make_paged_inputs\n"
        "x = make_paged_inputs(AttentionCase('d', (1,), (3,)))\n"
        "attnexport.paged_attention(x['query'], x['key_cache'], x['value_cache'],"
        " x['block_tables'], x['seq_lens'], x['query_start_loc'], 0.1)\n"
    )
    env = dict(os.environ, ATTNEXPORT_BACKEND="cudnn")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode != 0
    assert "unknown attention backend 'cudnn'; expected one of: auto" in out.stderr
