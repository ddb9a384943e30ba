"""``attnexport export MODEL --out DIR``: a zoo model or a local Hugging Face checkpoint to an
export directory (``model.onnx`` and/or ``model.pt2``, ``manifest.json``, tokenizer files)."""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import threading
from pathlib import Path

from attnexport.artifact import ArtifactError
from attnexport.cli import choices
from attnexport.cli.progress import steps
from attnexport.errors import require


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
        help=f"zoo name ({choices.zoo_model_list()}; or zoo:NAME) or checkpoint "
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
    parser.add_argument(
        "--impl",
        choices=choices.model_impls(),
        default="auto",
        metavar="IMPL",
        help="how a checkpoint is loaded, one of %(choices)s: the zoo's network where it has the "
        "family, else transformers' model with its attention on the paged ops (default auto); "
        "zoo or transformers to choose",
    )
    parser.add_argument("--dtype", choices=choices.model_dtypes(), default="float32")
    parser.add_argument(
        "--kv-cache-dtype",
        choices=choices.kv_cache_dtypes(),
        default="auto",
        help="dtype of the KV caches: auto (the model's, default), or float32, bfloat16, "
        "float16 (half the bytes of float32), int8 (a quarter, with a float32 scale per token "
        "and KV head: no calibration); activations keep --dtype",
    )
    parser.add_argument(
        "--prefill-attention",
        choices=choices.prefill_attention(),
        default="float32",
        help="how the native PagedAttention kernel multiplies a prefill's queries, one of "
        "%(choices)s: float32 (default), or bfloat16 pairs where the CPU has AVX512_BF16 "
        "(vdpbf16ps, twice the products an instruction; queries, keys, values and softmax "
        "weights rounded to bfloat16, as OpenVINO computes on such CPUs; float32 elsewhere)",
    )
    parser.add_argument(
        "--lossless-weights",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="float32 ONNX exports: store each projection whose float32 weights are exactly 4- "
        "or 8-bit codes with float16 block scales (a checkpoint de-quantized from GGUF Q4_1, "
        "Q4_0 or Q8_0) as those codes; the kernel decodes the same numbers, 3.5-6x fewer bytes "
        "(default on; --no-lossless-weights keeps float32 panels)",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=16,
        metavar="N",
        help="tokens per KV-cache block (default 16)",
    )
    parser.add_argument("--seed", type=int, default=0, help="weights seed of zoo models")
    quant = parser.add_argument_group(
        "weight quantization (ONNX; onnxruntime's MatMulNBits quantizer; docs/quantization.md)"
    )
    quant.add_argument(
        "--weights",
        choices=choices.weight_formats(),
        default="float",
        metavar="FORMAT",
        help="weight format of the projections (MatMul), one of %(choices)s (default float)",
    )
    quant.add_argument(
        "--weights-block-size",
        type=int,
        metavar="N",
        help="weights per scale, a power of 2 >= 16 (default: the format's, docs/quantization.md)",
    )
    symmetry = quant.add_mutually_exclusive_group()
    symmetry.add_argument(
        "--weights-symmetric",
        dest="weights_symmetric",
        action="store_const",
        const=True,
        help="no zero points",
    )
    symmetry.add_argument(
        "--weights-asymmetric",
        dest="weights_symmetric",
        action="store_const",
        const=False,
        help="a zero point per block",
    )
    quant.add_argument(
        "--weights-algorithm",
        choices=choices.weight_algorithms(),
        metavar="ALGORITHM",
        help="onnxruntime's quantization algorithm, one of %(choices)s: round to nearest, "
        "llama.cpp-style k-quant search, half-quadratic (a float zero point per block)",
    )
    quant.add_argument(
        "--weights-accuracy-level",
        type=int,
        metavar="L",
        help="MatMulNBits accuracy_level: 0 unset, 1 fp32, 2 fp16, 3 bf16, 4 int8 compute",
    )
    quant.add_argument(
        "--lm-head",
        choices=choices.lm_head_formats(),
        metavar="FORMAT",
        help="the logits projection (and a tied embedding, stored once), one of %(choices)s",
    )
    quant.add_argument(
        "--lm-head-block-size",
        type=int,
        metavar="N",
        help="the logits projection's weights per scale, a power of 2 >= 16 (default: 64 "
        "for int4, --weights-block-size for int8)",
    )
    quant.add_argument(
        "--weights-offsets",
        choices=choices.zero_point_offsets(),
        metavar="FORMAT",
        help="how hqq's float zero points are stored (as an offset per block), one of "
        "%(choices)s (default int8: a third of float32's bytes, within rounding of it)",
    )
    quant.add_argument(
        "--weights-activations",
        choices=choices.weight_activations(),
        metavar="FORMAT",
        help="how finely the quantized layers' activations are rounded per block, one of "
        "%(choices)s (int16, the default: attnexport.MatMul8Bits / MatMul4Bits, top-1 "
        "agreement with the float model 0.988 on SmolLM2-135M, 0.979 for int4; int8: "
        "MatMulNBits' int8 kernel, 0.948 for int4 with hqq's 8-bit offsets)",
    )
    quant.add_argument(
        "--weights-prefill-activations",
        choices=choices.weight_prefill_activations(),
        metavar="FORMAT",
        help="how MatMul8Bits / MatMul4Bits round the activations of calls of 128 rows or more "
        "(a prefill's), one of %(choices)s (default int16, as every other call; int8: "
        "multiplied with vpdpbusd where the CPU has AVX512_VNNI, ~1.45x the products' speed, "
        "coarser numbers for the prompt's tokens and for rows decoded in such a call)",
    )
    quant.add_argument(
        "--weights-decode-activations",
        choices=choices.weight_decode_activations(),
        metavar="FORMAT",
        help="with --weights-prefill-activations int8, how MatMul8Bits / MatMul4Bits round the "
        "activations of the other calls (a decode step's), one of %(choices)s (default int16; "
        "int8: every call alike, a batched decode's products with vpdpbusd, SmolLM2 int4 at "
        "batch 32 0.79x the step, coarser numbers for every token)",
    )
    quant.add_argument(
        "--weights-batch-invariant",
        action=argparse.BooleanOptionalAction,
        help="give every MatMulNBits two rows or more and keep MatMul8Bits on its int16 path, "
        "so that a sequence's tokens do not depend on its batch (default: yes; "
        "--no-weights-batch-invariant saves the padding row, and lets MatMul8Bits multiply "
        "calls of 4 rows or more as float32 where its int16 path cannot (8-bit blocks over "
        "256); a prompt decoded alone may then differ from the same prompt batched)",
    )
    quant.add_argument(
        "--weights-keep-float",
        action="append",
        default=[],
        metavar="LAYER_PATTERN",
        help="layers that stay float (fnmatch on names such as model.layers.0.mlp.down_proj; "
        "repeatable)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an earlier export in DIR (once the new one is complete)",
    )
    parser.add_argument("--json", action="store_true", help="print the manifest as JSON")
    parser.set_defaults(run=run)


def _weights(args: argparse.Namespace):
    """The WeightQuantization the flags ask for (None for float weights)."""
    given = {
        "block_size": args.weights_block_size,
        "symmetric": args.weights_symmetric,
        "algorithm": args.weights_algorithm,
        "accuracy_level": args.weights_accuracy_level,
        "lm_head": args.lm_head,
        "lm_head_block_size": args.lm_head_block_size,
        "offsets": args.weights_offsets,
        "activations": args.weights_activations,
        "prefill_activations": args.weights_prefill_activations,
        "decode_activations": args.weights_decode_activations,
        "batch_invariant": args.weights_batch_invariant,
    }
    given = {k: v for k, v in given.items() if v is not None}
    if args.weights == "float":
        if given or args.weights_keep_float:
            raise ArtifactError("--weights-* / --lm-head: only with --weights int4 or int8")
        return None
    from attnexport.lowering import QuantizationError, WeightQuantization

    try:
        return WeightQuantization(args.weights, keep_float=tuple(args.weights_keep_float), **given)
    except QuantizationError as error:
        raise ArtifactError(str(error)) from None


def export_artifact(model: str, out: Path, options, step) -> dict:
    """:func:`attnexport.artifact.export_artifact`, imported when the command runs: it needs
    torch, which a deployment install does not have (building the parser must not)."""
    from attnexport.artifact import export_artifact as export

    return export(model, out, options, step=step)


@contextlib.contextmanager
def _sigterm_interrupts():
    """SIGTERM interrupts the export as Ctrl-C does (KeyboardInterrupt), so its staging
    directory is removed and ``--out`` left as it was (the default action would end the
    process where it stands)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run(args: argparse.Namespace) -> int:
    require("torch", "export", "attnexport export")
    from attnexport.artifact import DTYPES, ExportOptions

    options = ExportOptions(
        formats=("onnx", "pt2") if args.format == "both" else (args.format,),
        target=args.target,
        dtype=DTYPES[args.dtype],
        kv_cache_dtype=args.kv_cache_dtype,
        prefill_attention=args.prefill_attention,
        block_size=args.block_size,
        seed=args.seed,
        impl=args.impl,
        overwrite=args.overwrite,
        weights=_weights(args),
        lossless_weights=args.lossless_weights,
    )
    with steps(quiet=args.json) as step, _sigterm_interrupts():
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
    quant = manifest.get("weights")
    weights = f", {quant['format']} weights" if quant else ""
    if manifest.get("kv_cache_dtype", manifest["dtype"]) != manifest["dtype"]:
        weights += f", {manifest['kv_cache_dtype']} KV cache"
    if manifest.get("prefill_attention") == "bfloat16":
        weights += ", bfloat16 prefill attention"
    seconds = sum(manifest["export_seconds"].values())
    Console().print(
        f"[green]exported[/] {manifest['architecture']} ({manifest['kind']}, "
        f"{manifest.get('impl', 'zoo')}, "
        f"{manifest['dtype']}{weights}) from {escape(origin)} to {escape(str(args.out))}: {files}, "
        "manifest.json"
        + (
            f", {len(manifest['tokenizer_files'])} tokenizer files"
            if manifest["tokenizer_files"]
            else ""
        )
        + f" in {seconds:.1f} s"
    )
    return 0
