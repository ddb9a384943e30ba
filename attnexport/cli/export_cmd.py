"""``attnexport export MODEL --out DIR``: a zoo model or a local Hugging Face checkpoint to an
export directory (``model.onnx`` and/or ``model.pt2``, ``manifest.json``, tokenizer files)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from attnexport.artifact import DTYPES, ExportOptions, export_artifact
from attnexport.cli import choices
from attnexport.cli.progress import steps


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "export",
        help="export a zoo model or a Hugging Face checkpoint to ONNX and/or .pt2",
        description="Export MODEL (a zoo name such as 'llama' or 'zoo:llama', or a local Hugging "
        "Face checkpoint directory with config.json and *.safetensors) into DIR. A bare name "
        "that is both a zoo name and a checkpoint directory is refused: write zoo:NAME or "
        "./NAME.",
    )
    parser.add_argument(
        "model",
        metavar="MODEL",
        help=f"zoo name ({', '.join(choices.zoo_models())}; or zoo:NAME) or checkpoint "
        "directory (a path: ./llama)",
    )
    parser.add_argument("--out", required=True, type=Path, metavar="DIR", help="output directory")
    parser.add_argument(
        "--format", choices=choices.export_formats(), default="onnx", help="default: onnx"
    )
    parser.add_argument(
        "--target",
        choices=choices.onnx_targets(),
        default="attnexport",
        metavar="TARGET",  # not the choices: listing them would import the lowering now
        help="ONNX flavour, one of %(choices)s: attnexport nodes with function bodies "
        "(default), standard ops only, or com.microsoft.PagedAttention for onnxruntime's "
        "CUDA EP",
    )
    parser.add_argument("--dtype", choices=choices.model_dtypes(), default="float32")
    parser.add_argument(
        "--block-size",
        type=int,
        default=16,
        metavar="N",
        help="tokens per KV-cache block (default 16)",
    )
    parser.add_argument("--seed", type=int, default=0, help="weights seed of zoo models")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an earlier export in DIR (its files are removed first)",
    )
    parser.add_argument("--json", action="store_true", help="print the manifest as JSON")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    options = ExportOptions(
        formats=("onnx", "pt2") if args.format == "both" else (args.format,),
        target=args.target,
        dtype=DTYPES[args.dtype],
        block_size=args.block_size,
        seed=args.seed,
        overwrite=args.overwrite,
    )
    with steps(quiet=args.json) as step:
        manifest = export_artifact(args.model, args.out, options, step=step)
    if args.json:
        print(json.dumps(manifest, indent=2))
        return 0
    from rich.console import Console
    from rich.markup import escape

    source = manifest["source"]
    origin = (
        f"checkpoint {source['path']}"
        if source["kind"] == "checkpoint"
        else f"zoo model {source['name']}"
    )
    files = ", ".join(manifest["files"].values())
    seconds = sum(manifest["export_seconds"].values())
    Console().print(
        f"[green]exported[/] {manifest['architecture']} ({manifest['kind']}, "
        f"{manifest['dtype']}) from {escape(origin)} to {escape(str(args.out))}: {files}, "
        "manifest.json"
        + (
            f", {len(manifest['tokenizer_files'])} tokenizer files"
            if manifest["tokenizer_files"]
            else ""
        )
        + f" in {seconds:.1f} s"
    )
    return 0
