"""The fuzz harness itself: a crash or a hang in a worker fails the case (pytest lives on), the
worker is replaced, and a huge allocation fails inside the worker's memory limit."""

from __future__ import annotations

import pytest
import torch

from tests.fuzz import harness
from tests.fuzz.worker import FuzzCase


def _case(op: str) -> FuzzCase:
    return FuzzCase(op, "selftest", {}, {}, {}, valid=True)


def _silu(worker: harness.Worker) -> None:
    x = torch.randn(2, 8)
    outcome = worker.run(FuzzCase("silu_and_mul", "well_formed", {"x": x}, {}, {"x": x}, True))
    assert outcome.status == "ok" and outcome.outputs["out0"].shape == (2, 4)


@pytest.fixture(scope="module")
def worker():
    worker = harness.Worker("sdpa")
    yield worker
    worker.close()


def test_a_segfault_fails_the_case_and_the_worker_is_replaced(worker):
    _silu(worker)
    with pytest.raises(harness.WorkerDied, match=r"sdpa: crash \(signal 11\)"):
        worker.run(_case("selftest_segfault"))
    _silu(worker)


def test_a_hang_fails_the_case_and_the_worker_is_replaced(worker, monkeypatch):
    monkeypatch.setattr(harness, "CASE_TIMEOUT", 1.0)
    with pytest.raises(harness.WorkerDied, match=r"sdpa: hang"):
        worker.run(_case("selftest_hang"))
    monkeypatch.undo()
    _silu(worker)


def test_a_huge_allocation_fails_inside_the_memory_limit(worker):
    """3 GiB, never touched: only the address-space limit refuses it."""
    outcome = worker.run(_case("selftest_allocate"))
    assert outcome.status == "raised" and "allocate" in outcome.message
