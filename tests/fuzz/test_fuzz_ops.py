"""Fuzzing every attnexport op on every target of this environment (the eager op on each
available kernel backend; one ONNX node by its function body on stock onnxruntime and with
the native kernels registered) with well-formed and malformed inputs.

The oracle, per case (each run in a worker process, so a crash fails the test, not pytest):

* a malformed input gets a named error (a ``TypeError``/``ValueError`` naming an argument, or
  an onnxruntime error from the session) and the caches are left as they were;
* a well-formed input gets the float64 reference's answer (caches: exactly the reference's
  write), even with NaN/Inf in pool slots no sequence can see;
* never a crash, a hang, a huge allocation, a raw ``IndexError``/``RuntimeError``, or a silent
  answer to a malformed input.

A class that fails for a known reason carries a strict xfail naming it (:data:`KNOWN`).
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings

from attnexport import ort_kernels
from attnexport.custom_ops import reference, registered_backends
from attnexport.tolerances import tolerance
from tests.fuzz.cases import EAGER_ONLY, KINDS
from tests.fuzz.harness import WorkerDied
from tests.fuzz.worker import ONNX_TARGETS, FuzzCase, Outcome

PROFILE = settings.get_profile(
    "fuzz" if os.environ.get("HYPOTHESIS_PROFILE") == "fuzz" else "fuzz-quick"
)

EAGER_TARGETS = [b.name for b in registered_backends() if b.unavailable_reason() is None]
TARGETS = [*EAGER_TARGETS, *ONNX_TARGETS]

# (target, op, kind) -> why that class fails today, as a strict xfail; "*" matches any target,
# "onnx" both ONNX paths, "eager" every backend. Empty: every class found so far is fixed.
KNOWN: dict[tuple[str, str, str], str] = {}


def _known(target: str, op: str, kind: str) -> str | None:
    family = "onnx" if target in ONNX_TARGETS else "eager"
    for key in ((target, op, kind), (family, op, kind), ("*", op, kind)):
        if key in KNOWN:
            return KNOWN[key]
    return None


def _params():
    for op, (_, kinds) in KINDS.items():
        for kind in kinds:
            for target in TARGETS:
                if target in ONNX_TARGETS and (op, kind) in EAGER_ONLY:
                    continue
                marks = []
                if target == "onnx-native" and ort_kernels.unavailable_reason() is not None:
                    marks.append(pytest.mark.skip(reason=ort_kernels.unavailable_reason()))
                reason = _known(target, op, kind)
                if reason is not None:
                    marks.append(pytest.mark.xfail(strict=True, reason=reason))
                yield pytest.param(target, op, kind, marks=marks, id=f"{target}-{op}-{kind}")


def _reference(case: FuzzCase, before: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The float64 answer of a well-formed case, keyed like the worker's outputs (``outN``
    for returned tensors, the cache names for in-place writes)."""
    x, attrs = case.final_inputs(), case.attrs
    if case.op == "reshape_and_cache":
        key_cache, value_cache = before["key_cache"].clone(), before["value_cache"].clone()
        reference.reshape_and_cache(x["key"], x["value"], key_cache, value_cache, x["slot_mapping"])
        return {"key_cache": key_cache, "value_cache": value_cache}
    outputs = getattr(reference, case.op)(*x.values(), **attrs)
    if isinstance(outputs, torch.Tensor):
        outputs = (outputs,)
    return {f"out{i}": t for i, t in enumerate(outputs)}


def _names_an_argument(case: FuzzCase, message: str) -> bool:
    names = [*case.inputs, *case.attrs, "num_heads", "num_kv_heads", "head_size"]
    return any(name in message for name in names)


def _is_named_error(target: str, case: FuzzCase, outcome: Outcome) -> bool:
    if target in ONNX_TARGETS and (
        outcome.error_module.startswith("onnxruntime")
        # run_with_iobinding re-raises the session's failure as RuntimeError("Error in execution")
        or outcome.message.startswith("Error in execution")
    ):
        return True
    if outcome.error_type == "BackendUnsupportedError":
        return True  # a backend's named refusal, with its reasons
    named_kind = {"TypeError", "ValueError"} & set(outcome.error_bases)
    raw = {"IndexError", "KeyError", "MemoryError"} & set(outcome.error_bases)
    return bool(named_kind) and not raw and _names_an_argument(case, outcome.message)


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and bool(torch.equal(a.nan_to_num(), b.nan_to_num()))
        and bool((a.isnan() == b.isnan()).all())
    )


def _nothing_computed(case: FuzzCase, outcome: Outcome) -> bool:
    """An ONNX node fed no tokens returns empty outputs whatever the widths: no value is
    computed, so none can be wrong (a graph checks widths only as far as it reads them)."""
    first = next(iter(case.inputs.values()))
    return first.numel() == 0 and all(t.numel() == 0 for t in outcome.outputs.values())


def judge(target: str, case: FuzzCase, outcome: Outcome) -> None:
    """Raises AssertionError (with the reason) unless ``outcome`` is right for ``case``."""
    if outcome.status == "raised":
        error = f"{outcome.error_module}.{outcome.error_type}: {outcome.message[:400]}"
        assert "failed to allocate memory" not in outcome.message.lower(), (
            f"huge allocation: {error}"
        )
        if case.valid is True:
            assert outcome.error_type == "BackendUnsupportedError", (
                f"well-formed input refused: {error}"
            )
            return
        assert _is_named_error(target, case, outcome), f"not a named error: {error}"
        for name, after in outcome.after.items():
            assert _equal(after, outcome.before[name]), f"{name} written before the error ({error})"
        return
    if case.valid is False and target in ONNX_TARGETS and _nothing_computed(case, outcome):
        return
    assert case.valid is not False, "malformed input accepted: no error, outputs " + ", ".join(
        f"{n}: {tuple(t.shape)}" for n, t in outcome.outputs.items()
    )
    expected = _reference(case, outcome.before)
    actual = outcome.outputs | outcome.after
    dtype = next(iter(case.inputs.values())).dtype
    for name, want in expected.items():
        got = actual[name]
        assert got.shape == want.shape, (
            f"{name}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
        )
        if case.op == "reshape_and_cache":
            assert _equal(got, want), f"{name}: the cache write differs from the reference"
        else:
            assert bool(got.isfinite().all()) or not bool(want.isfinite().all()), (
                f"{name}: NaN/Inf in the output where the reference is finite"
            )
            torch.testing.assert_close(
                got.to(torch.float64),
                want.to(torch.float64),
                **tolerance(dtype),
                msg=lambda m, name=name: f"{name}: silent wrong answer: {m}",
            )


@pytest.mark.parametrize(("target", "op", "kind"), list(_params()))
def test_fuzz(target: str, op: str, kind: str, fuzz_workers) -> None:
    strategy, _ = KINDS[op]
    worker = fuzz_workers[target]

    @PROFILE
    @given(case=strategy(kind))
    def check(case: FuzzCase) -> None:
        try:
            outcome = worker.run(case)
        except WorkerDied as died:
            raise AssertionError(str(died)) from None
        judge(target, case, outcome)

    check()
