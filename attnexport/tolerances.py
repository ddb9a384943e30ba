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
