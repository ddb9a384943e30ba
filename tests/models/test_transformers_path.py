"""The transformers path (``attnexport.models.generic``) against transformers itself: each
family of ``tests/models/hf_families.py`` is built as a tiny random checkpoint, loaded with
``impl="transformers"``, exported once (``.pt2`` and ``.onnx``, the rewrite rules applied) and
run step by step (a ragged prefill, then batched greedy decoding) through ONNX with the nodes'
bodies, ONNX with the native kernels and the ``.pt2``: greedy tokens equal transformers'
``generate`` on each prompt alone, and the logits they were chosen from within the float32
model tolerance. The default run takes the families marked ``default``;
``ATTNEXPORT_ALL_FAMILIES=1`` runs every one.

Models the paged ops cannot run are refused with a named error when loaded: attention sinks,
recurrent or convolution layers, attention outside the interface, positions not taken from
``position_ids`` (the parity probe), an attention module called twice per layer."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

from attnexport.models import UnsupportedModelError, load_checkpoint
from attnexport.runtime.step_driver import PagedDriver
from attnexport.tolerances import model_tolerance
from tests.models.executors import Exports, paged_runner
from tests.models.hf_families import (
    BLOCK_SIZE,
    CONFIG_DEFAULT,
    FAMILIES,
    GREEDY_STEPS,
    PROMPTS,
    Family,
    build_checkpoint,
)
from tests.models.hf_reference import greedy_generate

ALL_FAMILIES = os.environ.get("ATTNEXPORT_ALL_FAMILIES") == "1"
RUN = [name for name, family in FAMILIES.items() if family.default or ALL_FAMILIES]
ATOL = model_tolerance(torch.float32)
NUM_BLOCKS = 64


@dataclass
class Exported:
    name: str
    model: object
    exports: Exports
    hf_greedy: list[tuple[list[int], torch.Tensor]]


def export_once(model, directory) -> Exports:
    """The model's ``model.pt2`` and ``model.onnx`` from one ``torch.export`` (as ``attnexport
    export`` does)."""
    from attnexport.artifact import save_pt2
    from attnexport.lowering import export_program, to_onnx

    sample = model.export_sample(BLOCK_SIZE)
    program = export_program(model, sample.args, dynamic_shapes=sample.dynamic_shapes)
    save_pt2(program, directory / "model.pt2")
    to_onnx(program, sample.args, directory / "model.onnx", cache_spec=model.cache_spec(BLOCK_SIZE))
    return Exports(directory / "model.pt2", directory / "model.onnx")


@pytest.fixture(scope="module", params=RUN)
def exported(request, tmp_path_factory) -> Exported:
    directory = tmp_path_factory.mktemp(request.param)
    hf_model = build_checkpoint(FAMILIES[request.param], directory / "checkpoint")
    model = load_checkpoint(directory / "checkpoint", impl="transformers")
    assert model.impl == "transformers"
    exports = export_once(model, directory)
    greedy = [greedy_generate(hf_model, list(prompt), GREEDY_STEPS) for prompt in PROMPTS]
    return Exported(request.param, model, exports, greedy)


@pytest.mark.parametrize("leg", ["onnx", "onnx-native", "pt2"])
def test_greedy_tokens_and_logits_match_transformers(exported, leg):
    driver = PagedDriver(
        paged_runner(exported.model, leg, exported.exports),
        exported.model.cache_spec(BLOCK_SIZE),
        NUM_BLOCKS,
        seed=1,
    )
    for prompt in PROMPTS:
        driver.add(prompt)
    tokens, logits = driver.greedy(GREEDY_STEPS)
    assert tokens == [expected for expected, _ in exported.hf_greedy]
    for ours, (_, expected) in zip(logits, exported.hf_greedy, strict=True):
        torch.testing.assert_close(ours, expected, atol=ATOL, rtol=0)
    assert len({t for sequence in tokens for t in sequence}) > 3, "degenerate greedy output"


def test_a_tied_embedding_is_stored_once_and_gives_transformers_tokens(tmp_path):
    """A tied ``lm_head`` on the transformers path (``MatMul(x, Transpose(E))`` beside the
    embedding's ``Gather(E)``) reads the one table through ``Gemm(transB=1)``: no transposed
    copy of ``E`` is stored, and the greedy tokens are still transformers'."""
    import onnx

    vocab = 160  # no other weight has this dimension
    family = Family("llama", "tied", {"tie_word_embeddings": True, "vocab_size": vocab})
    hf_model = build_checkpoint(family, tmp_path / "checkpoint")
    model = load_checkpoint(tmp_path / "checkpoint", impl="transformers")
    exports = export_once(model, tmp_path)
    graph = onnx.load(str(exports.onnx)).graph
    hidden = hf_model.config.hidden_size
    tables = [i.name for i in graph.initializer if sorted(i.dims) == sorted([vocab, hidden])]
    assert len(tables) == 1, tables
    readers = sorted(n.op_type for n in graph.node if tables[0] in n.input)
    assert readers == ["Gather", "Gemm"]
    driver = PagedDriver(
        paged_runner(model, "onnx", exports), model.cache_spec(BLOCK_SIZE), NUM_BLOCKS, seed=1
    )
    for prompt in PROMPTS:
        driver.add(prompt)
    tokens, _ = driver.greedy(GREEDY_STEPS)
    assert tokens == [greedy_generate(hf_model, list(p), GREEDY_STEPS)[0] for p in PROMPTS]


# ----------------------------------------------------------------------------- refusals

REFUSED = {
    # convolution layers keep a state across steps
    "lfm2": (
        Family("lfm2", "", {"layer_types": ["conv", "full_attention"]}),
        r"layer_types: conv layers",
    ),
    # its attention does not call the attention interface
    "bloom": (Family("bloom", "", {"n_layer": 1, "n_head": 4}), r"no layer called the attention"),
    # learned positions from its own arange, not position_ids: packed sequences differ
    "blenderbot-small": (
        Family("blenderbot-small", "", {"d_model": 64, "decoder_layers": 1, "encoder_layers": 1}),
        r"logits differ from transformers' own",
    ),
    # a learned per-key bias in a mask of its own (the paged ops would drop it)
    "doge": (Family("doge", ""), r"attention_mask: the model builds a mask of its own"),
    # its attention class comes from a table of its own, not the AttentionInterface
    "git": (Family("git", ""), r"picks its attention class from a table of its own"),
    # its forward needs the dense mask the path does not build (and computes ALiBi itself)
    "mpt": (Family("mpt", ""), r"builds no dense mask"),
    # differential attention calls the attention function twice per layer
    "diffllama": (Family("diffllama", ""), r"runs more than once per forward"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_unsupported_models_are_refused_with_the_reason(name, tmp_path):
    family, reason = REFUSED[name]
    build_checkpoint(family, tmp_path)
    with pytest.raises(UnsupportedModelError, match=reason):
        load_checkpoint(tmp_path, impl="transformers")


# ----------------------------------------------------------------------------- the CLI


def test_a_forward_torch_export_cannot_trace_is_refused_by_name(tmp_path, capsys):
    """LongCat-Flash's experts branch on the routing's values (its zero-computation experts):
    torch.export fails on a data-dependent guard, which ``export`` names as the model's
    limit (exit 2), not an internal error."""
    from tests.cli.helpers import run_cli

    sizes = {"head_dim": CONFIG_DEFAULT, "num_key_value_heads": CONFIG_DEFAULT}
    sizes |= {"n_routed_experts": 4, "zero_expert_num": 2, "moe_topk": 2}
    build_checkpoint(Family("longcat_flash", "", sizes), tmp_path / "checkpoint")
    code, _, err = run_cli(capsys, "export", tmp_path / "checkpoint", "--out", tmp_path / "out")
    assert code == 2, err
    assert "LongcatFlashForCausalLM: torch.export cannot trace its forward" in err, err
    assert "data-dependent" in err and "internal error" not in err


def test_export_picks_the_transformers_path_for_a_family_the_zoo_lacks(tmp_path, capsys):
    """``attnexport export`` (``--impl auto``) exports an OLMo 2 checkpoint through the
    transformers path, the manifest and ``inspect`` say so and name the rewrite rules that
    fired, and ``run`` gives transformers' greedy tokens; ``--impl zoo`` refuses it by name."""
    import json

    from tests.cli.helpers import run_cli, run_json

    hf_model = build_checkpoint(FAMILIES["olmo2"], tmp_path / "checkpoint")
    out = tmp_path / "export"
    code, _, err = run_cli(capsys, "export", tmp_path / "checkpoint", "--out", out)
    assert code == 0, err
    assert json.loads((out / "manifest.json").read_text())["impl"] == "transformers"
    code, summary, _ = run_cli(capsys, "inspect", out, "--json")
    summary = json.loads(summary)
    assert summary["impl"] == "transformers" and summary["fusions"], summary["fusions"]
    assert any("attnexport" in op for op in summary["custom_nodes"])
    prompt = list(PROMPTS[0])
    outputs = run_json(capsys, out, "--prompt-ids", ",".join(map(str, prompt)), "--max-tokens", 6)
    assert outputs[0]["token_ids"] == greedy_generate(hf_model, prompt, 6)[0]
    code, _, err = run_cli(
        capsys, "export", tmp_path / "checkpoint", "--out", tmp_path / "zoo", "--impl", "zoo"
    )
    assert code == 2 and "olmo2" in err, err
