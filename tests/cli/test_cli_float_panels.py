"""A float32 export's projections are ``attnexport.PackedMatMul`` on panels (target
``attnexport``; ``PackedMatMulSiluAndMul`` with the activation after the gate/up projection),
the standard target's stay ``MatMul``; quantizing such an export turns them
back first; the lowering refuses panels for a target without the node."""

from __future__ import annotations

from collections import Counter

import onnx
import pytest
import torch

from attnexport.artifact import quantize_export
from attnexport.lowering import WeightQuantization
from attnexport.model_contract import DOMAIN
from attnexport.runtime import CacheConfig, Engine, OrtExecutor, SamplingParams


def _ops(directory) -> Counter:
    model = onnx.load(str(directory / "model.onnx"), load_external_data=False)
    return Counter((n.domain or "", n.op_type) for n in model.graph.node)


def _greedy(directory, kernels: str) -> list[int]:
    executor = OrtExecutor(directory / "model.onnx", num_threads=2, kernels=kernels)
    engine = Engine(executor, CacheConfig(num_blocks=128, enable_prefix_caching=False))
    (output,) = engine.generate([list(range(3, 40))], SamplingParams(max_tokens=8))
    return output.outputs[0].token_ids


def test_the_float32_export_packs_every_projection(llama_export):
    ops = _ops(llama_export)
    # 2 layers' qkv, o and down projections, and the (untied) logits projection; the gate/up
    # projections with the SiluAndMul after them
    assert ops[(DOMAIN, "PackedMatMul")] == 7
    assert ops[(DOMAIN, "PackedMatMulSiluAndMul")] == 2
    assert ops[("", "MatMul")] == 0 and ops[(DOMAIN, "SiluAndMul")] == 0
    assert _greedy(llama_export, "native") == _greedy(llama_export, "bodies")


def test_the_standard_target_keeps_matmul(tmp_path):
    from attnexport.cli.main import main

    out = tmp_path / "standard"
    assert main(["export", "llama", "--out", str(out), "--target", "standard"]) == 0
    ops = _ops(out)
    # (and the attention bodies' products, inlined)
    assert ops[("", "MatMul")] >= 9 and not any(domain == DOMAIN for domain, _ in ops)


def test_quantizing_a_packed_export_reads_its_matmuls_back(llama_export, tmp_path):
    manifest = quantize_export(llama_export, tmp_path / "int8", WeightQuantization("int8"))
    ops = _ops(tmp_path / "int8")
    assert ops[(DOMAIN, "PackedMatMul")] == 0 and ops[(DOMAIN, "PackedMatMulSiluAndMul")] == 0
    # (the gate/up projections fused again, on their 8-bit weights)
    assert ops[(DOMAIN, "MatMul8Bits")] == 7 and ops[(DOMAIN, "MatMul8BitsSiluAndMul")] == 2
    assert ops[(DOMAIN, "SiluAndMul")] == 0
    assert manifest["weights"]["format"] == "int8"
    assert len(_greedy(tmp_path / "int8", "native")) == 8


def test_the_lowering_refuses_panels_for_another_target(tmp_path):
    from attnexport.lowering import to_onnx

    with pytest.raises(ValueError, match=r"pack_float_weights: .* target 'standard'"):
        to_onnx(
            torch.nn.Linear(4, 32),
            (torch.ones(1, 4),),
            tmp_path / "m.onnx",
            target="standard",
            pack_float_weights=True,
        )
