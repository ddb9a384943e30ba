"""The op registries are built from the slices, and each slice's Python face matches its
registered schema."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch

import attnexport
from attnexport import custom_ops
from attnexport.custom_ops import CACHE_ARGUMENTS, OP_SLICES, OP_SPECS, reference


def test_every_registered_op_has_a_spec_from_a_slice():
    registered = {
        name.removeprefix("attnexport::")
        for name in torch._C._dispatch_get_all_op_names()
        if name.startswith("attnexport::")
    }
    assert set(OP_SPECS) == registered
    folders = {p.parent.name for p in Path(custom_ops.__file__).parent.glob("*/__init__.py")}
    assert folders - {"__pycache__"} == set(OP_SLICES)


@pytest.mark.parametrize("name", list(OP_SPECS))
def test_the_public_function_has_the_schema_of_the_op(name):
    spec = OP_SPECS[name]
    schema = spec.overload._schema
    assert str(schema) == f"attnexport::{name}{spec.schema}".replace("=0.0", "=0.")
    parameters = inspect.signature(getattr(attnexport, name)).parameters
    assert list(parameters) == [a.name for a in schema.arguments]
    for argument in schema.arguments:
        default = parameters[argument.name].default
        if argument.has_default_value():
            assert default == argument.default_value, argument.name
        else:
            assert default is inspect.Parameter.empty, argument.name
    assert getattr(reference, name) is spec.reference


def test_cache_arguments_name_the_cache_positions():
    assert CACHE_ARGUMENTS == {
        "reshape_and_cache": ((2, "key_cache"), (3, "value_cache")),
        "reshape_and_cache_functional": ((2, "key_cache"), (3, "value_cache")),
        "paged_attention": ((1, "key_cache"), (2, "value_cache")),
    }
    assert [n for n, s in OP_SPECS.items() if s.writes_caches] == ["reshape_and_cache"]


def test_reference_names_only_ops():
    with pytest.raises(AttributeError, match="no attribute 'not_an_op'"):
        reference.not_an_op  # noqa: B018
