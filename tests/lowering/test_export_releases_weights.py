"""``to_onnx`` keeps none of the model's weights alive once it returns: torch.onnx's IR wraps
the torch tensors, and onnxscript's module-level rewrite rules keep their last match (and
through it the graph) alive, which held a second float copy of the weights through
``export --weights``' quantization."""

from __future__ import annotations

import gc
import weakref

from attnexport.lowering import to_onnx
from attnexport.models import load_zoo_model


def test_to_onnx_keeps_no_weight_of_the_model_alive(tmp_path):
    model = load_zoo_model("llama", seed=0)
    sample = model.export_sample(16)
    to_onnx(
        model,
        sample.args,
        tmp_path / "model.onnx",
        dynamic_shapes=sample.dynamic_shapes,
        cache_spec=model.cache_spec(16),
    )
    weights = {name: weakref.ref(p) for name, p in model.named_parameters()}
    del model, sample
    gc.collect()
    alive = [name for name, ref in weights.items() if ref() is not None]
    assert not alive, f"still referenced after the export: {alive}"
