"""Export time of the zoo's Llama at 2, 8 and 24 layers: torch.export (``export_program``),
the ONNX lowering of that program (``to_onnx``: functionalization, torch.onnx translation,
cache exposure, optimizer, function bodies, save and full onnx.checker pass) and the total.

Usage::

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/export_time.py [--layers 2 8 24]
        [--hidden 256] [--repeats 2] [--target attnexport]

Prints a markdown table (best of ``--repeats`` runs per size; the first export of the process,
which pays for imports, is a warm-up and not counted).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from attnexport.lowering import export_program, to_onnx
from attnexport.models.llama import LlamaConfig, LlamaForCausalLM


def build(layers: int, hidden: int) -> LlamaForCausalLM:
    heads = max(4, hidden // 64)
    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 4),
        head_dim=hidden // heads,
    )
    return LlamaForCausalLM.from_config(config)


def export_once(model: LlamaForCausalLM, workdir: Path, target: str) -> tuple[float, float]:
    sample = model.export_sample(16)
    start = time.perf_counter()
    program = export_program(model, sample.args, dynamic_shapes=sample.dynamic_shapes)
    exported = time.perf_counter()
    to_onnx(
        program,
        sample.args,
        workdir / "model.onnx",
        target=target,
        cache_spec=model.cache_spec(16),
        output_names=["logits"],
    )
    return exported - start, time.perf_counter() - exported


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8, 24])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--target", default="attnexport")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        export_once(build(1, args.hidden), workdir, args.target)  # warm-up: imports, registries
        print(
            f"torch {torch.__version__}, target {args.target}, hidden {args.hidden}, "
            f"threads {torch.get_num_threads()}\n"
        )
        print("| layers | parameters | torch.export (s) | ONNX lowering (s) | total (s) |")
        print("|---:|---:|---:|---:|---:|")
        for layers in args.layers:
            model = build(layers, args.hidden)
            params = sum(p.numel() for p in model.parameters())
            runs = [export_once(model, workdir, args.target) for _ in range(args.repeats)]
            ep_time, onnx_time = min(runs, key=sum)
            print(
                f"| {layers} | {params / 1e6:.1f} M | {ep_time:.2f} | {onnx_time:.2f} "
                f"| {ep_time + onnx_time:.2f} |"
            )


if __name__ == "__main__":
    main()
