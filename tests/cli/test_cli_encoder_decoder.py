"""An encoder-decoder checkpoint end to end: export a transformers BART, ``attnexport run`` it
on both executors, and get the tokens of transformers' greedy ``generate`` (decoder start token
excluded, forced BOS/EOS and the EOS stop taken from the checkpoint's generation config)."""

from __future__ import annotations

import json

import pytest
import torch

from attnexport.cli.main import main
from tests.models.hf_reference import tiny_bart

FORCED_BOS = 7
PROMPTS = ([0, 8, 15, 22, 9, 2], [0, *range(30, 51), 2], [5, 1, 1, 9], [3])


@pytest.fixture(scope="module")
def bart(tmp_path_factory):
    """A 2+2-layer BART (d_model 32) saved with ``save_pretrained`` (its generation config
    forcing a first token) and exported (both formats, blocks of 4 tokens)."""
    path = tmp_path_factory.mktemp("hf_bart")
    model = tiny_bart(path, decoder_start_token_id=2, eos_token_id=2, forced_eos_token_id=2)
    model.generation_config.forced_bos_token_id = FORCED_BOS
    model.save_pretrained(path)
    out = tmp_path_factory.mktemp("bart_export")
    argv = ["export", str(path), "--out", str(out), "--format", "both", "--block-size", "4"]
    assert main(argv) == 0
    return model, out


def _generate(model, prompt, max_new_tokens, **overrides):
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            num_beams=1,
            **overrides,
        )
    return out[0, 1:].tolist()  # without the decoder start token


def _run(out, capsys, *flags: str) -> list[dict]:
    capsys.readouterr()
    argv = ["run", str(out), "--json", *flags]
    for prompt in PROMPTS:
        argv += ["--prompt-ids", ",".join(map(str, prompt))]
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)["outputs"]


def test_manifest_records_the_generation_defaults(bart):
    _, out = bart
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["kind"] == "encoder-decoder"
    assert manifest["generation"] == {
        "eos_token_ids": [2],
        "decoder_start_token_id": 2,
        "forced_bos_token_id": FORCED_BOS,
        "forced_eos_token_id": 2,
    }


@pytest.mark.parametrize("executor", ["ort", "torch"])
def test_run_matches_transformers_generate(bart, capsys, executor):
    model, out = bart
    outputs = _run(out, capsys, "--executor", executor, "--max-tokens", "16")
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        expected = _generate(model, prompt, 16)
        assert expected[0] == FORCED_BOS
        assert output["token_ids"] == expected
        assert output["finish_reason"] == ("stop" if expected[-1] == 2 else "length")


def test_flags_override_the_checkpoint_defaults(bart, capsys):
    model, out = bart
    flags = ["--forced-bos-token-id", "none", "--forced-eos-token-id", "none"]
    flags += ["--stop-token-ids", "", "--decoder-start-token-id", "0", "--max-tokens", "6"]
    outputs = _run(out, capsys, *flags)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        expected = _generate(
            model,
            prompt,
            6,
            forced_bos_token_id=None,
            forced_eos_token_id=None,
            eos_token_id=None,
            decoder_start_token_id=0,
        )
        assert output["token_ids"] == expected
        assert output["finish_reason"] == "length"
