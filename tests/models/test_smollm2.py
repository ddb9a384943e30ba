"""The real checkpoint, SmolLM2-135M-Instruct (tests/real_model.py): its float32 export answers
chat prompts exactly as transformers does, reads its GGUF-born weights as their exact codes
(the same logits, bit for bit, as float32 panels), and the default int8 and int4 exports keep the
model (perplexity, top-1 agreement and KL on a short English text, against the float32 export,
within the bounds docs/quantization.md derives from benchmarks/quality.py).

The quantized models are the float32 export quantized as ``export --weights`` does, once per
session (``smollm2_quantized``): a real-model export costs a minute and 3.4 GB. The int4
default's case runs with ATTNEXPORT_SLOW_TESTS=1 (its HQQ fit takes over a minute)."""

from __future__ import annotations

import pytest
import torch

from attnexport.cli.verify_text import TEXT
from attnexport.runtime import SamplingParams, engine_from_path
from attnexport.tolerances import logit_quality
from tests.real_model import HQQ_SECONDS, slow_param, transformers_greedy

CHATS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "How do I reverse a list in Python?",
)
NEW_TOKENS = 20
# What the defaults may cost on the verify text (first 256 tokens), against the float32 export:
# measured int8 / int4 (docs/quantization.md), with room for another CPU's kernels. int8
# (MatMul8Bits, its own kernel on every x86 CPU): top-1 0.988, KL 2.9e-4 measured; issue 32's
# goal is top-1 >= 0.98; the earlier default (rtn, int8 activations: top-1 0.965, KL 0.0051)
# fails it.
BOUNDS = {
    "int8": {"ppl_increase": 0.02, "top1_agreement": 0.98, "kl": 0.002},
    "int4": {"ppl_increase": 0.10, "top1_agreement": 0.80, "kl": 0.08},
}


@pytest.fixture(scope="module")
def tokenizer(smollm2_checkpoint):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(smollm2_checkpoint)


def _chat_prompt(tokenizer, message: str) -> list[int]:
    """The token ids of ``message`` in the checkpoint's chat template (ChatML)."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": message}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_the_fp32_export_answers_chat_prompts_as_transformers_does(
    smollm2_checkpoint, smollm2_fp32_artifact, tokenizer
):
    eos = tokenizer.eos_token_id
    prompts = [_chat_prompt(tokenizer, message) for message in CHATS]
    expected = transformers_greedy(
        smollm2_checkpoint, prompts, max_new_tokens=NEW_TOKENS, eos_token_id=eos, pad_token_id=eos
    )
    engine = engine_from_path(smollm2_fp32_artifact)
    params = SamplingParams(max_tokens=NEW_TOKENS, stop_token_ids=(eos,))
    answers = [list(o.token_ids) for o in engine.generate(prompts, params)]
    assert answers == expected, [tokenizer.decode(a) for a in answers]
    assert all(len(a) > 4 for a in answers)  # real answers, not an immediate EOS


def _text_logits(artifact, ids: list[int]) -> torch.Tensor:
    """Every position's logits of ``ids``, one prefill through the native kernels."""
    import onnxruntime as ort

    from attnexport import ort_kernels
    from attnexport.artifact import manifest_cache_spec, read_manifest
    from attnexport.lowering import PagedOrtSession
    from attnexport.runtime.step_driver import PagedDriver

    manifest = read_manifest(artifact)
    options = ort.SessionOptions()
    ort_kernels.register(options)
    session = PagedOrtSession(artifact / "model.onnx", session_options=options)

    def run(inputs, kv_caches):
        feeds = dict(zip(manifest["input_names"], (*inputs, kv_caches), strict=True))
        return next(iter(session.run(feeds).values())), kv_caches

    spec = manifest_cache_spec(manifest)
    driver = PagedDriver(run, spec, num_blocks=len(ids) // spec.block_size + 2)
    driver.add(ids)
    return driver.prefill(all_logits=True)[0]


def test_the_fp32_export_reads_its_weights_as_their_exact_codes(
    smollm2_fp32_artifact, tokenizer, tmp_path
):
    """The checkpoint was de-quantized from GGUF Q4_1 (projections) and Q8_0 (the tied
    embedding): every projection of the float32 export is stored as its codes (~5.6x fewer
    bytes), and the logits are bit for bit those of the same export with the codes decoded
    back into float32 panels (PackedMatMul)."""
    import shutil
    from collections import Counter

    import onnx

    from attnexport.artifact import read_manifest
    from attnexport.artifact.manifest import model_file_digests, write_manifest
    from attnexport.cli.inspect_cmd import inspect_onnx
    from attnexport.lowering.domain_functions import save_rewritten
    from attnexport.lowering.lossless_weights import to_packed_matmul
    from attnexport.model_contract import DOMAIN

    model = onnx.load(str(smollm2_fp32_artifact / "model.onnx"), load_external_data=False)
    ops = Counter(n.op_type for n in model.graph.node if n.domain == DOMAIN)
    assert ops["LosslessMatMul4Bits"] == 90 and ops["LosslessMatMul4BitsSiluAndMul"] == 30
    assert ops["LosslessMatMul8Bits"] == 1  # the tied logits projection
    assert not ops["PackedMatMul"] and not ops["PackedMatMulSiluAndMul"]
    assert read_manifest(smollm2_fp32_artifact)["lossless_weights"] is True
    summary = inspect_onnx(smollm2_fp32_artifact / "model.onnx")
    assert summary["lossless_weights"] == {"4-bit": 120, "8-bit": 1}

    decoded = tmp_path / "decoded"
    shutil.copytree(smollm2_fp32_artifact, decoded)
    model = onnx.load(str(decoded / "model.onnx"))
    assert to_packed_matmul(model) == 121
    save_rewritten(model, decoded / "model.onnx")
    manifest = read_manifest(decoded)
    manifest["file_digests"] = model_file_digests(decoded, manifest["files"])
    write_manifest(decoded, manifest)
    ids = tokenizer(TEXT)["input_ids"][:48]
    coded_logits = _text_logits(smollm2_fp32_artifact, ids)
    assert torch.equal(_text_logits(decoded, ids), coded_logits)


def test_no_lossless_weights_keeps_float32_panels(smollm2_checkpoint, tmp_path):
    from collections import Counter

    import onnx

    from attnexport.artifact import read_manifest
    from attnexport.cli import main
    from attnexport.model_contract import DOMAIN

    out = tmp_path / "panels"
    flags = ["--out", str(out), "--no-lossless-weights"]
    assert main(["export", str(smollm2_checkpoint), *flags]) == 0
    assert read_manifest(out)["lossless_weights"] is False
    model = onnx.load(str(out / "model.onnx"), load_external_data=False)
    ops = Counter(n.op_type for n in model.graph.node if n.domain == DOMAIN)
    assert ops["PackedMatMul"] == 91 and ops["PackedMatMulSiluAndMul"] == 30
    assert not any(op.startswith("Lossless") for op in ops)


@pytest.mark.parametrize("fmt", ["int8", slow_param("int4", HQQ_SECONDS)])
def test_the_default_quantization_keeps_the_model(
    smollm2_fp32_artifact, smollm2_quantized, tokenizer, fmt
):
    ids = tokenizer(TEXT)["input_ids"][:256]
    reference = _text_logits(smollm2_fp32_artifact, ids)
    logits = _text_logits(smollm2_quantized(fmt), ids)
    quality = logit_quality(logits, reference, targets=[*ids[1:], None])
    print(fmt, quality)
    bounds = BOUNDS[fmt]
    assert quality["ppl_increase"] <= bounds["ppl_increase"], quality
    assert quality["top1_agreement"] >= bounds["top1_agreement"], quality
    assert quality["kl"] <= bounds["kl"], quality


def test_verify_passes_the_fp32_export(smollm2_fp32_artifact):
    """`attnexport verify` on the real model's float32 export: its logits reach ~20, where
    float32 rounding alone leaves ~1e-4 between eager and ONNX (the absolute 1e-4 bound of tiny
    random models made verify exit 1 on a correct export); the bound scales with them and every
    leg is within it, transformers' included."""
    from attnexport.cli.verify_cmd import verify_artifact
    from attnexport.tolerances import model_tolerance

    _, comparisons = verify_artifact(smollm2_fp32_artifact)
    failed = [c.to_json() for c in comparisons if not c.ok]
    assert not failed
    logits = [c for c in comparisons if c.output.endswith("logits")]
    assert {c.leg for c in logits} >= {"onnx", "transformers"}
    assert all(c.max_abs / c.max_rel > 5 for c in logits)  # real-model logits, not ~1
    assert all(c.tolerance > model_tolerance(torch.float32) for c in logits)
