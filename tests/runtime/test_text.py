"""attnexport.runtime.text against transformers.AutoTokenizer on real WordPiece, byte-level BPE
and SentencePiece-style tokenizers: encoding, decoding, chat templates, incremental
detokenization."""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from attnexport.contained_files import UnsafePathError
from attnexport.runtime import chat_template as chat_template_module
from attnexport.runtime import text as text_module
from attnexport.runtime.text import REPLACEMENT_CHARACTER, Tokenizer, TokenizerError
from tests.text_tokenizers import BUILDERS, CORPUS, byte_level_bpe

PROMPTS = [
    "The capital of France is",
    "",
    "  leading and trailing spaces  ",
    "😀🦙 naïve 東京 [/INST] <s> </s> [CLS]",
    "I do not know . isn't it ? They 're here , aren ' t they !",
    "x" * 600,  # longer than every model_max_length: never truncated
    *CORPUS[:3],
]


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def pair(request, tmp_path_factory):
    """(our Tokenizer, transformers' AutoTokenizer) over the same directory."""
    directory = BUILDERS[request.param](tmp_path_factory.mktemp(request.param))
    return Tokenizer.from_directory(directory), AutoTokenizer.from_pretrained(str(directory))


@pytest.mark.parametrize("prompt", PROMPTS)
def test_encode_and_decode_equal_transformers(pair, prompt):
    ours, hf = pair
    ids = ours.encode(prompt)
    assert ids == hf(prompt)["input_ids"] == hf.encode(prompt)
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)


def test_wordpiece_prompt_is_not_padded(tmp_path):
    """all-MiniLM's tokenizer.json pads to 128 tokens; transformers gives 7 for these 5 words."""
    tokenizer = Tokenizer.from_directory(BUILDERS["wordpiece"](tmp_path))
    assert tokenizer.encode("The capital of France is") == [101, 1996, 3007, 1997, 2605, 2003, 102]
    assert len(tokenizer.encode("word " * 300)) == 302  # nor truncated to 128 or 512


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_random_text_and_ids_equal_transformers(pair, data):
    ours, hf = pair
    prompt = data.draw(st.text(max_size=40))
    assert ours.encode(prompt) == hf(prompt)["input_ids"]
    ids = data.draw(st.lists(st.integers(0, len(hf) - 1), max_size=30))
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)


def _stream(tokenizer: Tokenizer, ids: list[int], chunks: list[int]) -> list[str]:
    """Deltas of pushing ``ids`` in chunks of the given sizes (then the rest one by one)."""
    detok = tokenizer.detokenizer()
    deltas, position = [], 0
    for size in chunks:
        deltas.append(detok.push(ids[position : position + size]))
        position += size
        # what was emitted is final: it is a prefix of the text of every longer sequence
        assert tokenizer.decode(ids).startswith("".join(deltas))
    for token in ids[position:]:
        deltas.append(detok.push([token]))
    deltas.append(detok.finish())
    return deltas


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_stream_of_random_ids_concatenates_to_the_full_decode(pair, data):
    ours, hf = pair
    ids = data.draw(st.lists(st.integers(0, len(hf) - 1), max_size=24))
    chunks = data.draw(st.lists(st.integers(0, 4), max_size=6))
    assert "".join(_stream(ours, ids, chunks)) == hf.decode(ids, skip_special_tokens=True)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(prompt=st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=30))
def test_stream_of_real_text_never_emits_a_broken_character(pair, prompt):
    """Token by token: a character split over byte tokens appears only once complete."""
    ours, hf = pair
    ids = hf(prompt, add_special_tokens=False)["input_ids"]
    full = hf.decode(ids, skip_special_tokens=True)
    deltas = _stream(ours, ids, [])
    assert "".join(deltas) == full
    if REPLACEMENT_CHARACTER not in full:
        assert not any(REPLACEMENT_CHARACTER in delta for delta in deltas)


@pytest.mark.parametrize("name", ["byte_level_bpe", "sentencepiece"])
def test_emoji_split_over_byte_tokens_streams_whole(tmp_path, name):
    tokenizer = Tokenizer.from_directory(BUILDERS[name](tmp_path))
    ids = tokenizer.hf("a 🦙😀 b", add_special_tokens=False)["input_ids"]
    assert len(ids) > 4  # the emoji really are split over several byte tokens
    detok = tokenizer.detokenizer()
    deltas = [detok.push([token]) for token in ids] + [detok.finish()]
    assert "".join(deltas) == "a 🦙😀 b"
    assert "🦙" in "".join(deltas[:-1])  # streamed before the end, and whole
    assert not any(REPLACEMENT_CHARACTER in delta for delta in deltas)


def test_chat_template_equals_transformers(tmp_path):
    directory = byte_level_bpe(tmp_path)
    ours, hf = Tokenizer.from_directory(directory), AutoTokenizer.from_pretrained(str(directory))
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "The capital of France is?"},
    ]
    expected = hf.apply_chat_template(messages, add_generation_prompt=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert ours.apply_chat_template(messages) == list(expected)
    with pytest.raises(TokenizerError, match=r"messages\[0\]"):
        ours.apply_chat_template([{"role": "user"}])


def test_no_chat_template_is_a_named_error(tmp_path):
    tokenizer = Tokenizer.from_directory(byte_level_bpe(tmp_path, chat_template=False))
    with pytest.raises(TokenizerError, match="no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_a_directory_without_a_tokenizer_is_a_named_error(tmp_path):
    with pytest.raises(TokenizerError, match=str(tmp_path)):
        Tokenizer.from_directory(tmp_path)


@pytest.mark.parametrize("module", [text_module, chat_template_module])
def test_module_imports_neither_torch_nor_the_rest_of_attnexport(module):
    """A torch-free deployment (numpy, onnxruntime, the tokenizer library) can import it."""
    tree = ast.parse(Path(module.__file__).read_text())
    imported = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    } | {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    # attnexport.errors is a leaf module without imports (the errors every layer raises);
    # attnexport.contained_files (the check of what a loader may read) imports only it; the
    # text module renders with the chat template's sandbox.
    allowed = {
        "attnexport.errors",
        "attnexport.contained_files",
        "attnexport.runtime.chat_template",
    }
    assert not {
        m for m in imported if m and m.split(".")[0] in ("torch", "attnexport") and m not in allowed
    }


def test_without_transformers_the_error_names_the_extra(tmp_path, monkeypatch):
    directory = byte_level_bpe(tmp_path)
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if it were not installed
    with pytest.raises(ModuleNotFoundError, match=r'pip install "attnexport\[hf\]"'):
        Tokenizer.from_directory(directory)


# ----------------------------------------------------------------------------- contained files

SECRET = "root:x:0:0:SECRET-LINE"


@pytest.mark.parametrize(
    "name",
    [
        "chat_template.jinja",
        "additional_chat_templates/tool_use.jinja",
        "tokenizer.json",
        "tokenizer_config.json",
    ],
)
def test_a_linked_tokenizer_file_is_refused_not_read(name, tmp_path):
    """A link in the directory could make transformers read any file of the machine: a
    chat_template.jinja linked to /etc/passwd is rendered into every chat prompt. Each link
    here leads to a file transformers would load without complaint."""
    directory = byte_level_bpe(tmp_path / "tokenizer", chat_template=False)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    source = directory / name
    if source.is_file():
        source.rename(elsewhere / source.name)
    else:
        (elsewhere / source.name).write_text(SECRET)
    source.parent.mkdir(exist_ok=True)
    source.symlink_to(elsewhere / source.name)
    with pytest.raises(UnsafePathError, match=rf"{re.escape(str(source))}: a symbolic link"):
        Tokenizer.from_directory(directory)


def test_a_linked_chat_templates_directory_is_refused(tmp_path):
    directory = byte_level_bpe(tmp_path / "tokenizer", chat_template=False)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "default.jinja").write_text(SECRET)
    (directory / "additional_chat_templates").symlink_to(elsewhere)
    with pytest.raises(UnsafePathError, match="additional_chat_templates: a symbolic link"):
        Tokenizer.from_directory(directory)


def _outside_tokenizer(tmp_path, directory, name: str) -> Path:
    """A copy of ``directory``'s tokenizer.json outside it, with one more token."""
    data = json.loads((directory / "tokenizer.json").read_text())
    data["added_tokens"].append(
        {"id": 400, "content": "SECRET_TOKEN", "special": True, "single_word": False,
         "lstrip": False, "rstrip": False, "normalized": False}
    )  # fmt: skip
    outside = tmp_path / "elsewhere" / name
    outside.parent.mkdir()
    outside.write_text(json.dumps(data))
    return outside


def test_fast_tokenizer_files_may_not_name_a_file_outside(tmp_path):
    """transformers joins these names to the directory: ``../`` read another tokenizer."""
    directory = byte_level_bpe(tmp_path / "tokenizer")
    outside = _outside_tokenizer(tmp_path, directory, "tokenizer.4.0.json")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["fast_tokenizer_files"] = [f"../{outside.parent.name}/{outside.name}"]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(UnsafePathError, match="fast_tokenizer_files"):
        Tokenizer.from_directory(directory)


def test_file_arguments_of_the_config_are_the_directory_own(tmp_path):
    """Older transformers open a ``tokenizer_file`` / ``vocab_file`` path the config holds
    (old configs hold stale absolute paths): the directory's file of that name is taken."""
    directory = byte_level_bpe(tmp_path / "tokenizer")
    outside = _outside_tokenizer(tmp_path, directory, "tokenizer.json")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config.update(tokenizer_file=str(outside), vocab_file=str(tmp_path / "elsewhere" / "v.txt"))
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = Tokenizer.from_directory(directory)
    assert "SECRET_TOKEN" not in tokenizer.hf.get_vocab() and len(tokenizer.hf) == 400
    assert (
        tokenizer.encode("Paris")
        == AutoTokenizer.from_pretrained(str(directory))("Paris")["input_ids"]
    )


def test_a_tokenizer_config_nested_too_deep_is_a_named_error(tmp_path):
    directory = byte_level_bpe(tmp_path / "tokenizer")
    (directory / "tokenizer_config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json: not valid JSON"):
        Tokenizer.from_directory(directory)
