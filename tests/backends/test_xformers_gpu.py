"""The xformers backend on a CUDA GPU: the real kernels against the float64 reference and the
sdpa backend, the operator each case runs on, ``auto`` fallback, and a small paged decoder
stepped through the ops (prefill, decode, chunked prefill) against full recomputation.

Everything here skips, with the backend's reason, on a machine without a usable GPU and
xformers. ``scripts/gpu_suite.sh`` runs it (with the rest of the suite) on a GPU machine.
"""

from __future__ import annotations

import pytest
import torch

import attnexport
from attnexport.backends import xformers as xformers_backend
from attnexport.backends import xformers_choice as choice
from attnexport.custom_ops import (
    BackendUnsupportedError,
    get_backend,
    reference,
    select_backend,
    use_backend,
)
from attnexport.tolerances import tolerance
from tests.attention_cases import (
    AttentionCase,
    make_paged_inputs,
    make_varlen_inputs,
    standard_cases,
)
from tests.helpers import assert_close_to_reference, attention_call, skip_unsupported


def _unavailable() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    return get_backend("xformers").unavailable_reason()


pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(_unavailable() is not None, reason=f"xformers on CUDA: {_unavailable()}"),
]

CASES = [
    *standard_cases(),
    *(c.with_(dtype=torch.float16) for c in standard_cases() if c.dtype == torch.float32),
    AttentionCase("mixed", (1, 9, 1, 17), (300, 0, 3, 12), block_size=256, dtype=torch.float16),
    AttentionCase("spec", (4, 4, 4), (60, 3, 130), block_size=64, dtype=torch.bfloat16),
    AttentionCase(
        "llama",
        (1,) * 8,
        (1000, 1500, 2047, 64, 3000, 777, 1, 4000),
        num_heads=32,
        num_kv_heads=8,
        head_size=128,
        block_size=16,
        dtype=torch.bfloat16,
    ),
    AttentionCase(
        "llama_mixed",
        (1, 1, 300, 1, 64),
        (1000, 3000, 0, 64, 700),
        num_heads=32,
        num_kv_heads=8,
        head_size=128,
        block_size=64,
        dtype=torch.bfloat16,
    ),
]
DEVICE = "cuda"
BACKEND = "xformers"  # (both are module constants so that the test logic can be dry-run on CPU)
PAGED = ("query", "key_cache", "value_cache", "block_tables", "seq_lens", "query_start_loc")


def _to(x: dict, device: str) -> dict:
    moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in x.items()}
    moved["kwargs"] = {
        k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in x["kwargs"].items()
    }
    return moved


@pytest.fixture
def operators(monkeypatch):
    """Records the xFormers operator classes the backend calls (the calls still run)."""
    used: list[str] = []
    real = xformers_backend._forward

    def spy(query, key, value, bias, scale, op):
        used.append(op.NAME)
        return real(query, key, value, bias, scale, op)

    monkeypatch.setattr(xformers_backend, "_forward", spy)
    return used


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_paged_attention_on_cuda(case, operators):
    x = _to(make_paged_inputs(case), DEVICE)
    with use_backend(BACKEND), skip_unsupported():
        attnexport.reshape_and_cache(
            x["key"], x["value"], x["key_cache"], x["value_cache"], x["slot_mapping"]
        )
        out = attnexport.paged_attention(*(x[k] for k in PAGED), **x["kwargs"])
    assert operators, "no xformers kernel ran"
    cpu = _to(x, "cpu")
    assert_close_to_reference(
        out.cpu(), reference.paged_attention(*(cpu[k] for k in PAGED), **cpu["kwargs"])
    )
    with use_backend("sdpa"):
        expected = attnexport.paged_attention(*(x[k] for k in PAGED), **x["kwargs"])
    torch.testing.assert_close(out, expected, **tolerance(case.dtype))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_varlen_attention_on_cuda(case, operators):
    x = _to(make_varlen_inputs(case), DEVICE)
    args = (x["query"], x["key"], x["value"], x["cu_seqlens_q"], x["cu_seqlens_k"])
    with use_backend(BACKEND), skip_unsupported():
        out = attnexport.varlen_attention(*args, **x["kwargs"])
    assert operators
    cpu_args = tuple(a.cpu() for a in args)
    kwargs = _to(x, "cpu")["kwargs"]
    assert_close_to_reference(out.cpu(), reference.varlen_attention(*cpu_args, **kwargs))


def test_operators_follow_the_route(operators):
    """A bf16 decode batch runs on the paged operator the choice table names for this GPU."""
    case = CASES[-2]  # llama decode, block 16
    facts = xformers_backend.device_facts(torch.cuda.current_device())
    op = choice.choose_paged_op(
        choice.PagedCase(case.dtype, case.head_size, case.block_size), facts
    )
    x = _to(make_paged_inputs(case), DEVICE)
    with use_backend(BACKEND):
        if op is None:
            with pytest.raises(BackendUnsupportedError, match="no paged xformers operator"):
                attnexport.paged_attention(*(x[k] for k in PAGED), **x["kwargs"])
            return
        attnexport.paged_attention(*(x[k] for k in PAGED), **x["kwargs"])
    expected = {"fa3": "fa3F", "triton_splitk": "triton_splitKF", "fa2": "fa2F"}[op]
    assert operators and all(name.startswith(expected) for name in operators), operators


def test_auto_prefers_xformers_on_cuda_and_falls_back():
    call = attention_call(
        op="varlen_attention", device_type="cuda", dtype=torch.bfloat16, block_size=None
    )
    with use_backend("auto"):
        assert select_backend(call).name == "xformers"
        assert select_backend(call._replace(soft_cap=True)).name == "sdpa"
        assert select_backend(call._replace(dtype=torch.float64)).name == "sdpa"


def test_cache_write_and_block_copies_on_cuda():
    case = AttentionCase("mixed", (1, 9, 1), (40, 0, 3), padded_tokens=2, dtype=torch.bfloat16)
    x = _to(make_paged_inputs(case), DEVICE)
    expected_k, expected_v = x["key_cache"].clone(), x["value_cache"].clone()
    reference.reshape_and_cache(x["key"], x["value"], expected_k, expected_v, x["slot_mapping"])
    with use_backend(BACKEND):
        attnexport.reshape_and_cache(
            x["key"], x["value"], x["key_cache"], x["value_cache"], x["slot_mapping"]
        )
        attnexport.copy_blocks(
            [x["key_cache"], x["value_cache"]], torch.tensor([[0, 1]], device=DEVICE)
        )
    expected_k[1], expected_v[1] = expected_k[0], expected_v[0]
    assert torch.equal(x["key_cache"], expected_k) and torch.equal(x["value_cache"], expected_v)


# --------------------------------------------------------------------------- a paged decoder


class _TinyDecoder(torch.nn.Module):
    """Two attention+MLP layers over the attnexport ops (random weights); forward follows the
    paged model convention (packed tokens, per-step metadata, caches as inputs)."""

    def __init__(self, vocab=97, hidden=256, heads=8, kv_heads=2, layers=2):
        super().__init__()
        self.heads, self.kv_heads, self.head_size = heads, kv_heads, hidden // heads
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.qkv = torch.nn.ModuleList(
            torch.nn.Linear(hidden, (heads + 2 * kv_heads) * self.head_size) for _ in range(layers)
        )
        self.out = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(layers))
        self.head = torch.nn.Linear(hidden, vocab)

    def forward(self, tokens, step, caches):
        h = self.embed(tokens)
        for i, (qkv, out) in enumerate(zip(self.qkv, self.out, strict=True)):
            q, k, v = qkv(h).split(
                [self.heads * self.head_size, *(2 * [self.kv_heads * self.head_size])], -1
            )
            q = q.view(-1, self.heads, self.head_size)
            k = k.view(-1, self.kv_heads, self.head_size)
            v = v.reshape(-1, self.kv_heads, self.head_size)
            attnexport.reshape_and_cache(k, v, caches[2 * i], caches[2 * i + 1], step.slot_mapping)
            a = attnexport.paged_attention(
                q,
                caches[2 * i],
                caches[2 * i + 1],
                step.block_tables,
                step.seq_lens,
                step.query_start_loc,
                scale=self.head_size**-0.5,
            )
            h = h + out(a.reshape(len(tokens), -1))
        return self.head(h)

    def full(self, tokens):
        """The same network over one whole sequence without a cache (plain causal SDPA)."""
        h = self.embed(tokens)
        group = self.heads // self.kv_heads
        for qkv, out in zip(self.qkv, self.out, strict=True):
            q, k, v = qkv(h).split(
                [self.heads * self.head_size, *(2 * [self.kv_heads * self.head_size])], -1
            )
            q = q.view(-1, self.heads, self.head_size).transpose(0, 1)
            k = (
                k.view(-1, self.kv_heads, self.head_size)
                .repeat_interleave(group, 1)
                .transpose(0, 1)
            )
            v = v.reshape(-1, self.kv_heads, self.head_size).repeat_interleave(group, 1)
            a = torch.nn.functional.scaled_dot_product_attention(
                q.float(), k.float(), v.transpose(0, 1).float(), is_causal=True
            )
            h = h + out(a.transpose(0, 1).reshape(len(tokens), -1).to(h.dtype))
        return self.head(h)


@pytest.mark.parametrize("block_size", [16, 64])
def test_paged_decoder_matches_full_recomputation(block_size):
    """Three prompts prefilled (one in two chunks), then six decode steps; each step's logits
    equal the no-cache recomputation of the whole sequence so far."""
    torch.manual_seed(0)
    dtype = torch.bfloat16
    model = _TinyDecoder().to(DEVICE, dtype).eval()
    caches = [
        torch.zeros(64, block_size, model.kv_heads, model.head_size, device=DEVICE, dtype=dtype)
        for _ in range(4)
    ]
    prompts = [torch.randint(0, 97, (n,)).tolist() for n in (37, 5, 70)]
    blocks = [list(range(i * 20, i * 20 + 20)) for i in range(3)]  # 20 blocks per sequence
    done = [0, 0, 0]
    texts = [list(p) for p in prompts]
    # Step plan: sequence 2's prompt arrives in two chunks (chunked prefill).
    plans = [[37, 5, 40], [0, 0, 30]] + [[1, 1, 1]] * 6
    with use_backend(BACKEND), torch.no_grad(), skip_unsupported():
        for plan in plans:
            scheduled, tokens = [], []
            for i, n in enumerate(plan):
                if n == 0:
                    continue
                scheduled.append(attnexport.ScheduledSequence(done[i], n, blocks[i]))
                tokens += texts[i][done[i] : done[i] + n]
            step = attnexport.build_attention_metadata(scheduled, block_size, device=DEVICE)
            logits = model(torch.tensor(tokens, device=DEVICE), step, caches)
            ends = step.query_start_loc[1:].long() - 1
            active = [i for i, n in enumerate(plan) if n]
            for row, i in zip(ends.tolist(), active, strict=True):
                done[i] += plan[i]
                if done[i] < len(texts[i]):
                    continue  # mid-prompt chunk
                expected = model.full(torch.tensor(texts[i], device=DEVICE))[-1]
                torch.testing.assert_close(
                    logits[row].float(), expected.float(), atol=5e-2, rtol=5e-2
                )
                texts[i].append(int(logits[row].argmax()))
    assert all(len(t) == len(p) + 7 for t, p in zip(texts, prompts, strict=True))


# --------------------------------------------------------------------------- zoo models


def _zoo_configs():
    import transformers

    from tests.models.hf_reference import NO_SPECIAL_TOKENS

    small = dict(vocab_size=128, hidden_size=256, initializer_range=0.05, **NO_SPECIAL_TOKENS)
    common = dict(intermediate_size=384, num_hidden_layers=2, **small)
    return {
        "llama-gqa": (
            "LlamaForCausalLM",
            transformers.LlamaConfig(**common, num_attention_heads=4, num_key_value_heads=2),
        ),
        "mistral-window": (
            "MistralForCausalLM",
            transformers.MistralConfig(
                **common, num_attention_heads=4, num_key_value_heads=1, sliding_window=40
            ),
        ),
        "bloom-alibi": (
            "BloomForCausalLM",
            transformers.BloomConfig(**small, n_layer=2, n_head=4),
        ),
    }


ZOO = ("llama-gqa", "mistral-window", "bloom-alibi")


@pytest.mark.parametrize("name", ZOO)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_zoo_model_through_the_ops_on_cuda(name, dtype, tmp_path, operators):
    """A zoo model imported from a transformers checkpoint, on CUDA, stepped through a ragged
    prefill, a chunked prefill mixed with decodes and decode steps (64-token blocks, shuffled):
    under ``auto`` (xformers where it runs, sdpa where it refuses) its logits match
    transformers' fp32 forward of the whole sequence, and xformers took part."""
    from attnexport.models import load_model
    from attnexport.runtime.step_driver import PagedDriver
    from tests.models.hf_reference import build_checkpoint, causal_lm_logits

    hf_class, config = _zoo_configs()[name]
    hf_model = build_checkpoint(hf_class, config, tmp_path)
    model = load_model(tmp_path, dtype=dtype).to(DEVICE)

    def run(args, caches):
        with torch.no_grad():
            return model(*(a.to(DEVICE) for a in args), caches).float().cpu(), caches

    driver = PagedDriver(run, model.cache_spec(64), num_blocks=32, seed=1)
    driver.kv_caches = [c.to(DEVICE) for c in driver.kv_caches]
    prompts = ([5, 17, 3, 99, 42, 8, 1] * 9, [7, *range(20, 43)], [11, 2])
    for prompt in prompts:
        driver.add(prompt)
    collected = {i: [] for i in range(3)}
    with use_backend("auto"):
        for seq, logits in driver.step({0: 30, 1: 24, 2: 2}, all_logits=True).items():
            collected[seq].append(logits)
        for step in range(6):
            for seq in (1, 2):
                driver.append(seq, (7 * step + seq) % 128)
            chunk = {0: 33} if step == 0 else {}
            for seq, logits in driver.step({**chunk, 1: 1, 2: 1}, all_logits=True).items():
                collected[seq].append(logits)
    assert operators, "xformers ran no kernel"
    atol = 2e-3 if dtype == torch.float32 else 8e-2
    for seq in range(3):
        ours = torch.cat(collected[seq])
        expected = causal_lm_logits(hf_model, driver.sequences[seq].tokens)[: len(ours)]
        torch.testing.assert_close(ours, expected, atol=atol, rtol=0.05 if atol > 1e-2 else 0)


# --------------------------------------------------------------------------- the engine


ENGINE_PROMPTS = ([5, 17, 3, 99, 42, 8, 1] * 19, [7, *range(20, 43)], [11, 2], [*range(1, 70)])
"""Ragged prompts: 133 tokens (past the Mistral window of 40 and two 64-token blocks), 24, 2,
69; with a 64-token budget the long ones prefill in chunks beside the others' decode steps."""


def _greedy_choices_hold(hf_model, prompts, outputs, dtype) -> list[str]:
    """Where the GPU engine chose a token that is not a greedy choice of transformers' fp32
    forward within ``dtype``'s rounding (teacher-forced on the GPU's own tokens)."""
    from tests.models.hf_reference import causal_lm_logits

    slack = 1e-4 if dtype == torch.float32 else 0.1
    bad = []
    for i, (prompt, tokens) in enumerate(zip(prompts, outputs, strict=True)):
        logits = causal_lm_logits(hf_model, [*prompt, *tokens])[len(prompt) - 1 : -1]
        for j, (row, token) in enumerate(zip(logits, tokens, strict=True)):
            best = float(row.max())
            if float(row[token]) < best - slack - 0.05 * abs(best):
                bad.append(
                    f"sequence {i} step {j}: {token} at {float(row[token]):.4f}, max {best:.4f}"
                )
    return bad


def _engine_tokens(model, device: str, backend: str) -> list[list[int]]:
    from attnexport.runtime import (
        CacheConfig,
        Engine,
        SamplingParams,
        SchedulerConfig,
        TorchExecutor,
    )

    engine = Engine(
        TorchExecutor(model, block_size=64, backend=backend, device=device),
        CacheConfig(num_blocks=24),
        SchedulerConfig(max_model_len=256, max_num_batched_tokens=64),
    )
    return [o.token_ids for o in engine.generate(ENGINE_PROMPTS, SamplingParams(max_tokens=12))]


@pytest.mark.parametrize("name", ZOO)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_engine_on_cuda_generates_the_cpu_tokens(name, dtype, tmp_path, operators):
    """The engine on the GPU (``auto``: xformers where it runs, sdpa where it refuses) with
    chunked prefill beside decodes: in fp32 its greedy tokens are the CPU engine's; in bf16 each
    token it picks is a greedy choice of transformers' fp32 logits within bf16 rounding."""
    from attnexport.models import load_model
    from tests.models.hf_reference import build_checkpoint

    hf_class, config = _zoo_configs()[name]
    hf_model = build_checkpoint(hf_class, config, tmp_path)
    gpu = _engine_tokens(load_model(tmp_path, dtype=dtype), DEVICE, "auto")
    assert operators, "xformers ran no kernel"
    if dtype == torch.float32:
        assert gpu == _engine_tokens(load_model(tmp_path), "cpu", "sdpa")
    assert not _greedy_choices_hold(hf_model, ENGINE_PROMPTS, gpu, dtype)


# --------------------------------------------------------------------------- ort-cuda


def _ort_cuda_unavailable() -> str | None:
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return f"onnxruntime {ort.__version__} has no CUDAExecutionProvider (onnxruntime-gpu)"
    return None


@pytest.mark.parametrize(
    ("name", "target"),
    [("llama-gqa", "ort-cuda"), ("mistral-window", "ort-cuda"), ("mistral-window", "attnexport")],
)
def test_onnx_artifact_generates_on_the_gpu(name, target, tmp_path):
    """``export --dtype float16`` run by onnxruntime's CUDA execution provider through the
    engine (caches in place under IO binding). ``--target ort-cuda``: the cache write and the
    attention are one ``com.microsoft.PagedAttention`` per layer; ``attnexport``: the
    attnexport nodes' standard-op bodies. Each token is a greedy choice of transformers' fp32
    logits within fp16 rounding."""
    reason = _ort_cuda_unavailable()
    if reason:
        pytest.skip(reason)
    import onnx

    from attnexport.artifact.export import ExportOptions, export_artifact
    from attnexport.runtime import CacheConfig, Engine, SamplingParams, SchedulerConfig
    from tests.models.hf_reference import build_checkpoint

    hf_class, config = _zoo_configs()[name]
    hf_model = build_checkpoint(hf_class, config, tmp_path / "ckpt")
    out = tmp_path / "out"
    export_artifact(str(tmp_path / "ckpt"), out, ExportOptions(target=target, dtype=torch.float16))
    graph = onnx.load(out / "model.onnx", load_external_data=False).graph
    contrib = [
        n for n in graph.node if n.domain == "com.microsoft" and n.op_type == "PagedAttention"
    ]
    assert len(contrib) == (config.num_hidden_layers if target == "ort-cuda" else 0)
    engine = Engine.from_path(
        out,
        device="cuda",
        cache_config=CacheConfig(num_blocks=48),
        scheduler_config=SchedulerConfig(max_model_len=256, max_num_batched_tokens=64),
    )
    tokens = [o.token_ids for o in engine.generate(ENGINE_PROMPTS, SamplingParams(max_tokens=12))]
    assert not _greedy_choices_hold(hf_model, ENGINE_PROMPTS, tokens, torch.float16)
