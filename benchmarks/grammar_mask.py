"""Per-token cost of constrained decoding on CPU: xgrammar against llguidance, with the real
SmolLM2-135M-Instruct tokenizer (49152 tokens, ``benchmarks/smollm2.py``).

For each JSON schema below (and free JSON, ``response_format: json_object``) a document valid
against it is tokenized; the grammar is compiled once, then for every token of the document the
library fills the next-token bitmask (timed), the mask is applied to a float32 logits row (timed)
and the token is accepted (timed). Reported per library and schema: the compile time (cold:
the tokenizer's one-off preparation apart), and per token the median and p99 of the mask, of
the mask's application and of the accept, in microseconds. A mask that forbids the document's
own next token is an error (the two libraries must agree with the document).

Which library the server uses was picked by this measurement (docs/benchmarks.md). Each
library runs in its own process, in turn, ``--repeats`` times alternating; the machine's noise
shows in the spread of the repeats. xgrammar imports torch (its mask application is a torch
kernel) and is not in the dev extra: give an interpreter that has it with ``--xgrammar-python``
(a venv of its own), or the leg is skipped.

    python benchmarks/grammar_mask.py --xgrammar-python /tmp/xgr/bin/python --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "format": "email"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "active": {"type": "boolean"},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "email", "role", "active", "score", "tags", "address"],
    "additionalProperties": False,
}
PERSON = {
    "name": "Ada Lovelace",
    "age": 36,
    "email": "ada@example.org",
    "role": "admin",
    "active": True,
    "score": 98.25,
    "tags": ["mathematics", "engines", "poetry"],
    "address": {"street": "12 St James's Square", "city": "London", "zip": "12345"},
}
TOOL_CALL_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"const": "get_weather"},
        "arguments": {
            "type": "object",
            "properties": {
                "location": {"type": "string"},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
            },
            "required": ["location", "unit"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
TOOL_CALL = {"name": "get_weather", "arguments": {"location": "Paris, France", "unit": "celsius"}}

CASES = {
    "json_schema person": (PERSON_SCHEMA, PERSON),
    "json_schema tool call": (TOOL_CALL_SCHEMA, TOOL_CALL),
    "json_object": (None, {"items": [PERSON, TOOL_CALL], "count": 2}),
}
"""name -> (schema or None for any JSON object, a valid document)."""


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _summary(values: list[float]) -> dict:
    return {"median_us": statistics.median(values) * 1e6, "p99_us": _percentile(values, 0.99) * 1e6}


# ---------------------------------------------------------------------- one library (child)
def _run_llguidance(tokenizer, cases) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.numpy
    import numpy as np

    start = time.perf_counter()
    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))
    setup = time.perf_counter() - start
    results = {"tokenizer_setup_s": setup, "cases": {}}
    for name, (schema, _document, token_ids) in cases.items():
        start = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema if schema is not None else {"type": "object"},
            defaults={"whitespace_flexible": False},
        )
        matcher = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)
        compile_s = time.perf_counter() - start
        if matcher.is_error():
            raise RuntimeError(f"llguidance: {name}: {matcher.get_error()}")
        mask = llguidance.numpy.allocate_token_bitmask(1, ll_tokenizer.vocab_size)
        logits = np.random.default_rng(0).standard_normal((1, len(tokenizer)), np.float32)
        fill, apply, accept = _walk(
            f"llguidance: {name}",
            token_ids,
            fill=partial(llguidance.numpy.fill_next_token_bitmask, matcher, mask, 0),
            copy_row=logits.copy,
            apply_mask=partial(_apply_mask, llguidance.numpy.apply_token_bitmask_inplace, mask),
            allows=lambda row, token: bool(np.isfinite(row[0, token])),
            accept=matcher.consume_token,
            why_refused=matcher.get_error,
        )
        results["cases"][name] = _case_result(compile_s, fill, apply, accept)
    return results


def _run_xgrammar(tokenizer, cases) -> dict:
    import torch
    import xgrammar as xgr

    torch.set_num_threads(1)
    start = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    setup = time.perf_counter() - start
    results = {"tokenizer_setup_s": setup, "cases": {}}
    for name, (schema, _document, token_ids) in cases.items():
        start = time.perf_counter()
        if schema is None:
            compiled = compiler.compile_builtin_json_grammar()
        else:
            compiled = compiler.compile_json_schema(
                json.dumps(schema), any_whitespace=False, separators=(",", ":")
            )
        matcher = xgr.GrammarMatcher(compiled)
        compile_s = time.perf_counter() - start
        mask = xgr.allocate_token_bitmask(1, info.vocab_size)
        logits = torch.randn((1, len(tokenizer)), generator=torch.Generator().manual_seed(0))
        fill, apply, accept = _walk(
            f"xgrammar: {name}",
            token_ids,
            fill=partial(matcher.fill_next_token_bitmask, mask),
            copy_row=logits.clone,
            apply_mask=partial(_apply_mask, xgr.apply_token_bitmask_inplace, mask),
            allows=lambda row, token: bool(torch.isfinite(row[0, token])),
            accept=matcher.accept_token,
            why_refused=lambda: "the matcher refused it",
        )
        results["cases"][name] = _case_result(compile_s, fill, apply, accept)
    return results


def _apply_mask(apply_inplace, mask, row):
    apply_inplace(row, mask)


def _walk(what, token_ids, *, fill, copy_row, apply_mask, allows, accept, why_refused):
    """Walks a grammar library's matcher along ``token_ids``: per token the times to fill the
    mask, to apply it to a fresh copy of the logits row (the copy is timed with it: both
    libraries mask in place) and to accept the token; the checks between them are not timed.
    Raises when the mask forbids, or the matcher refuses, a token of the document."""
    fill_s, apply_s, accept_s = [], [], []
    for token in token_ids:
        t0 = time.perf_counter()
        fill()
        t1 = time.perf_counter()
        row = copy_row()
        apply_mask(row)
        t2 = time.perf_counter()
        if not allows(row, token):
            raise RuntimeError(f"{what}: the mask forbids token {token}")
        t3 = time.perf_counter()
        accepted = accept(token)
        t4 = time.perf_counter()
        if not accepted:
            raise RuntimeError(f"{what}: token {token}: {why_refused()}")
        fill_s.append(t1 - t0)
        apply_s.append(t2 - t1)
        accept_s.append(t4 - t3)
    return fill_s, apply_s, accept_s


def _case_result(compile_s: float, fill: list, apply: list, accept: list) -> dict:
    return {
        "compile_ms": compile_s * 1e3,
        "tokens": len(fill),
        "mask": _summary(fill),
        "apply": _summary(apply),
        "accept": _summary(accept),
    }


def child(library: str, checkpoint: str) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    cases = {}
    for name, (schema, document) in CASES.items():
        text = json.dumps(document, separators=(",", ":"))
        cases[name] = (schema, document, tokenizer.encode(text, add_special_tokens=False))
    run = _run_llguidance if library == "llguidance" else _run_xgrammar
    print(json.dumps(run(tokenizer, cases)))


# ---------------------------------------------------------------------- driver
def _leg(python: str, library: str, checkpoint: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAYON_NUM_THREADS": "1"}
    command = [python, __file__, "--child", library, "--checkpoint", str(checkpoint)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{library} leg failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _version(python: str, library: str) -> str | None:
    code = f"import importlib.metadata as m; print(m.version({library!r}))"
    done = subprocess.run([python, "-c", code], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--xgrammar-python", help="an interpreter with xgrammar installed")
    parser.add_argument("--child", choices=("llguidance", "xgrammar"), help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.checkpoint)
        return
    sys.path.insert(0, str(ROOT))
    import smollm2

    checkpoint = smollm2.build_checkpoint()
    legs = {"llguidance": sys.executable}
    if args.xgrammar_python:
        legs["xgrammar"] = args.xgrammar_python
    runs: dict[str, list[dict]] = {name: [] for name in legs}
    for _ in range(args.repeats):
        for library, python in legs.items():
            runs[library].append(_leg(python, library, checkpoint))
    print(
        "library     version  case                   compile ms  mask us (med / p99)  "
        "apply us  accept us"
    )
    for library, results in runs.items():
        version = _version(legs[library], library)
        for case in CASES:
            rows = [r["cases"][case] for r in results]
            masks = sorted(r["mask"]["median_us"] for r in rows)
            p99s = sorted(r["mask"]["p99_us"] for r in rows)
            print(
                f"{library:11} {version:8} {case:22} "
                f"{statistics.median(r['compile_ms'] for r in rows):10.1f}  "
                f"{masks[0]:6.1f}-{masks[-1]:<6.1f}/ {statistics.median(p99s):7.1f}  "
                f"{statistics.median(r['apply']['median_us'] for r in rows):8.1f}  "
                f"{statistics.median(r['accept']['median_us'] for r in rows):9.1f}"
            )
        setup = statistics.median(r["tokenizer_setup_s"] for r in results)
        print(f"{library:11} tokenizer setup {setup * 1e3:.0f} ms (once per server)")


if __name__ == "__main__":
    main()
