"""Text in, text out through the CLI, compared with transformers: Hugging Face checkpoints with a
real WordPiece tokenizer (padding configured in its tokenizer.json) and a byte-level BPE with a
chat template are exported, then ``run --json`` / ``--chat`` / ``--prompts-file`` must give
transformers' prompt ids, greedy tokens and decoded text."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from attnexport.cli.main import main
from tests.cli.helpers import hf_greedy, run_cli, run_json
from tests.models.hf_reference import tiny_llama
from tests.text_tokenizers import BUILDERS

MARKUP = "[/x]"  # an added token: rich would read it as a closing tag


def _checkpoint(path, tokenizer_name: str, save_with_transformers: bool):
    """A tiny Llama over the tokenizer's vocabulary, exported to ``path / 'export'``."""
    checkpoint = path / "checkpoint"
    BUILDERS[tokenizer_name](checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    if save_with_transformers:  # as a user's checkpoint would be: chat_template.jinja etc.
        tokenizer.add_tokens([MARKUP])
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (checkpoint / name).unlink()
        tokenizer.save_pretrained(str(checkpoint))
    model = tiny_llama(
        checkpoint,
        vocab_size=len(tokenizer),
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    out = path / "export"
    assert main(["export", str(checkpoint), "--out", str(out)]) == 0
    return out, model, AutoTokenizer.from_pretrained(str(checkpoint))


@pytest.fixture(scope="module")
def wordpiece(tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp("wordpiece"), "wordpiece", False)


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp("bpe"), "byte_level_bpe", True)


def _expected(model, hf, prompt_ids, max_tokens):
    tokens = hf_greedy(model, prompt_ids, max_tokens)
    eos = hf.eos_token_id
    if eos in tokens:
        tokens = tokens[: tokens.index(eos) + 1]
    return tokens, hf.decode(tokens, skip_special_tokens=True)


def test_wordpiece_prompt_is_encoded_as_transformers(wordpiece, capsys):
    """all-MiniLM's tokenizer.json pads to 128: the 5 words were 128 tokens; transformers: 7."""
    out, model, hf = wordpiece
    prompt = "The capital of France is"
    prompt_ids = hf(prompt)["input_ids"]
    assert len(prompt_ids) == 7
    (output,) = run_json(capsys, out, "--prompt", prompt, "--max-tokens", 8)
    tokens, text = _expected(model, hf, prompt_ids, 8)
    assert output["token_ids"] == tokens
    assert output["prompt_token_ids"] == prompt_ids
    assert output["text"] == text


def test_byte_level_prompt_and_text_equal_transformers(bpe, capsys):
    out, model, hf = bpe
    prompts = ["The capital of France is", "😀 naïve café [/INST]"]
    outputs = run_json(capsys, out, "--prompt", prompts[0], "--prompt", prompts[1])
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output["prompt_token_ids"] == hf(prompt)["input_ids"]
        assert (output["token_ids"], output["text"]) == _expected(
            model, hf, output["prompt_token_ids"], 16
        )


def test_chat_applies_the_template(bpe, capsys):
    out, model, hf = bpe
    # transformers 5 saves the template beside tokenizer_config.json; the export copies it
    assert (
        "chat_template.jinja" in json.loads((out / "manifest.json").read_text())["tokenizer_files"]
    )
    outputs = run_json(capsys, out, "--chat", "Hi!", "--chat", "Paris?", "--system", "Be brief")
    for message, output in zip(["Hi!", "Paris?"], outputs, strict=True):
        messages = [
            {"role": "system", "content": "Be brief"},
            {"role": "user", "content": message},
        ]
        expected = hf.apply_chat_template(messages, add_generation_prompt=True)
        expected = expected["input_ids"] if hasattr(expected, "keys") else expected
        assert output["prompt_token_ids"] == list(expected)
        assert (output["token_ids"], output["text"]) == _expected(model, hf, expected, 16)


def test_chat_without_a_template_is_a_named_error(wordpiece, capsys):
    out, _, _ = wordpiece
    assert main(["run", str(out), "--chat", "hi"]) == 2
    err = capsys.readouterr().err
    assert "--chat 0" in err and "no chat template" in err


def test_prompts_file(bpe, tmp_path, capsys):
    out, model, hf = bpe
    lines = [
        {"prompt": "The capital of France is", "max_tokens": 4},
        {"messages": [{"role": "user", "content": "Hi"}], "n": 2, "temperature": 0.8, "seed": 1},
    ]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    first, second = run_json(capsys, out, "--prompts-file", path)
    assert first["prompt_token_ids"] == hf(lines[0]["prompt"])["input_ids"]
    assert (first["token_ids"], first["text"]) == _expected(model, hf, first["prompt_token_ids"], 4)
    assert "samples" not in first
    assert [s["index"] for s in second["samples"]] == [0, 1]
    for sample in second["samples"]:
        assert sample["text"] == hf.decode(sample["token_ids"], skip_special_tokens=True)
    assert second["samples"][0]["token_ids"] == second["token_ids"]


@pytest.mark.parametrize(
    "line,message",
    [
        ("{not json", "not valid JSON"),
        ('["prompt"]', "expected a JSON object"),
        ('{"prompt": "a", "messages": []}', "exactly one of"),
        ('{"prompt": "a", "temprature": 1}', "unknown field(s) ['temprature']"),
        ('{"prompt": "a", "max_tokens": 0}', "max_tokens"),
        ('{"messages": [{"role": "user"}]}', "messages[0]"),
        ('{"prompt": 5}', "'prompt' must be a string"),
    ],
)
def test_a_bad_prompts_file_line_is_a_named_error(bpe, tmp_path, capsys, line, message):
    out, _, _ = bpe
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    assert main(["run", str(out), "--prompts-file", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"{path}, line 2" in err and message in err


def test_model_text_is_never_read_as_markup(bpe, capsys):
    """A model that generates ``[/x]`` crashed the human output (rich markup)."""
    out, _, hf = bpe
    markup_id = hf.convert_tokens_to_ids(MARKUP)
    for prompts in (["--prompt", "Hi"], ["--prompt", "Hi", "--prompt-ids", "5,6"]):
        capsys.readouterr()
        argv = ["run", str(out), *prompts, "--forced-bos-token-id", str(markup_id)]
        assert main([*argv, "--max-tokens", "3"]) == 0
        printed = capsys.readouterr().out
        assert MARKUP in printed and "finish: length" in printed


def test_single_prompt_streams_its_text(bpe, capsys):
    out, _, _ = bpe
    prompt = "The capital of France is"
    (output,) = run_json(capsys, out, "--prompt", prompt)
    assert main(["run", str(out), "--prompt", prompt]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(output["text"] + "\n")  # the streamed text, then the summary
    assert f"prompt 0 ({len(output['prompt_token_ids'])} tokens)" in printed


def test_verify_runs_the_verify_text_through_an_export_with_a_tokenizer(bpe, capsys):
    from attnexport.artifact import read_manifest
    from attnexport.cli.verify_cmd import TEXT_DECODE_STEPS, TEXT_PROMPTS, _batch

    export, _, _ = bpe
    prompts, decode_tokens = _batch(read_manifest(export), 0, export)
    assert [len(p) for p in prompts] == [n for _, n in TEXT_PROMPTS]
    assert len(decode_tokens) == TEXT_DECODE_STEPS
    code, out, err = run_cli(capsys, "verify", str(export), "--json")
    assert code == 0, err
    assert json.loads(out)["ok"]
