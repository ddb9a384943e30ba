"""``attnexport export --prefill-attention bfloat16``: the nodes' ``prefill_bf16``, the manifest,
``inspect``, the function bodies (which ignore it) and the flag's refusals."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from attnexport.model_contract import DOMAIN
from attnexport.runtime import CacheConfig, Engine, OrtExecutor, SamplingParams
from tests.cli.helpers import assert_one_line_error, run_cli


def _export(tmp_path_factory, name: str, *flags: str):
    from attnexport.cli.main import main

    out = tmp_path_factory.mktemp(name)
    assert main(["export", "llama", "--out", str(out), *flags]) == 0
    return out


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    return {
        "float32": _export(tmp_path_factory, "llama_f32", "--kv-cache-dtype", "int8"),
        "bfloat16": _export(
            tmp_path_factory,
            "llama_bf16",
            *("--kv-cache-dtype", "int8", "--prefill-attention", "bfloat16"),
        ),
    }


def _marks(directory) -> list[int]:
    model = onnx.load(str(directory / "model.onnx"), load_external_data=False)
    return [
        next((a.i for a in n.attribute if a.name == "prefill_bf16"), 0)
        for n in model.graph.node
        if n.domain == DOMAIN and n.op_type == "PagedAttention"
    ]


def test_the_flag_marks_every_attention_node_and_inspect_says_so(exports, capsys):
    assert _marks(exports["float32"]) == [0, 0]  # two layers
    assert _marks(exports["bfloat16"]) == [1, 1]
    for precision, directory in exports.items():
        manifest = json.loads((directory / "manifest.json").read_text())
        assert manifest["prefill_attention"] == precision
        code, out, _ = run_cli(capsys, "inspect", str(directory), "--json")
        assert code == 0 and json.loads(out)["prefill_attention"] == precision
    code, out, _ = run_cli(capsys, "inspect", str(exports["bfloat16"]))
    assert code == 0 and "prefill attention: bfloat16 (native kernel)" in out


def _prefill_logits(directory, kernels: str) -> np.ndarray:
    """The first token of one 40-token prompt, its log-probability and its row's top 5."""
    executor = OrtExecutor(directory / "model.onnx", num_threads=2, kernels=kernels)
    engine = Engine(executor, CacheConfig(num_blocks=128, enable_prefix_caching=False))
    prompt = np.random.default_rng(0).integers(3, 200, 40).tolist()
    [output] = engine.generate([prompt], SamplingParams(max_tokens=1, logprobs=5))
    first = output.outputs[0].logprobs[0]
    return np.array([first.token_id, *first.top_ids, first.logprob, *first.top_logprobs])


def test_the_function_bodies_ignore_the_attribute(exports):
    """Stock onnxruntime (the bodies, float32) computes the marked export as the other."""
    marked = _prefill_logits(exports["bfloat16"], "bodies")
    np.testing.assert_array_equal(marked, _prefill_logits(exports["float32"], "bodies"))


@pytest.mark.parametrize(
    "flags, needle",
    [
        (("--format", "pt2"), "--format onnx"),
        (("--target", "standard"), "--target other than standard"),
    ],
)
def test_the_flag_is_refused_where_no_native_node_reads_it(tmp_path, capsys, flags, needle):
    code, _, err = run_cli(
        capsys,
        "export",
        "llama",
        "--out",
        tmp_path / "x",
        "--prefill-attention",
        "bfloat16",
        *flags,
    )
    assert code != 0
    assert_one_line_error(err, "export", "--prefill-attention bfloat16", needle)
