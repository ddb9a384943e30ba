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


def scaled_tolerance(tolerance: float, magnitude: float) -> float:
    """``tolerance`` (a :func:`model_tolerance`) for values as large as ``magnitude`` (the
    reference's max abs): float rounding is relative to the values, and the model tolerances
    were set on tiny random models whose logits stay near 1. A real checkpoint's logits reach
    20-30 (SmolLM2: its float32 ONNX prefill logits differ from eager by 1.4e-4, ~7e-6 of their
    size), so the bound grows with them; below magnitude 1 it stays absolute."""
    return tolerance * max(1.0, magnitude)


CONFIDENT_MARGIN = 2.0
"""A token is *confident* when the reference's top-1 logit leads its top-2 by more than this
(the top-1 is e^2 ~ 7.4 times as likely): quantization should rarely flip those, while the
near-ties of random-weight models may flip freely."""


def logit_quality(
    logits: torch.Tensor, reference: torch.Tensor, targets: list[int | None] | None = None
) -> dict[str, float]:
    """How far ``logits`` [tokens, vocab] are from ``reference`` [tokens, vocab]:

    * ``max_abs``: the largest abs difference;
    * ``top1_agreement``: the fraction of rows whose argmax agrees;
    * ``confident_flips``: the fraction of the *confident* rows (:data:`CONFIDENT_MARGIN`)
      whose argmax changed (0 when there is none);
    * ``kl``: the mean over rows of KL(softmax(reference) || softmax(logits)), nats;
    * ``ppl_increase``: ``exp(mean NLL of logits - mean NLL of reference) - 1`` over the rows
      whose next token ``targets[row]`` is known (0 without one): the perplexity increase.
    """
    logits, reference = logits.to(torch.float64), reference.to(torch.float64)
    if logits.numel() == 0:
        return {
            "max_abs": 0.0,
            "top1_agreement": 1.0,
            "confident_flips": 0.0,
            "kl": 0.0,
            "ppl_increase": 0.0,
        }
    log_p = torch.log_softmax(reference, dim=-1)
    log_q = torch.log_softmax(logits, dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean()
    differs = logits.argmax(-1) != reference.argmax(-1)
    top2 = reference.topk(min(2, reference.shape[-1]), dim=-1).values
    confident = (top2[..., 0] - top2[..., -1]) > CONFIDENT_MARGIN
    known = [(row, t) for row, t in enumerate(targets or []) if t is not None]
    ppl_increase = 0.0
    if known:
        rows = torch.tensor([r for r, _ in known])
        tokens = torch.tensor([t for _, t in known])
        nll = -log_q[rows, tokens].mean() + log_p[rows, tokens].mean()
        ppl_increase = float(torch.exp(nll) - 1)
    return {
        "max_abs": float((logits - reference).abs().max()),
        "top1_agreement": 1.0 - float(differs.to(torch.float64).mean()),
        "confident_flips": float(differs[confident].to(torch.float64).mean())
        if bool(confident.any())
        else 0.0,
        "kl": float(kl),
        "ppl_increase": ppl_increase,
    }


# What `attnexport verify` accepts of a model with quantized weights against its float eager
# model, per logit_quality over every logits row of verify's batch (its English text, or random
# tokens without a tokenizer). Measured with `attnexport verify --json` on SmolLM2-135M-Instruct
# (docs/quantization.md, "verify's bounds", has the figures), onnx / onnx[native] legs:
#   int8 default (its worst option):  KL 0.0062 / 0.0074, ppl +-0.7%, confident flips 0
#   int4 default (hqq, lm_head int8): KL 0.0069 / 0.0061, ppl -0.9% / -0.4%, flips 0
#   int4 worst (rtn sym, block 128, lm_head int4): KL 0.77 / 0.76, ppl +53%, flips 18%
# int4's bounds are ~2x its worst option, so any option passes and a broken export (KL of nats,
# most confident tokens flipped) does not; int8's leave ~7x. The KV caches' error follows the
# weights' and is reported, not bounded ("cache": no bound).
_QUANTIZED_BOUNDS = {
    "int4": {"kl": 1.5, "ppl_increase": 1.5, "confident_flips": 0.4, "cache": 1e9},
    "int8": {"kl": 0.05, "ppl_increase": 0.05, "confident_flips": 0.05, "cache": 1e9},
}


def quantized_bounds(weight_format: str) -> dict[str, float]:
    """Bounds for a model whose weights are in ``weight_format`` (``int4``, ``int8``) against
    its float eager model: ``kl`` (mean, nats), ``ppl_increase`` (fraction), ``confident_flips``
    (fraction) per :func:`logit_quality`, and ``cache`` (max abs error of the KV caches)."""
    return dict(_QUANTIZED_BOUNDS[weight_format])


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
