"""Chat templates in attnexport's bounded sandbox: the same text as transformers renders (on
the real SmolLM2 template, the test tokenizers' and one that uses every feature templates in
the wild use), while templates that loop, recurse or allocate without end stop at the CPU-time
or size limit before they hurt the process, and the sandbox still blocks Python."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from attnexport.runtime.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    TemplateLimitError,
    TemplateLimits,
)
from attnexport.runtime.text import Tokenizer
from tests.text_tokenizers import BUILDERS

ROOT = Path(__file__).resolve().parents[2]

# Every feature of Jinja that Hub templates use: macros, namespaces, slicing, loop variables
# (length materializes the loop), loop controls, filters, %-format and str.format, tojson,
# captured blocks, raise_exception, strftime_now, dict, transformers' {% generation %}.
KITCHEN_SINK = """\
{%- macro render(m) -%}{{ m['role']|upper }}: {{ m['content']|trim }}{%- endmacro -%}
{%- set ns = namespace(system='', count=0, parts=[]) -%}
{%- if messages[0]['role'] == 'system' -%}
  {%- set ns.system = messages[0]['content'] -%}{%- set rest = messages[1:] -%}
{%- else -%}{%- set rest = messages -%}{%- endif -%}
{{- bos_token ~ '[SYS]' ~ (ns.system or 'default')|replace('\\n', ' ') ~ '[/SYS]\\n' -}}
{%- for message in rest -%}
  {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
    {{- raise_exception('roles must alternate user/assistant') -}}
  {%- endif -%}
  {%- set ns.count = ns.count + 1 -%}
  {%- set ns.parts = ns.parts + [message['content'][:8]] -%}
  {%- if message['content'].startswith('skip') -%}{%- continue -%}{%- endif -%}
  {{- '<|%s|>' % message['role'] }}{{ render(message) }}{{ '(%d/%d)' % (loop.index, loop.length) }}
  {%- if loop.last %}{{ eos_token if message['role'] == 'assistant' else '' }}{% endif %}
  {{- '\\n' -}}
{%- endfor -%}
{{- '{}|{}'.format(ns.count, ns.parts|join(',')) -}}
{{- {'n': ns.count, 'roles': rest|map(attribute='role')|list}|tojson -}}
{%- set digits %}{% for i in range(3) %}{{ i }}{% endfor %}{% endset -%}
{{ digits|center(9) }}{{ 'x\\ny'|indent(2, true) }}{{ strftime_now('') }}
{{ dict(b=2, a=1)|dictsort }}
{{ 'a b c'.split()|sort|reverse|join('-') }}{{ ('abc' * 2)[1:-1] }}{{ 7 // 2 }}{{ 2 ** 5 }}
{{ 'wrap me please'|wordwrap(5) }}{{ [1, 2, 3, 4, 5]|batch(2)|list }}{{ [1, 2, 3]|sum }}
{%- generation %}gen{% endgeneration -%}
{%- if add_generation_prompt -%}{{ '<|assistant|>' }}{%- endif -%}
"""
CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "Be brief.\nVery."},
        {"role": "user", "content": "  The capital of France? <s> </s> 😀 naïve "},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "skip this one"},
    ],
    [{"role": "user", "content": ""}, {"role": "assistant", "content": "東京"}],
]


def _transformers_text(hf, template: str | None, messages: list[dict]) -> str:
    return hf.apply_chat_template(
        messages, chat_template=template, add_generation_prompt=True, tokenize=False
    )


def _our_text(hf, template: str, messages: list[dict]) -> str:
    return ChatTemplate(template).render(
        TemplateLimits(),
        messages=messages,
        tools=None,
        documents=None,
        add_generation_prompt=True,
        **hf.special_tokens_map,
    )


@pytest.fixture(scope="module")
def bpe_hf(tmp_path_factory):
    return AutoTokenizer.from_pretrained(
        str(BUILDERS["byte_level_bpe"](tmp_path_factory.mktemp("t")))
    )


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_a_template_using_every_feature_renders_as_transformers(bpe_hf, index):
    messages = CONVERSATIONS[index]
    expected = _transformers_text(bpe_hf, KITCHEN_SINK, messages)
    assert _our_text(bpe_hf, KITCHEN_SINK, messages) == expected
    assert "gen" in expected and "<|assistant|>" in expected  # the template really ran


def test_the_template_s_own_exception_is_a_chat_template_error(bpe_hf):
    messages = [{"role": "assistant", "content": "first"}]
    with pytest.raises(Exception, match="roles must alternate"):
        _transformers_text(bpe_hf, KITCHEN_SINK, messages)
    with pytest.raises(ChatTemplateError, match="roles must alternate") as error:
        _our_text(bpe_hf, KITCHEN_SINK, messages)
    assert not isinstance(error.value, TemplateLimitError)


def test_the_real_smollm2_template_gives_transformers_ids(smollm2_checkpoint):
    ours = Tokenizer.from_directory(smollm2_checkpoint)
    hf = AutoTokenizer.from_pretrained(str(smollm2_checkpoint))
    assert "im_start" in ours.hf.get_chat_template()
    for messages in CONVERSATIONS:
        expected = hf.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        assert ours.apply_chat_template(messages) == list(expected)


def test_a_template_that_does_not_compile_is_a_named_error():
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for m in messages %}{{ m }}")
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{{ messages|no_such_filter }}")


def test_compiling_evaluates_nothing():
    """Jinja folds constant expressions while compiling: here that would allocate 10 GB."""
    ChatTemplate("{{ 'x' * 10000000000 }}{{ 'x'|center(10000000000) }}{{ 2 ** 10 ** 10 }}")


# Each must stop at a limit (TemplateLimitError) without the allocation or the hours of CPU it
# asks for; the subprocess runs under a 2 GiB address-space limit, so one that got through
# would fail with "ran out of memory" instead of a limit.
ATTACKS = {
    "nested loops": "{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}"
    "{% endfor %}",
    "literal text in loops": "{% for i in range(99999) %}{% for j in range(99999) %}xy{% endfor %}"
    "{% endfor %}",
    "a folded constant": "{{ 'x' * 10000000000 }}",
    "str * int": "{% set n = 10 ** 10 %}{{ 'x' * n }}",
    "the center filter": "{{ 'x'|center(10000000000) }}",
    "str.ljust": "{{ 'x'.ljust(10 ** 10) }}",
    "str.zfill": "{{ '1'.zfill(10 ** 10) }}",
    "doubling with ~": "{% set ns = namespace(s='x') %}{% for i in range(64) %}"
    "{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "doubling with +": "{% set ns = namespace(s='x') %}{% for i in range(64) %}"
    "{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "doubling a list": "{% set ns = namespace(s=[1]) %}{% for i in range(64) %}"
    "{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "the replace filter": "{{ ('x' * 100000)|replace('x', 'y' * 100000) }}",
    "str.replace": "{{ ('x' * 100000).replace('x', 'y' * 100000) }}",
    "the join filter": "{{ range(10000)|join('y' * 100000) }}",
    "str.join": "{{ ('y' * 100000).join(['a'] * 10000) }}",
    "%-format widths": "{{ '%*d' % (10000000000, 1) }}",
    "%-format literal width": "{{ '%10000000000d' % 1 }}",
    "str.format width": "{{ '{:>10000000000}'.format(1) }}",
    "the format filter": "{{ '%.10000000000f'|format(1.5) }}",
    "squaring an int": "{% set ns = namespace(x=3) %}{% for i in range(40) %}"
    "{% set ns.x = ns.x * ns.x %}{% endfor %}",
    "int power": "{{ 2 ** 10000000000 }}",
    "a captured block": "{% set big = 'x' * 1000000 %}{% set out %}{% for i in range(99999) %}"
    "{{ big }}{% endfor %}{% endset %}",
    "slices": "{% set big = 'x' * 1000000 %}{% set ns = namespace(l=[]) %}"
    "{% for i in range(99999) %}{% set ns.l = ns.l + [big[i:]] %}{% endfor %}",
    "recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "lipsum": "{{ lipsum(1000000000) }}",
    "sum of lists": "{{ ([[1] * 100] * 20000)|sum(start=[]) }}",
    "the indent filter": "{{ ('a\\n' * 100000)|indent(100000) }}",
    "the wordwrap filter": "{{ ('a ' * 100000)|wordwrap(1, wrapstring='x' * 100000) }}",
    "the batch filter": "{{ [1]|batch(10000000000, 0)|list }}",
    "tojson indent": "{{ (range(20000)|list)|tojson(indent=100000) }}",
    "str.translate": "{{ ('x' * 100000).translate({120: 'y' * 100000}) }}",
    "str.expandtabs": "{{ ('\\t' * 100000).expandtabs(100000) }}",
    "strftime_now width": "{{ strftime_now('%10000000000Y') }}",
}
ESCAPES = {
    "a dunder attribute": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "a global's globals": "{{ cycler.__init__.__globals__.os }}",
    "a namespace dunder": "{% set ns = namespace() %}{% set ns.__class__ = 1 %}",
    "a mutating method": "{% set l = [] %}{{ l.append(1) }}",
}
_RUN = """
import json, resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
from attnexport.runtime.chat_template import ChatTemplate, TemplateLimits, TemplateLimitError
results = {}
for name, source in json.loads(sys.argv[1]).items():
    start = time.thread_time()
    try:
        text = ChatTemplate(source).render(TemplateLimits(0.3, 4 << 20), messages=[])
        results[name] = ["rendered", text[:200]]
    except TemplateLimitError as error:
        results[name] = ["limit", str(error)]
    except Exception as error:
        results[name] = [type(error).__name__, str(error)]
    results[name].append(time.thread_time() - start)
# VmHWM is this process's own peak: ru_maxrss keeps the forking parent's peak across exec.
with open("/proc/self/status") as status:
    results["maxrss"] = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def outcomes():
    """Every attack and escape rendered once, in a subprocess with a memory limit."""
    done = subprocess.run(
        [sys.executable, "-c", _RUN, json.dumps({**ATTACKS, **ESCAPES})],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_a_template_that_works_without_end_stops_at_a_limit(outcomes, name):
    kind, message, cpu_seconds = outcomes[name]
    assert kind == "limit", (kind, message)
    assert "memory" not in message, message  # a limit, not the 2 GiB address-space guard
    assert cpu_seconds < 3, cpu_seconds  # 0.3 s of budget, checked every 64 operations


def test_the_attacks_never_grew_the_process(outcomes):
    assert outcomes["maxrss"] < 1 << 20, outcomes["maxrss"]  # KiB: under 1 GiB


@pytest.mark.parametrize("name", sorted(ESCAPES))
def test_the_sandbox_still_blocks_python(outcomes, name):
    kind, message, _ = outcomes[name]
    assert kind == "ChatTemplateError", (kind, message)
    assert "unsafe" in message or "not safely callable" in message or "underscore" in message
