"""Shared fixtures: every backend-parametrized test runs once per registered backend and skips,
with the backend's own reasons, the cases that backend cannot run here."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

import attnexport  # noqa: F401  (registers ops and backends)
from attnexport import ort_kernels
from attnexport.custom_ops import get_backend, registered_backends, use_backend

# smollm2_checkpoint, smollm2_fp32_artifact: the real checkpoint (tests/real_model.py)
pytest_plugins = ["tests.real_model"]

# CI runs must not depend on luck: property tests replay the same examples every run there.
settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")


BACKENDS = [b.name for b in registered_backends()]


def pytest_sessionstart(session):
    if os.environ.get("ATTNEXPORT_REQUIRE_IPEX") == "1":
        # Installed is not enough: the IPEX suites must really run, so it must also load.
        reason = get_backend("ipex").unavailable_reason()
        if reason is not None:
            raise pytest.UsageError(
                f"ATTNEXPORT_REQUIRE_IPEX=1 but the ipex backend is unavailable: {reason}"
            )
    if os.environ.get("ATTNEXPORT_REQUIRE_ORT_KERNELS") == "1":
        reason = ort_kernels.unavailable_reason()
        if reason is not None:
            raise pytest.UsageError(f"ATTNEXPORT_REQUIRE_ORT_KERNELS=1 but {reason}")


def pytest_ignore_collect(collection_path, config):
    if os.environ.get("ATTNEXPORT_TORCH_DEPENDENT_ONLY") == "1":
        from tests.torch_dependent import may_hold_any

        if collection_path.is_relative_to(config.rootpath):
            path = collection_path.relative_to(config.rootpath).as_posix()
            if path != "." and not may_hold_any(path):
                return True
    return None


def pytest_collection_modifyitems(config, items):
    # make test-ipex: only what torch 2.8, IPEX or xFormers can change (tests/torch_dependent.py)
    if os.environ.get("ATTNEXPORT_TORCH_DEPENDENT_ONLY") == "1":
        from tests.torch_dependent import select

        whole_suite = config.args_source == pytest.Config.ArgsSource.TESTPATHS
        try:
            selected = select([item.nodeid for item in items], whole_suite)
        except LookupError as error:
            raise pytest.UsageError(str(error)) from None
        pairs = list(zip(items, selected, strict=True))
        config.hook.pytest_deselected(items=[item for item, keep in pairs if not keep])
        items[:] = [item for item, keep in pairs if keep]


@pytest.fixture(params=BACKENDS)
def backend(request):
    """A backend name; the test body runs under ``use_backend(name)``."""
    name = request.param
    unavailable = next(b for b in registered_backends() if b.name == name).unavailable_reason()
    if unavailable:
        pytest.skip(f"{name}: {unavailable}")
    with use_backend(name):
        yield name
