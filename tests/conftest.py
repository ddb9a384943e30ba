"""Shared fixtures: every backend-parametrized test runs once per registered backend and skips,
with the backend's own reasons, the cases that backend cannot run here."""

from __future__ import annotations

import os

import pytest

import attnexport  # noqa: F401  (registers ops and backends)
from attnexport.custom_ops import registered_backends, use_backend

BACKENDS = [b.name for b in registered_backends()]


def pytest_sessionstart(session):
    if os.environ.get("ATTNEXPORT_REQUIRE_IPEX") == "1":
        import importlib.util

        if importlib.util.find_spec("intel_extension_for_pytorch") is None:
            raise pytest.UsageError(
                "ATTNEXPORT_REQUIRE_IPEX=1 but intel_extension_for_pytorch is not installed"
            )


@pytest.fixture(params=BACKENDS)
def backend(request):
    """A backend name; the test body runs under ``use_backend(name)``."""
    name = request.param
    unavailable = next(b for b in registered_backends() if b.name == name).unavailable_reason()
    if unavailable:
        pytest.skip(f"{name}: {unavailable}")
    with use_backend(name):
        yield name
