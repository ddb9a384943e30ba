"""Fixtures the lowering tests share: tiny zoo models exported to float32 ONNX once a session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def zoo_float_onnx(tmp_path_factory):
    """``export(name) -> (model, input names, model.onnx path)``: the zoo model ``name`` (seed 0)
    exported with ``to_onnx`` (block size 16), once a session per name; tests copy the file
    before they change it."""
    from attnexport.lowering import to_onnx
    from attnexport.models import load_zoo_model

    exports = {}

    def export(name: str):
        if name not in exports:
            model = load_zoo_model(name, seed=0)
            sample = model.export_sample(16)
            path = tmp_path_factory.mktemp(name) / "model.onnx"
            to_onnx(
                model,
                sample.args,
                path,
                dynamic_shapes=sample.dynamic_shapes,
                cache_spec=model.cache_spec(16),
            )
            exports[name] = (model, sample.input_names, path)
        return exports[name]

    return export
