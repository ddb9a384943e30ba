"""Every causal-LM model type transformers ships, tried the way a user would: a tiny random
checkpoint of the type (its own config class with the sizes of ``tests/models/hf_families.py``,
built offline), plain ``attnexport export CHECKPOINT`` and ``attnexport run --prompt-ids``, and
the greedy tokens compared with transformers' ``generate``. Each type runs in a process of its
own, under a time limit.

    python scripts/transformers_families.py                 # every type, 2 at a time
    python scripts/transformers_families.py --types olmo gpt_neo --jobs 1
    python scripts/transformers_families.py --json results.json

One line per type, then the counts. Outcomes:

- ``passed``: the export's greedy tokens equal transformers' on both prompts;
- ``refused``: ``export`` exits 2 with a named reason (the line gives it);
- ``no tiny checkpoint``: transformers itself cannot build or run the tiny model offline (a
  multimodal or encoder-decoder config, a required field without a default, ...);
- ``MISMATCH``: exported, but the tokens differ (a wrong answer: the worst outcome);
- ``ERROR``: a crash, an exit code other than 0 or 2, or the time limit.

The last two are what the transformers path must not do; docs/models.md has the table.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASE_FILE = "phase"
STEPS = 6
FALLBACK_SIZES = (
    {},
    {"head_dim": "default"},
    {"head_dim": "default", "num_key_value_heads": "default"},
)
"""Changes to the tiny sizes of ``tests/models/hf_families.py``, tried in turn until
transformers builds and runs the model ("default": the config class's own)."""
FAMILY_SIZES = {
    "codegen": {"rotary_dim": 8},
    "gptj": {"rotary_dim": 8},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]], "window_size": 4},
}
"""Sizes a family's config needs beyond the common ones (names of its own); the families of
``hf_families.FAMILIES`` take theirs from there."""


def causal_lm_types() -> list[str]:
    """transformers' causal-LM model types, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _first_line(text: str, limit: int = 240) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return (lines[-1] if lines else "")[:limit]


def _cli(*argv) -> tuple[int, str, str]:
    """``attnexport ARGV`` in this process: (exit code, stdout, stderr)."""
    from attnexport.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def _build(model_type: str, changes: dict):
    """transformers' model of ``model_type`` at the tiny sizes with ``changes``, seeded 0."""
    import torch
    import transformers

    sys.path.insert(0, str(ROOT))
    from tests.models.hf_families import CONFIG_DEFAULT, FAMILIES, Family

    known = FAMILIES.get(model_type)
    changes = {k: CONFIG_DEFAULT if v == "default" else v for k, v in changes.items()}
    overrides = {**changes, **(known.overrides if known else {})}
    torch.manual_seed(0)
    config = Family(model_type, "", overrides).config()
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def _reload(checkpoint: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(checkpoint).eval()


def _generate(hf_model, prompt: list[int]) -> list[int]:
    """transformers' greedy tokens after ``prompt``: up to :data:`STEPS`, ending at the
    checkpoint's own end token as ``attnexport run`` does."""
    import torch

    ids = torch.tensor([prompt])
    with torch.no_grad():  # (the mask given: generate would take a pad-token id for padding)
        out = hf_model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=STEPS, do_sample=False
        )
    return out[0, len(prompt) :].tolist()


def try_one(model_type: str, work: Path) -> dict:
    """Builds, exports, runs and compares one model type; returns its outcome."""
    sys.path.insert(0, str(ROOT))
    from tests.models.hf_families import PROMPTS

    checkpoint, out = work / "checkpoint", work / "export"
    (work / PHASE_FILE).write_text("building")
    for fallback in FALLBACK_SIZES:
        try:
            built = _build(model_type, {**fallback, **FAMILY_SIZES.get(model_type, {})})
            built.save_pretrained(checkpoint)
            hf_model = _reload(checkpoint)  # what the export reads, as transformers reads it
            vocab = hf_model.get_output_embeddings().weight.shape[0]
            prompts = [[t % vocab for t in prompt] for prompt in PROMPTS]
            expected = [_generate(hf_model, prompt) for prompt in prompts]
            break
        except Exception as error:
            reason = " ".join(str(error).split())[:240]
            detail = f"{type(error).__name__}: {reason}"
            failure = {"status": "no tiny checkpoint", "detail": detail}
    else:
        return failure
    (work / PHASE_FILE).write_text("exporting")
    code, _, err = _cli("export", checkpoint, "--out", out)
    if code == 2:
        return {"status": "refused", "detail": _first_line(err)}
    if code != 0:
        return {"status": "ERROR", "detail": f"export exited {code}: {_first_line(err)}"}
    impl = json.loads((out / "manifest.json").read_text()).get("impl")
    for prompt, tokens in zip(prompts, expected, strict=True):
        ids = ",".join(map(str, prompt))
        code, stdout, err = _cli("run", out, "--prompt-ids", ids, "--max-tokens", STEPS, "--json")
        if code != 0:
            return {"status": "ERROR", "detail": f"run exited {code}: {_first_line(err)}"}
        got = json.loads(stdout)["outputs"][0]["token_ids"]
        if got != tokens:
            return {"status": "MISMATCH", "detail": f"{impl}: {got} != transformers' {tokens}"}
    return {"status": "passed", "detail": impl}


def run_type(model_type: str, timeout: float) -> dict:
    """``try_one`` in a process of its own, under ``timeout`` seconds."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"family-{model_type}-") as work:
        command = [sys.executable, __file__, "--one", model_type, "--work", work]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            result = {"status": "ERROR", "detail": f"over the {timeout:.0f} s limit"}
        else:
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            if done.returncode == 0 and lines:
                result = json.loads(lines[-1])
            else:
                detail = _first_line(done.stderr) or f"exit {done.returncode}"
                result = {"status": "ERROR", "detail": f"worker died: {detail}"}
        phase = Path(work, PHASE_FILE)
        if result["status"] == "ERROR" and phase.is_file() and phase.read_text() == "building":
            # transformers' own model (a multimodal config's default vision tower) took the
            # memory or the time: nothing of attnexport ran
            result = {"status": "no tiny checkpoint", "detail": f"building: {result['detail']}"}
    return {"type": model_type, **result, "seconds": round(time.perf_counter() - start, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", nargs="+", help="model types (default: every causal-LM one)")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--json", type=Path, help="also write the outcomes here")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        print(json.dumps(try_one(args.one, args.work)))
        return 0
    types = args.types or causal_lm_types()
    results = []
    with ThreadPoolExecutor(args.jobs) as pool:
        for result in pool.map(lambda t: run_type(t, args.timeout), types):
            print(f"{result['type']:28} {result['status']:18} {result['detail']}", flush=True)
            results.append(result)
    counts: dict[str, int] = {}
    for result in results:
        counts[result["status"]] = counts.get(result["status"], 0) + 1
    print(", ".join(f"{status}: {n}" for status, n in sorted(counts.items())))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 1 if counts.get("MISMATCH") or counts.get("ERROR") else 0


if __name__ == "__main__":
    sys.exit(main())
