"""Per-dtype error tolerances: the one home of the bounds every comparison uses (op tests
against the float64 reference, model parity tests and ``attnexport verify``)."""

from __future__ import annotations

import torch

_TOLERANCES = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (3e-2, 2e-2),
    torch.float16: (5e-3, 5e-3),
}


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    """``{"atol": ..., "rtol": ...}`` for comparing an op's output in ``dtype`` with the
    float64 reference; pass it to ``torch.testing.assert_close``."""
    atol, rtol = _TOLERANCES[dtype]
    return {"atol": atol, "rtol": rtol}


_MODEL_TOLERANCES = {
    torch.float64: 1e-8,
    torch.float32: 1e-4,
    torch.bfloat16: 1e-1,
    torch.float16: 2e-2,
}


def model_tolerance(dtype: torch.dtype) -> float:
    """Max abs error allowed between two runs of a whole model (logits, hidden states, caches)
    in ``dtype``: eager vs exported vs ONNX vs another backend, or vs transformers."""
    return _MODEL_TOLERANCES[dtype]


def logit_quality(
    logits: torch.Tensor, reference: torch.Tensor, margin: float = 0.0
) -> dict[str, float]:
    """How far ``logits`` [tokens, vocab] are from ``reference`` [tokens, vocab]:
    ``max_abs`` (largest abs difference), ``top1_agreement`` (fraction of tokens whose argmax
    agrees), ``top1_disagreement_decisive`` (fraction of the tokens whose reference top-1 leads
    its top-2 by more than ``margin`` that changed argmax: with errors below ``margin / 2`` no
    such token can flip; on random-weight models many tokens are near-ties) and ``kl`` (mean
    over tokens of KL(softmax(reference) || softmax(logits)), nats)."""
    logits, reference = logits.to(torch.float64), reference.to(torch.float64)
    if logits.numel() == 0:
        return {"max_abs": 0.0, "top1_agreement": 1.0, "top1_disagreement_decisive": 0.0, "kl": 0.0}
    log_p = torch.log_softmax(reference, dim=-1)
    log_q = torch.log_softmax(logits, dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean()
    differs = logits.argmax(-1) != reference.argmax(-1)
    top2 = reference.topk(min(2, reference.shape[-1]), dim=-1).values
    decisive = (top2[..., 0] - top2[..., -1]) > margin
    return {
        "max_abs": float((logits - reference).abs().max()),
        "top1_agreement": 1.0 - float(differs.to(torch.float64).mean()),
        "top1_disagreement_decisive": float(differs[decisive].to(torch.float64).mean())
        if bool(decisive.any())
        else 0.0,
        "kl": float(kl),
    }


# Measured with `attnexport verify` on the tiny zoo models llama, qwen2, mistral (random
# weights, seed 0; block size 32, symmetric, accuracy level 4, lm_head quantized) against the
# float32 eager model, worst over the teacher-forced prefill and decode logits:
#   int4: max abs 0.118, KL 2.8e-4 nats, top-1 agreement 0.33-1.0 (near-tied random logits)
#   int8: max abs 0.0083, KL 2.0e-6 nats, top-1 agreement 0.67-1.0
# The bounds leave ~2.5-5x room; no decisive token (module doc of logit_quality) may flip.
_QUANTIZED_TOLERANCES = {
    4: {"max_abs": 0.3, "top1_disagreement_decisive": 0.0, "kl": 1e-3},
    8: {"max_abs": 0.025, "top1_disagreement_decisive": 0.0, "kl": 1e-5},
}


def quantized_tolerance(bits: int) -> dict[str, float]:
    """Bounds for a model whose weights are quantized to ``bits`` (4 or 8) against its float
    eager model, per :func:`logit_quality` with ``margin = 2 * max_abs``: ``max_abs`` logit
    error, ``top1_disagreement_decisive`` and mean ``kl`` divergence (nats)."""
    return dict(_QUANTIZED_TOLERANCES[bits])


# The error a KV cache dtype adds, measured on the cache-dtype op cases of
# tests/attention_cases.py (cache_dtype_cases: N(0, 1) keys, values and queries, head size 32,
# every batch shape and logits option): worst max abs difference of paged attention over the
# converted/quantized cache from the float64 reference over the unconverted cache was
#   float16 9.3e-4, bfloat16 9.5e-3, int8 (per-row scales) 1.8e-2.
# The bounds leave ~3x room.
_CACHE_QUANTIZATION_ATOL = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.float16: 3e-3,
    torch.bfloat16: 3e-2,
    torch.int8: 5e-2,
}


def cache_quantization_tolerance(cache_dtype: torch.dtype) -> dict[str, float]:
    """``{"atol", "rtol"}`` for attention over a ``cache_dtype`` cache against attention over
    the exact (unconverted) keys and values, for O(1) activations: the error the cache dtype
    itself adds (``assert_close`` keywords)."""
    return {"atol": _CACHE_QUANTIZATION_ATOL[cache_dtype], "rtol": 0.0}


# `attnexport verify` of an artifact with a KV cache dtype of its own runs every leg on caches
# of that dtype; legs then differ by float rounding, which a reduced cache can turn into one
# step (ulp, or int8 quantum) of a cached value. Measured with `attnexport verify` on the tiny
# zoo models llama, qwen2, mistral, gpt2, bloom, bart (random weights, seed 0, float32
# activations; eager[sdpa] vs .pt2 vs ONNX bodies), worst over logits and caches:
#   float16 2.4e-4 (one fp16 ulp of a cached value), bfloat16 1.2e-4, int8 2.4e-7 (no
#   quantization step moved); the bounds allow one ulp (bfloat16: 7.8e-3 at 1.0) or one int8
#   step of a cached value of magnitude ~3 (0.024).
_KV_CACHE_MODEL_TOLERANCES = {
    torch.float32: 1e-4,
    torch.float16: 1e-3,
    torch.bfloat16: 1e-2,
    torch.int8: 5e-2,
}


def kv_cache_model_tolerance(cache_dtype: torch.dtype) -> float:
    """Max abs error allowed between two runs of a whole model (logits, dequantized caches)
    that both keep their KV caches in ``cache_dtype`` (eager vs ``.pt2`` vs ONNX)."""
    return _KV_CACHE_MODEL_TOLERANCES[cache_dtype]


# What a KV cache dtype costs a whole model: logits with the caches in that dtype against the
# same model with float32 caches (eager, sdpa; the teacher-forced steps of `attnexport verify`).
# Measured on the tiny zoo models llama, qwen2, mistral, gpt2, bloom, bart (seed 0), worst:
#   float16: max abs 1.2e-4, KL 4.1e-10 nats, top-1 agreement 1.0
#   bfloat16: max abs 9.9e-4, KL 3.0e-8, top-1 agreement 1.0
#   int8: max abs 3.7e-3, KL 2.4e-7, top-1 agreement 0.95-1.0 (near-tied random logits)
# The bounds leave ~4x room.
_KV_CACHE_LOGIT_TOLERANCES = {
    torch.float32: {"max_abs": 1e-4, "kl": 1e-9},
    torch.float16: {"max_abs": 5e-4, "kl": 2e-9},
    torch.bfloat16: {"max_abs": 4e-3, "kl": 1.2e-7},
    torch.int8: {"max_abs": 1.5e-2, "kl": 1e-6},
}


def kv_cache_logit_tolerance(cache_dtype: torch.dtype) -> dict[str, float]:
    """Bounds for a float32 model whose KV caches are ``cache_dtype`` against the same model
    with float32 caches, per :func:`logit_quality`: ``max_abs`` logit error and mean ``kl``
    divergence (nats). Top-1 agreement is reported, not bounded: random tiny models have
    near-tied logits."""
    return dict(_KV_CACHE_LOGIT_TOLERANCES[cache_dtype])
