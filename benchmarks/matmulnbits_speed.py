"""Time onnxruntime's CPU MatMulNBits and attnexport.MatMul8Bits per weight format and accuracy
level, against float32 MatMul: a chain of ``--pairs`` SmolLM2-135M-shaped MLP projection pairs
([576, 1536] then [1536, 576], random weights) quantized by
``attnexport.lowering.quantize_weights`` (a MatMulNBits with the batch-invariance row: one
decoded token is two rows; MatMul8Bits needs none), run on ``--rows`` activation rows in
alternating rounds; per format the best and median time of one chain and the median of
the rounds' ratios to the first format.

    python benchmarks/matmulnbits_speed.py [--formats NAME ...] [--rows 1 8] [--rounds 10]
        [--threads 2] [--pairs 8]

What it answers: the cost of a format's kernel in isolation (docs/quantization.md quotes it for
accuracy level 1 against level 4), not decode speed (``benchmarks/quality.py --speed-only``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

K, N = 576, 1536

# name -> WeightQuantization keyword arguments (None: the float32 MatMuls)
FORMATS: dict[str, dict | None] = {
    "int8 (default: MatMul8Bits)": {"format": "int8"},
    "int8 rtn, int8 activations": {"format": "int8", "activations": "int8", "symmetric": True},
    "int8, accuracy level 1": {
        "format": "int8",
        "activations": "int8",
        "symmetric": True,
        "accuracy_level": 1,
    },
    "int8 hqq, accuracy level 1": {"format": "int8", "activations": "int8", "accuracy_level": 1},
    "int4 rtn symmetric": {"format": "int4", "algorithm": "rtn", "symmetric": True},
    "int4 rtn asymmetric": {"format": "int4", "algorithm": "rtn", "symmetric": False},
    "int4 hqq (default)": {"format": "int4"},
    "fp32": None,
}


def build_chain(path: Path, pairs: int, seed: int = 0) -> None:
    """An ONNX file of ``pairs`` MatMul pairs ``x[T, K] @ W1[K, N] @ W2[N, K]`` then a Relu
    (so that no projection's output is a graph output: none is taken for the logits head)."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    nodes, weights, x = [], [], "x"
    for i in range(pairs):
        for j, shape in enumerate(((K, N), (N, K))):
            name = f"model.layers.{i}.proj{j}.weight"
            weights.append(
                numpy_helper.from_array((rng.standard_normal(shape) * 0.02).astype("f4"), name)
            )
            nodes.append(helper.make_node("MatMul", [x, name], [f"y{i}_{j}"], name=f"mm{i}_{j}"))
            x = f"y{i}_{j}"
    nodes.append(helper.make_node("Relu", [x], ["out"]))
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", K])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["T", K])],
        weights,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    onnx.save(model, str(path))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", nargs="*", default=list(FORMATS), metavar="NAME")
    parser.add_argument("--rows", nargs="*", type=int, default=[1, 8])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--calls", type=int, default=20, help="chain runs timed per round")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--pairs", type=int, default=8)
    args = parser.parse_args()
    unknown = [f for f in args.formats if f not in FORMATS]
    if unknown:
        parser.error(f"unknown formats {unknown}; choose from {list(FORMATS)}")

    import numpy as np
    import onnxruntime as ort

    from attnexport import ort_kernels
    from attnexport.lowering import WeightQuantization, quantize_weights

    sessions = {}
    with tempfile.TemporaryDirectory() as tmp:
        for index, name in enumerate(args.formats):
            path = Path(tmp) / f"{index}.onnx"
            build_chain(path, args.pairs)
            if FORMATS[name] is not None:
                quantize_weights(path, WeightQuantization(**FORMATS[name]))
            options = ort.SessionOptions()
            options.intra_op_num_threads = args.threads
            ort_kernels.register(options)  # attnexport.MatMul8Bits
            sessions[name] = ort.InferenceSession(
                str(path), options, providers=["CPUExecutionProvider"]
            )
    base = args.formats[0]
    rng = np.random.default_rng(1)
    for rows in args.rows:
        x = rng.standard_normal((rows, K)).astype(np.float32)
        times: dict[str, list[float]] = {name: [] for name in sessions}
        for _ in range(args.rounds):
            for name, session in sessions.items():
                start = time.perf_counter()
                for _ in range(args.calls):
                    session.run(None, {"x": x})
                times[name].append((time.perf_counter() - start) / args.calls)
        print(f"{rows} row(s): one chain of {args.pairs} pairs, ms best / median; x {base}")
        for name, t in times.items():
            ratio = statistics.median(a / b for a, b in zip(t, times[base], strict=True))
            best, median = 1e3 * min(t), 1e3 * statistics.median(t)
            print(f"  {name:28s} {best:8.3f} {median:8.3f}  x{ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
