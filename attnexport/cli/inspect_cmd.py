"""``attnexport inspect model.onnx``: ops, custom nodes, cache ports and metadata of a file."""

from __future__ import annotations

import argparse
import collections
import json
import re
from pathlib import Path

from attnexport.artifact import ONNX_FILE, ArtifactError, check_model_file, read_manifest
from attnexport.artifact.manifest import require_model_bytes
from attnexport.cli.errors import CliError
from attnexport.model_contract import DOMAIN


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "inspect", help="summarise an exported ONNX file (ops, cache ports, metadata)"
    )
    parser.add_argument("path", type=Path, metavar="MODEL", help="model.onnx or an export dir")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(run=run)


def _shape(value_info) -> list:
    dims = value_info.type.tensor_type.shape.dim
    return [d.dim_param or d.dim_value for d in dims]


def _dtype(value_info) -> str:
    import onnx

    return onnx.helper.tensor_dtype_to_np_dtype(value_info.type.tensor_type.elem_type).name


def inspect_onnx(path: Path) -> dict:
    """A JSON-able summary of an ONNX file."""
    import onnx
    from google.protobuf.message import DecodeError

    manifest = None
    if path.is_dir():
        manifest = read_manifest(path)
        path = check_model_file(manifest, path, "onnx") if manifest else path / ONNX_FILE
    if not path.is_file():
        raise CliError(
            f"{path}: no such ONNX file (export one with: attnexport export MODEL --out DIR)"
        )
    require_model_bytes(path)
    try:
        model = onnx.load(str(path), load_external_data=False)
    except DecodeError as error:
        raise ArtifactError(f"{path}: not a valid ONNX model ({error}); re-export it") from None
    metadata = {p.key: p.value for p in model.metadata_props}
    ops = collections.Counter(f"{n.domain or 'ai.onnx'}::{n.op_type}" for n in model.graph.node)
    custom = {k: v for k, v in ops.items() if not k.startswith(("ai.onnx::", "com.microsoft"))}
    cache_outputs = json.loads(metadata.get("cache_outputs", "{}"))
    return {
        "path": str(path),
        "ir_version": model.ir_version,
        "opsets": {o.domain or "ai.onnx": o.version for o in model.opset_import},
        "inputs": [
            {"name": i.name, "dtype": _dtype(i), "shape": _shape(i)} for i in model.graph.input
        ],
        "outputs": [
            {"name": o.name, "dtype": _dtype(o), "shape": _shape(o)} for o in model.graph.output
        ],
        "cache_ports": [{"input": k, "output": v} for k, v in cache_outputs.items()],
        "nodes": dict(sorted(ops.items())),
        "custom_nodes": custom,
        "functions": sorted(f"{f.domain}::{f.name}" for f in model.functions),
        "parameters": sum(_numel(t) for t in model.graph.initializer),
        "metadata": metadata,
        # The manifest's weight quantization (export --weights); None: float weights.
        "weights": (manifest or {}).get("weights"),
        # The caches' dtype (export --kv-cache-dtype; the model's dtype when the metadata has
        # no kv_cache_dtype); None: no paged caches.
        "kv_cache_dtype": metadata.get("kv_cache_dtype", metadata.get("dtype"))
        if "cache_layout" in metadata
        else None,
        # How the model was written (export --impl: zoo or transformers) and the rewrite rules
        # of attnexport.lowering.fusions that fired on its graph, with their counts.
        "impl": (manifest or {}).get("impl", metadata.get("impl")),
        "fusions": json.loads(metadata.get("fusions", "{}")),
        # How the native PagedAttention kernel multiplies prefills (export --prefill-attention,
        # the nodes' prefill_bf16); None: no PagedAttention node.
        "prefill_attention": _prefill_attention(model),
        # Projections whose float32 weights the file stores as their exact codes (export
        # --lossless-weights), by code width.
        "lossless_weights": _lossless_weights(model),
    }


def _lossless_weights(model) -> dict[str, int]:
    # by name, not attnexport.lowering's tables: inspect runs without torch
    counts: dict[str, int] = {}
    for node in model.graph.node:
        width = re.fullmatch(r"LosslessMatMul(\d+)Bits(SiluAndMul)?", node.op_type)
        if node.domain == DOMAIN and width:
            counts[f"{width[1]}-bit"] = counts.get(f"{width[1]}-bit", 0) + 1
    return dict(sorted(counts.items()))


def _prefill_attention(model) -> str | None:
    marks = [
        next((a.i for a in n.attribute if a.name == "prefill_bf16"), 0)
        for n in model.graph.node
        if n.domain == DOMAIN and n.op_type == "PagedAttention"
    ]
    if not marks:
        return None
    return "bfloat16" if all(marks) else "float32" if not any(marks) else "mixed"


def _numel(tensor) -> int:
    count = 1
    for d in tensor.dims:
        count *= d
    return count


def run(args: argparse.Namespace) -> int:
    summary = inspect_onnx(args.path)
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    console.print(
        f"[bold]{summary['path']}[/]  IR {summary['ir_version']}, opsets "
        + ", ".join(f"{d} {v}" for d, v in summary["opsets"].items())
        + f", {summary['parameters']:,} parameters"
    )
    for title, rows in (("inputs", summary["inputs"]), ("outputs", summary["outputs"])):
        table = Table(title=title, title_justify="left")
        for column in ("name", "dtype", "shape"):
            table.add_column(column)
        for row in rows:
            table.add_row(row["name"], row["dtype"], str(row["shape"]))
        console.print(table)
    weights = summary["weights"]
    if weights:
        console.print(escape(weights_line(weights)))
    if summary["impl"]:
        fired = ", ".join(f"{rule} x{count}" for rule, count in summary["fusions"].items())
        console.print(f"impl: {summary['impl']}; rewrite rules fired: {fired or 'none'}")
    cache_dtype = summary["kv_cache_dtype"]
    if cache_dtype is not None:
        scales = ", with float32 scale caches" if cache_dtype == "int8" else ""
        console.print(
            f"KV cache dtype: {cache_dtype}{scales} (model {summary['metadata'].get('dtype')})"
        )
    if summary["lossless_weights"]:
        widths = ", ".join(f"{n} {w}" for w, n in summary["lossless_weights"].items())
        console.print(f"float32 weights read as their exact codes: {widths} projections")
    if summary["prefill_attention"] not in (None, "float32"):
        console.print(f"prefill attention: {summary['prefill_attention']} (native kernel)")
    console.print(
        f"cache ports: {len(summary['cache_ports'])} (each input bound in place to its _out)"
    )
    table = Table(title="nodes", title_justify="left")
    table.add_column("op")
    table.add_column("count", justify="right")
    for op, count in summary["nodes"].items():
        table.add_row(op, str(count))
    console.print(table)
    if summary["functions"]:
        console.print("function bodies: " + ", ".join(summary["functions"]))
    table = Table(title="metadata", title_justify="left")
    table.add_column("key")
    table.add_column("value", overflow="fold")
    for key, value in summary["metadata"].items():
        table.add_row(key, value)
    console.print(table)
    return 0


def _kernel(weights: dict) -> str:
    """The attnexport op of a quantization with int16 activations (its layers' width)."""
    return "MatMul4Bits" if weights.get("bits") == 4 else "MatMul8Bits"


def weights_line(weights: dict) -> str:
    """The manifest's ``weights`` object in one line (the options an older export did not
    record are left out)."""
    options = [
        f"{weights['bits']} bits",
        f"block size {weights['block_size']}",
        "symmetric" if weights.get("symmetric") else "asymmetric",
    ]
    if "algorithm" in weights:
        options.append(f"algorithm {weights['algorithm']}")
    # int16 activations: attnexport.MatMul8Bits / MatMul4Bits, to which accuracy levels and
    # offsets do not apply
    matmul_8bits = weights.get("activations") == "int16"
    if matmul_8bits and weights.get("decode_activations") == "int8":
        options.append("int8 activations in every call")
    elif matmul_8bits:
        options.append("int16 activations")
        if weights.get("prefill_activations") == "int8":
            options.append("int8 prefill activations")
    else:
        options.append(f"accuracy level {weights.get('accuracy_level')}")
    if "lm_head" in weights:
        head_block = weights.get("lm_head_block_size", weights["block_size"])
        block = f" block size {head_block}" if head_block != weights["block_size"] else ""
        options.append(f"lm_head {weights['lm_head']}{block}")
    if weights.get("algorithm") == "hqq" and "offsets" in weights and not matmul_8bits:
        options.append(f"{weights['offsets']} zero-point offsets")
    if "batch_invariant" in weights:
        options.append("batch-invariant" if weights["batch_invariant"] else "not batch-invariant")
    floats = ", ".join(weights.get("float_layers") or []) or "none"
    return (
        f"weights: {weights['format']} ({_kernel(weights) if matmul_8bits else 'MatMulNBits'}, "
        f"{', '.join(options)}), "
        f"{weights.get('quantized_layers')} layers quantized; float: {floats}"
    )
