"""Hypothesis profiles of the fuzz suite and its worker processes (one per target).

``make test`` runs the small fixed budget (``fuzz-quick``: a few derandomized examples per
class, so the run is reproducible); ``HYPOTHESIS_PROFILE=fuzz`` runs many random examples per
class (see docs/testing.md)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, settings

from tests.fuzz.harness import Worker

_SLOW_IS_FINE = list(HealthCheck)
settings.register_profile(
    "fuzz-quick",
    max_examples=5,
    deadline=None,
    derandomize=True,
    database=None,
    # No shrinking: a failure is reported with the example that found it, in a fixed time.
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=_SLOW_IS_FINE,
)
settings.register_profile(
    "fuzz", max_examples=400, deadline=None, suppress_health_check=_SLOW_IS_FINE
)


@pytest.fixture(scope="session")
def fuzz_workers():
    """``{target: Worker}``, started on first use, closed at the end of the session."""
    workers: dict[str, Worker] = {}

    class Pool(dict):
        def __missing__(self, target: str) -> Worker:
            workers[target] = self[target] = Worker(target)
            return workers[target]

    yield Pool()
    for worker in workers.values():
        worker.close()
