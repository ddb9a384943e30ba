"""Decode speed of one checkpoint exported two ways: the zoo's network (``export --impl zoo``)
and transformers' model with its attention on the paged ops (``--impl transformers``, the
rewrite rules of ``attnexport.lowering.fusions`` applied), both float32 ONNX run by the
engine's OrtExecutor with the native kernels.

The checkpoint is the real SmolLM2-135M-Instruct (``benchmarks/smollm2.py``) unless
``--checkpoint`` names another that both paths export. Each repeat runs the two legs one after
the other, alternating which goes first, every leg in a fresh process (load, warm-up, then the
timed generation: ``--batch`` prompts of ``--prompt-len`` random tokens, ``--new-tokens``
greedy tokens each). Reported: decode tokens/s and time to first token per leg (best and
median over the repeats) and the transformers/zoo ratio of each repeat's pair.

    python benchmarks/generic_vs_zoo.py --repeats 5 [--write-docs]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LEGS = ("zoo", "transformers")
DOCS_MARK = "<!-- generic-vs-zoo -->"


def _cli(*args: str) -> None:
    command = [
        sys.executable,
        "-c",
        "import sys; from attnexport.cli import main; sys.exit(main())",
    ]
    subprocess.run([*command, *args], check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})


def export(checkpoint: Path, work: Path, leg: str) -> Path:
    """``attnexport export CHECKPOINT --impl LEG`` into ``work/LEG`` (kept between runs)."""
    out = work / leg
    if not (out / "manifest.json").is_file():
        _cli("export", str(checkpoint), "--impl", leg, "--out", str(out), "--overwrite")
    return out


def prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(batch)]


def run_leg(args) -> dict:
    """One leg in this process: returns ``ttft_s`` and ``decode_tok_s``."""
    from attnexport.artifact import read_manifest
    from attnexport.runtime import (
        CacheConfig,
        Engine,
        OrtExecutor,
        SamplingParams,
        SchedulerConfig,
    )

    manifest = read_manifest(args.artifact)
    executor = OrtExecutor(args.artifact / "model.onnx", num_threads=args.threads)
    longest = args.prompt_len + args.new_tokens
    blocks = args.batch * -(-longest // 16) + 8
    engine = Engine(
        executor,
        CacheConfig(num_blocks=blocks, enable_prefix_caching=False),
        SchedulerConfig(max_model_len=longest),
    )
    vocab = manifest["vocab_size"]

    def generate(new: int, seed: int) -> dict:
        for prompt in prompts(args.batch, args.prompt_len, vocab, seed):
            engine.add_request(prompt, SamplingParams(max_tokens=new))
        start = time.perf_counter()
        engine.step()
        first = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        end = time.perf_counter()
        return {"ttft_s": first - start, "decode_tok_s": args.batch * (new - 1) / (end - first)}

    generate(4, seed=1)  # warm-up
    return {**generate(args.new_tokens, seed=0), "fusions": fusions(args.artifact)}


def fusions(artifact: Path) -> dict:
    import onnx

    model = onnx.load(str(artifact / "model.onnx"), load_external_data=False)
    props = {p.key: p.value for p in model.metadata_props}
    return {"nodes": len(model.graph.node), "fired": json.loads(props.get("fusions", "{}"))}


def _leg_process(args, leg: str, artifact: Path) -> dict:
    command = [
        sys.executable,
        __file__,
        "--leg",
        leg,
        "--artifact",
        str(artifact),
        *("--batch", str(args.batch), "--prompt-len", str(args.prompt_len)),
        *("--new-tokens", str(args.new_tokens), "--threads", str(args.threads)),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(command, check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--work", type=Path, default=Path("/tmp/attnexport-generic-vs-zoo"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--write-docs", action="store_true", help="update docs/benchmarks.md")
    parser.add_argument("--leg", choices=LEGS, help=argparse.SUPPRESS)
    parser.add_argument("--artifact", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.leg:
        print(json.dumps(run_leg(args)))
        return
    checkpoint = args.checkpoint
    if checkpoint is None:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        import smollm2

        checkpoint = smollm2.build_checkpoint()
    artifacts = {leg: export(checkpoint, args.work, leg) for leg in LEGS}
    results: dict[str, list[dict]] = {leg: [] for leg in LEGS}
    ratios = []
    for repeat in range(args.repeats):
        order = LEGS if repeat % 2 == 0 else LEGS[::-1]
        pair = {leg: _leg_process(args, leg, artifacts[leg]) for leg in order}
        for leg in LEGS:
            results[leg].append(pair[leg])
        ratios.append(pair["transformers"]["decode_tok_s"] / pair["zoo"]["decode_tok_s"])
        print(
            f"repeat {repeat + 1}: "
            + ", ".join(f"{leg} {pair[leg]['decode_tok_s']:.1f} tok/s" for leg in LEGS)
            + f", ratio {ratios[-1]:.3f}",
            flush=True,
        )
    summary = table(args, checkpoint, results, ratios)
    print(summary)
    if args.write_docs:
        write_docs(summary)


def table(args, checkpoint: Path, results: dict, ratios: list[float]) -> str:
    lines = [
        f"Checkpoint `{checkpoint.name}`, batch {args.batch}, prompt {args.prompt_len}, "
        f"{args.new_tokens} new tokens, {args.threads} threads, float32 ONNX with the native "
        f"kernels, {args.repeats} alternating repeats:",
        "",
        "| leg | graph nodes | rules fired | decode tok/s best | median | TTFT s median |",
        "|---|---|---|---|---|---|",
    ]
    for leg, runs in results.items():
        rates = [r["decode_tok_s"] for r in runs]
        fired = runs[0]["fusions"]["fired"]
        lines.append(
            f"| {leg} | {runs[0]['fusions']['nodes']} | "
            + (", ".join(f"{k} {v}" for k, v in fired.items()) or "none")
            + f" | {max(rates):.1f} | {statistics.median(rates):.1f} | "
            f"{statistics.median(r['ttft_s'] for r in runs):.3f} |"
        )
    lines += [
        "",
        f"transformers / zoo decode ratio per repeat: {', '.join(f'{r:.3f}' for r in ratios)} "
        f"(median {statistics.median(ratios):.3f}, best {max(ratios):.3f})",
    ]
    return "\n".join(lines)


def write_docs(summary: str) -> None:
    path = ROOT / "docs" / "benchmarks.md"
    text = path.read_text()
    block = f"{DOCS_MARK}\n{summary}\n{DOCS_MARK}"
    if DOCS_MARK in text:
        before, _, rest = text.partition(DOCS_MARK)
        _, _, after = rest.partition(DOCS_MARK)
        text = before + block + after
    else:
        text += f"\n## The transformers path against the zoo\n\n{block}\n"
    path.write_text(text)


if __name__ == "__main__":
    main()
