"""``attnexport demo``: export the default tiny model, run it on both executors, verify it."""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from attnexport.cli import choices
from attnexport.errors import require

DEMO_MODEL = "llama"
DEMO_PROMPTS = ([1, 17, 42, 7, 99], [5, 3], [200, 201, 202, 203, 204, 205, 206, 207])


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "demo", help="export the tiny Llama, generate with onnxruntime and torch, verify"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help="keep the export here (default: a temporary directory)",
    )
    parser.add_argument(
        "--model",
        default=DEMO_MODEL,
        help=f"zoo model: {choices.zoo_model_list()} (default {DEMO_MODEL})",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an earlier export in --out DIR"
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    require("torch", "export", "attnexport demo (it exports a model and runs it in torch)")
    if args.out is None:
        with tempfile.TemporaryDirectory(prefix="attnexport-demo-") as tmp:
            return _demo(Path(tmp), args.model, keep=False)
    return _demo(args.out, args.model, keep=True, overwrite=args.overwrite)


def _demo(out: Path, model: str, keep: bool, overwrite: bool = False) -> int:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from attnexport.artifact import ExportOptions, export_artifact
    from attnexport.cli.progress import steps
    from attnexport.cli.verify_cmd import verify_artifact
    from attnexport.runtime import SamplingParams, engine_from_path

    console = Console()
    start = time.perf_counter()
    runs = {}
    with steps() as step:
        manifest = export_artifact(
            model if model.startswith("zoo:") else f"zoo:{model}",  # never a local directory
            out,
            ExportOptions(formats=("onnx", "pt2"), overwrite=overwrite),
            step=step,
        )
        params = SamplingParams(max_tokens=12)
        for executor in ("ort", "torch"):
            step(f"generating with the {executor} executor")
            engine = engine_from_path(out, executor=executor)
            t0 = time.perf_counter()
            outputs = engine.generate([list(p) for p in DEMO_PROMPTS], params)
            runs[executor] = (outputs, time.perf_counter() - t0)
        reference, comparisons = verify_artifact(out, step=step)

    config = manifest["config"]
    console.print(
        f"[bold]{manifest['architecture']}[/] (tiny, seeded weights: "
        f"{config.get('num_hidden_layers')} layers, {config.get('num_attention_heads')} heads / "
        f"{config.get('num_key_value_heads')} KV heads) exported to "
        + (str(out) if keep else "a temporary directory")
        + f": {', '.join(manifest['files'].values())}"
    )
    table = Table(title="greedy generation, 12 new tokens per prompt")
    table.add_column("prompt")
    for executor in runs:
        table.add_column(f"{executor} executor ({runs[executor][1] * 1000:.0f} ms)")
    for i, prompt in enumerate(DEMO_PROMPTS):
        table.add_row(
            str(list(prompt)), *(str(list(runs[e][0][i].outputs[0].token_ids)) for e in runs)
        )
    console.print(table)
    same = all(
        a.outputs[0].token_ids == b.outputs[0].token_ids
        for a, b in zip(runs["ort"][0], runs["torch"][0], strict=True)
    )
    worst = max(comparisons, key=lambda c: c.max_abs / c.tolerance)
    ok = all(c.ok for c in comparisons)
    console.print(
        (
            "[green]identical tokens[/] on both executors"
            if same
            else "[red]the executors disagree[/]"
        )
        + f"; verify against {escape(reference)}: "
        + ("[green]ok[/]" if ok else "[red]FAIL[/]")
        + f" ({len(comparisons)} outputs, worst {worst.leg} {worst.output}: "
        f"{worst.max_abs:.1e} <= {worst.tolerance:.0e})"
        + f"; total {time.perf_counter() - start:.1f} s"
    )
    return 0 if same and ok else 1
