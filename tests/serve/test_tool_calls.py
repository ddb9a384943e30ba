"""Tool calls as the chat templates define them: the format a template asks for, the calls
parsed out of an answer (hermes and llama3_json), what a stream holds back, and the grammar
of a forced call compiles (the server tests check what it admits)."""

from __future__ import annotations

import json

import pytest

from attnexport.serve.tool_calls import (
    CallStream,
    call_grammar,
    detect_format,
    parse_calls,
)

HERMES = "{% for tool in tools %}{{ tool | tojson }}{% endfor %}<tool_call>"
LLAMA3 = '{{- "<|python_tag|>" }}{"name": function name, "parameters": ...} {{ tools }}'


def test_the_template_names_the_format():
    assert detect_format(HERMES) == "hermes"
    assert detect_format(LLAMA3) == "llama3_json"
    assert detect_format("{{ messages }}") == detect_format(None) == "hermes"


def test_hermes_calls_parse_after_text_and_a_cut_last_call_is_dropped():
    text = (
        'Let me check. <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
        '<tool_call>{"name": "g", "arguments": "{\\"b\\": [2]}"}</tool_call>'
        '<tool_call>{"name": "h", "argum'
    )
    content, calls = parse_calls(text, "hermes")
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("f", {"a": 1}),
        ("g", {"b": [2]}),
    ]
    assert len({c.id for c in calls}) == 2
    assert parse_calls("no calls here", "hermes") == ("no calls here", [])
    assert parse_calls("<tool_call>not json</tool_call>", "hermes")[1] == []


def test_llama3_calls_parse_with_or_without_the_python_tag():
    text = '<|python_tag|>{"name": "f", "parameters": {"x": "y"}}; {"name": "g", "parameters": {}}'
    content, calls = parse_calls(text, "llama3_json")
    assert content is None and [c.name for c in calls] == ["f", "g"]
    assert json.loads(calls[0].arguments) == {"x": "y"}
    assert parse_calls("Paris is sunny.", "llama3_json") == ("Paris is sunny.", [])


def test_a_stream_passes_text_until_a_call_may_begin():
    stream = CallStream("hermes", forced=False)
    sent = [stream.push(d) for d in ["Sure", ", <tool", "_call>", '{"name": "f", "arguments": {}}']]
    assert sent == ["Sure", ", ", "", ""]
    assert stream.finish()[0] == "" and stream.finish()[1][0].name == "f"
    plain = CallStream("hermes", forced=False)
    assert [plain.push(d) for d in ["a <", "b> c"]] == ["a ", "<b> c"]
    assert plain.finish() == ("", [])
    forced = CallStream("llama3_json", forced=True)
    assert forced.push('{"name": "f", "parameters": {}}') == ""
    assert forced.finish()[1][0].name == "f"


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json"])
def test_the_forced_grammar_admits_only_the_tools_calls(fmt):
    llguidance = pytest.importorskip("llguidance")
    functions = [
        {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}},
        {"name": "g"},
    ]
    grammar = call_grammar(functions, fmt, parallel=True)
    assert grammar.kind == "lark"
    lark = llguidance.LLMatcher.grammar_from_lark(grammar.value)
    assert llguidance.LLMatcher.validate_grammar(lark) == ""
