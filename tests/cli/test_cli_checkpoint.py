"""The user journey on a Hugging Face checkpoint: export it, run it with the CLI, and get the
tokens transformers' greedy ``generate`` gives (stopping at the checkpoint's EOS)."""

from __future__ import annotations

import json

import pytest

from attnexport.cli.main import main
from tests.cli.helpers import hf_greedy
from tests.models.hf_reference import tiny_llama

PROMPT = [3, 14, 15, 92, 65]
# two layers of four query heads over two KV heads (tiny_llama's default is one layer)
TWO_LAYERS = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2)
GQA_HEADS = dict(num_attention_heads=4, num_key_value_heads=2)


def _word_level_tokenizer(path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(vocab_size)} | {"[UNK]": vocab_size - 1}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path / "tokenizer.json"))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_llama")
    model = tiny_llama(
        path,
        vocab_size=300,
        max_position_embeddings=256,
        **TWO_LAYERS,
        **GQA_HEADS,
        rope_theta=5000.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=7,
    )
    _word_level_tokenizer(path, model.config.vocab_size)
    return path, model


def test_export_then_run_matches_transformers(checkpoint, tmp_path, capsys):
    path, model = checkpoint
    out = tmp_path / "export"
    assert main(["export", str(path), "--out", str(out)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["generation"]["eos_token_ids"] == [7]
    assert manifest["tokenizer_files"] == ["tokenizer.json"]
    capsys.readouterr()

    prompts = [PROMPT, [1, 2], [250, 4, 4, 9, 11, 13, 200]]
    argv = ["run", str(out), "--max-tokens", "16", "--json"]
    for prompt in prompts:
        argv += ["--prompt-ids", ",".join(map(str, prompt))]
    assert main(argv) == 0
    outputs = json.loads(capsys.readouterr().out)["outputs"]
    for prompt, output in zip(prompts, outputs, strict=True):
        expected = hf_greedy(model, prompt, 16)
        assert output["token_ids"] == expected
        assert output["finish_reason"] == ("stop" if expected[-1] == 7 else "length")


def test_text_prompt_uses_the_exported_tokenizer(checkpoint, tmp_path, capsys):
    path, model = checkpoint
    out = tmp_path / "export"
    assert main(["export", str(path), "--out", str(out), "--format", "pt2"]) == 0
    capsys.readouterr()
    assert (
        main(["run", str(out), "--prompt", "w3 w14 w15 w92 w65", "--max-tokens", "6", "--json"])
        == 0
    )
    output = json.loads(capsys.readouterr().out)["outputs"][0]
    assert output["token_ids"] == hf_greedy(model, PROMPT, 6)


def test_gemma3_checkpoint_export_then_run_matches_transformers(tmp_path, capsys):
    """The journey on a Gemma 3 text checkpoint (q/k norms, local and global RoPE, a 4-token
    window on the local layers, final soft-capping): ``run --json`` gives transformers' greedy
    tokens on prompts longer than the window."""
    import transformers

    from tests.models.hf_reference import NO_SPECIAL_TOKENS, build_checkpoint

    config = transformers.Gemma3TextConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16,
        sliding_window=4, layer_types=["sliding_attention", "full_attention"],
        final_logit_softcapping=4.0, tie_word_embeddings=False, initializer_range=0.2,
        **NO_SPECIAL_TOKENS,
    )  # fmt: skip
    model = build_checkpoint("Gemma3ForCausalLM", config, tmp_path / "ckpt")
    out = tmp_path / "export"
    assert main(["export", str(tmp_path / "ckpt"), "--out", str(out)]) == 0
    capsys.readouterr()
    prompts = [PROMPT, [1, 2, 3, 4, 5, 6, 7, 8, 9]]
    argv = ["run", str(out), "--max-tokens", "12", "--json", "--stop-token-ids", ""]
    for prompt in prompts:
        argv += ["--prompt-ids", ",".join(map(str, prompt))]
    assert main(argv) == 0
    outputs = json.loads(capsys.readouterr().out)["outputs"]
    assert [o["token_ids"] for o in outputs] == [hf_greedy(model, p, 12) for p in prompts]
