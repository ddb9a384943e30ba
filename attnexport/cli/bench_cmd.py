"""``attnexport bench NAME [ARGS...]``: runs a benchmark script of ``benchmarks/``."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from attnexport.cli.errors import CliError

BENCHMARKS = {
    "decode": ("decode_attention.py", "decode attention: ipex vs sdpa vs raw IPEX kernels"),
    "generate": ("generate.py", "end-to-end generation: executors vs transformers, ORT-genai"),
    "serve": ("serve.py", "HTTP serving under Poisson load: attnexport serve vs ORT-genai, HF"),
    "export": ("export_time.py", "torch.export and ONNX export time by model depth"),
    "cache-update": ("ort_cache_update.py", "onnxruntime cache write: IO binding vs run()"),
    "xformers": ("xformers_attention.py", "xformers vs sdpa on CUDA"),
}


def benchmarks_dir() -> Path:
    """The repository's ``benchmarks/`` folder (benchmarks are not installed with the wheel)."""
    return Path(__file__).resolve().parents[2] / "benchmarks"


def add_parser(commands) -> None:
    lines = "\n".join(f"  {name:13s} {help}" for name, (_, help) in BENCHMARKS.items())
    parser = commands.add_parser(
        "bench",
        help=f"run a benchmark ({', '.join(BENCHMARKS)})",
        description=f"Runs a benchmark script; arguments after NAME go to the script "
        f"(try `attnexport bench NAME --help`).\n\nbenchmarks:\n{lines}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("name", choices=tuple(BENCHMARKS), metavar="NAME")
    parser.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    script = benchmarks_dir() / BENCHMARKS[args.name][0]
    if not script.is_file():
        raise CliError(
            f"bench {args.name}: {script} not found; benchmarks run from a source "
            "checkout of attnexport"
        )
    return subprocess.call([sys.executable, str(script), *args.args])
