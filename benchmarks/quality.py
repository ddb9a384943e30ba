"""Quality of every export variant on real weights, against transformers' float32 model and
beside the peers' 4-bit and 8-bit formats: perplexity, top-1 agreement and mean KL divergence,
teacher-forced on the texts of ``benchmarks/texts/`` (their README says where they come from),
with the weight bytes each format reads per decoded token.

The model is SmolLM2-135M-Instruct (``benchmarks/smollm2.py``). Every leg computes the logits of
every position of each text in one forward (ours: one prefill over the paged cache, as
``attnexport verify`` drives it; peers: their own runtime), and the reference is transformers'
float32 ``LlamaForCausalLM`` on the same token ids. Per text: perplexity of the leg and of the
reference (next-token negative log-likelihood of tokens 2..n), top-1 agreement (argmax equal to
the reference's) and mean KL(reference || leg) in nats over every position. The table pools the
texts: perplexity increase is the mean over texts of ``ppl / ppl_fp32 - 1``, top-1 and KL the
means over all positions.

Our variants are ``attnexport export`` flags (:data:`VARIANTS`): each KV-cache dtype is exported
once, and each weight variant is the ``--weights`` quantization (what ``export`` runs after the
lowering) of the float export of its cache dtype. The peers run in their own environments
(``benchmarks/peers.py``): llama.cpp's Q8_0/Q4_0/Q4_K_M GGUF files through llama-cpp-python
(``logits_all``), OpenVINO int8/int4 through optimum-intel's ``OVModelForCausalLM``,
onnxruntime-genai's int8/int4 models (its builder's ONNX file in onnxruntime, one forward).

*Bytes per token* is what the decoder reads of its weights for one decoded token: every weight
but an embedding table only gathered from (a tied table that the logits projection also reads
counts in full). ONNX models are counted on the graph onnxruntime runs (its optimized graph,
saved by the session: a constant folded at load counts at its folded size), by the consumers of
each initializer (a gather's inputs, the scales' copy that onnxruntime folds for a tied
table's GatherBlockQuantized included, are not read in full by a decoded token); GGUF tensors by
name; OpenVINO constants by their consumers. Not counted, for
any ONNX model alike: MLAS's prepacked copy of an int4 MatMulNBits at accuracy level 4 adds a
float per block (its block sums) beside the scales.

    python benchmarks/quality.py [--variants NAME ...] [--peers llamacpp openvino genai]
        [--max-tokens 2048] [--accuracy-levels NAME_PART=LEVEL ...] [--speed] [--json out.json]
        [--write-docs]

``--speed`` also times greedy decoding (tokens/s at batch 1 and 8, prompt 128, 64 new tokens)
of each variant's ONNX model through the Engine, in alternating rounds.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEXTS = ROOT / "benchmarks" / "texts"
BLOCK_SIZE = 16


# name -> `attnexport export` flags; "(default)": what the format's flag alone gives.
def _int4(*flags: str) -> list[str]:
    """4-bit weights through MatMulNBits (int8 activations: the int4 default before
    attnexport.MatMul4Bits), as every int4 variant but the default and those naming int16."""
    return ["--weights", "int4", "--weights-activations", "int8", *flags]


def _rtn(symmetric: bool, block: int) -> list[str]:
    symmetry = "--weights-symmetric" if symmetric else "--weights-asymmetric"
    return _int4("--weights-algorithm", "rtn", symmetry, "--weights-block-size", str(block))


def _fitted(algorithm: str, block: int) -> list[str]:
    return _int4(
        "--weights-algorithm", algorithm, "--weights-asymmetric", "--weights-block-size", str(block)
    )


def _int8_activations(*flags: str) -> list[str]:
    """8-bit weights through MatMulNBits, which rounds the activations to int8 per block."""
    return ["--weights", "int8", "--weights-activations", "int8", *flags]


def _old_int8(*flags: str) -> list[str]:
    """The int8 default before attnexport.MatMul8Bits: rtn, symmetric, int8 activations."""
    return _int8_activations("--weights-algorithm", "rtn", "--weights-symmetric", *flags)


VARIANTS: dict[str, list[str]] = {
    "fp32": [],
    "fp32, fp16 KV cache": ["--kv-cache-dtype", "float16"],
    "fp32, bf16 KV cache": ["--kv-cache-dtype", "bfloat16"],
    "fp32, int8 KV cache": ["--kv-cache-dtype", "int8"],
    # Teacher-forced: every position a prefill's row, its attention in bfloat16 pairs.
    "fp32, bf16 prefill attention": ["--prefill-attention", "bfloat16"],
    "int8 (default)": ["--weights", "int8"],
    "int8 rtn symmetric": ["--weights", "int8", "--weights-symmetric"],
    "int8 rtn asym b32": [
        "--weights",
        "int8",
        "--weights-algorithm",
        "rtn",
        "--weights-asymmetric",
    ],
    **{
        f"int8, block {b}": ["--weights", "int8", "--weights-block-size", str(b)]
        for b in (16, 64, 128)
    },
    "int8, lm_head float": ["--weights", "int8", "--lm-head", "float"],
    "int8, int8 KV cache": ["--weights", "int8", "--kv-cache-dtype", "int8"],
    # Teacher-forced, every position is a prefill's row: what the prompt's tokens get.
    "int8, int8 prefill activations": [
        *("--weights", "int8", "--weights-prefill-activations", "int8"),
    ],
    "int8, block 64, int8 prefill activations, int8 KV cache": [
        *("--weights", "int8", "--weights-block-size", "64", "--kv-cache-dtype", "int8"),
        *("--weights-prefill-activations", "int8"),
    ],
    "int8, block 64, int8 prefill activations, bf16 prefill attention, int8 KV cache": [
        *("--weights", "int8", "--weights-block-size", "64", "--kv-cache-dtype", "int8"),
        *("--weights-prefill-activations", "int8", "--prefill-attention", "bfloat16"),
    ],
    # MatMulNBits' int8 activations: the default before attnexport.MatMul8Bits, and its options.
    "int8 rtn symmetric, int8 activations (the default before)": _old_int8(),
    "int8, int8 activations, accuracy level 1": _old_int8("--weights-accuracy-level", "1"),
    "int8, int8 activations, block 16": _old_int8("--weights-block-size", "16"),
    "int8, int8 activations, block 16, lm_head float": _old_int8(
        "--weights-block-size", "16", "--lm-head", "float"
    ),
    "int8, int8 activations, block 128": _old_int8("--weights-block-size", "128"),
    "int8, int8 activations, lm_head float": _old_int8("--lm-head", "float"),
    "int8, int8 activations, accuracy level 1, lm_head float": _old_int8(
        "--weights-accuracy-level", "1", "--lm-head", "float"
    ),
    "int8, int8 activations, not batch-invariant": _old_int8("--no-weights-batch-invariant"),
    "int8 hqq b32, int8 activations": _int8_activations(),
    "int8 hqq b32, int8 activations, accuracy level 1": _int8_activations(
        "--weights-accuracy-level", "1"
    ),
    "int8 rtn asym b32, int8 activations": _int8_activations(
        "--weights-algorithm", "rtn", "--weights-asymmetric"
    ),
    "int8 rtn asym b32, int8 activations, accuracy level 1": _int8_activations(
        "--weights-algorithm", "rtn", "--weights-asymmetric", "--weights-accuracy-level", "1"
    ),
    "int4 (default)": ["--weights", "int4"],
    "int4, int8 KV cache": ["--weights", "int4", "--kv-cache-dtype", "int8"],
    "int4, int8 prefill activations": [
        *("--weights", "int4", "--weights-prefill-activations", "int8"),
    ],
    "int4, int8 prefill activations, int8 KV cache": [
        *("--weights", "int4", "--weights-prefill-activations", "int8"),
        *("--kv-cache-dtype", "int8"),
    ],
    "int4, int8 prefill activations, bf16 prefill attention, int8 KV cache": [
        *("--weights", "int4", "--weights-prefill-activations", "int8"),
        *("--prefill-attention", "bfloat16", "--kv-cache-dtype", "int8"),
    ],
    "int4, lm_head int4 b32": [
        *("--weights", "int4", "--lm-head", "int4", "--lm-head-block-size", "32"),
    ],
    "int4, int8 activations (the default before)": _int4(),
    **{f"int4 rtn sym b{b}": _rtn(True, b) for b in (16, 32, 64, 128)},
    **{f"int4 rtn asym b{b}": _rtn(False, b) for b in (16, 32, 64, 128)},
    **{f"int4 k_quant b{b}": _fitted("k_quant", b) for b in (32, 64)},
    **{f"int4 hqq b{b}": _fitted("hqq", b) for b in (32, 64, 128)},
    **{
        f"int4 hqq b32, lm_head {head}": [*_fitted("hqq", 32), "--lm-head", head]
        for head in ("float", "int8")
    },
    **{
        f"int4 hqq b{b}, lm_head int4": [*_fitted("hqq", b), "--lm-head", "int4"] for b in (64, 128)
    },
    **{
        f"int4 hqq b{b}, lm_head int4 b{head}": [
            *_fitted("hqq", b),
            *("--lm-head", "int4", "--lm-head-block-size", str(head)),
        ]
        for b, head in ((64, 32), (128, 16))
    },
    # The default before the 8-bit offsets and the head's block of 64, and each change alone
    # (the default's head block is 64 now: a variant of the old head names its block).
    "int4, float32 offsets, lm_head b32": _int4(
        "--weights-offsets", "float32", "--lm-head-block-size", "32"
    ),
    "int4, lm_head int8 b32": _int4("--lm-head-block-size", "32"),
    "int4, lm_head float": _int4("--lm-head", "float"),
    "int4, lm_head int8": _int4("--lm-head", "int8"),
    "int4, lm_head int4": _int4("--lm-head", "int4"),
    "int4, accuracy level 1": _int4("--weights-accuracy-level", "1"),
    "int4, not batch-invariant": _int4("--no-weights-batch-invariant"),
    "int4 rtn sym b32, lm_head int4, not batch-invariant": [
        *_rtn(True, 32),
        "--lm-head",
        "int4",
        "--no-weights-batch-invariant",
    ],
}
# peer -> formats (benchmarks/peers.py names); the first of each precision class is its default.
PEER_FORMATS = {
    "llamacpp": ("q8_0", "q4_0", "q4_k_m"),
    "openvino": ("int8", "int4"),
    "genai": ("int8", "int4"),
}


# ----------------------------------------------------------------------------- texts


def load_texts(checkpoint: Path, max_tokens: int) -> dict[str, list[int]]:
    """``{text name: token ids}`` of every ``benchmarks/texts/*.txt``, each cut to its first
    ``max_tokens`` tokens of the checkpoint's tokenizer (no special tokens)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    return {
        path.stem: tokenizer.encode(path.read_text(), add_special_tokens=False).ids[:max_tokens]
        for path in sorted(TEXTS.glob("*.txt"))
    }


# ----------------------------------------------------------------------------- metrics


def _log_softmax(x):
    import numpy as np

    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def compare(logits, reference, ids: list[int], chunk: int = 128) -> dict:
    """Sums over the positions of one text (float64, ``chunk`` rows at a time): the leg's and
    the reference's next-token NLL (tokens 2..n), argmax agreements, KL(reference || leg) and
    the max abs logit error. :func:`summarize` turns them into rates."""
    import numpy as np

    n = len(ids)
    targets = np.asarray([*ids[1:], 0])
    sums = {"nll": 0.0, "ref_nll": 0.0, "agree": 0, "kl": 0.0, "max_abs": 0.0, "tokens": n}
    for start in range(0, n, chunk):
        rows = slice(start, min(start + chunk, n))
        q = np.asarray(logits[rows], dtype=np.float64)
        p = np.asarray(reference[rows], dtype=np.float64)
        log_q, log_p = _log_softmax(q), _log_softmax(p)
        index = np.arange(rows.stop - rows.start)
        predicted = index + rows.start < n - 1
        sums["nll"] -= float(log_q[index, targets[rows]][predicted].sum())
        sums["ref_nll"] -= float(log_p[index, targets[rows]][predicted].sum())
        sums["agree"] += int((q.argmax(-1) == p.argmax(-1)).sum())
        sums["kl"] += float((np.exp(log_p) * (log_p - log_q)).sum())
        sums["max_abs"] = max(sums["max_abs"], float(np.abs(q - p).max()))
    return sums


def summarize(per_text: dict[str, dict]) -> dict:
    """Rates of one leg from :func:`compare`'s sums per text (module doc)."""
    ppl = {t: math.exp(s["nll"] / (s["tokens"] - 1)) for t, s in per_text.items()}
    ref = {t: math.exp(s["ref_nll"] / (s["tokens"] - 1)) for t, s in per_text.items()}
    tokens = sum(s["tokens"] for s in per_text.values())
    return {
        "ppl": ppl,
        "ppl_fp32": ref,
        "ppl_increase": sum(ppl[t] / ref[t] - 1 for t in ppl) / len(ppl),
        "top1": sum(s["agree"] for s in per_text.values()) / tokens,
        "kl": sum(s["kl"] for s in per_text.values()) / tokens,
        "max_abs": max(s["max_abs"] for s in per_text.values()),
    }


# ----------------------------------------------------------------------------- reference


def reference_logits(checkpoint: Path, texts: dict[str, list[int]], work: Path) -> dict:
    """transformers' float32 logits of each text, saved once as ``work/reference/<text>.npy``
    (float32 [tokens, vocab]); returns ``{text: path}``."""
    out = work / "reference"
    paths = {name: out / f"{name}-{len(ids)}.npy" for name, ids in texts.items()}
    if all(p.exists() for p in paths.values()):
        return paths
    import numpy as np
    import torch
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    model.eval()
    with torch.inference_mode():
        for name, ids in texts.items():
            logits = model(torch.tensor([ids])).logits[0].numpy()
            np.save(paths[name], logits.astype(np.float32))
    del model
    gc.collect()
    return paths


# ----------------------------------------------------------------------------- ours


def _cli(*argv: str) -> None:
    """``attnexport ARGV`` in a child process (an export peaks at ~3.4 GB; it returns it)."""
    code = "import sys; from attnexport.cli import main; sys.exit(main(sys.argv[1:]))"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-c", code, *argv], check=True, env=env, cwd=ROOT)


def _export_args(flags: list[str]):
    """The parsed ``attnexport export`` arguments of ``flags``."""
    from attnexport.cli.main import build_parser

    return build_parser().parse_args(["export", "MODEL", "--out", "OUT", *flags])


def variant_dir(name: str, flags: list[str], checkpoint: Path, work: Path) -> Path:
    """The export directory of variant ``name``: the float export of its KV-cache dtype and
    prefill attention (made once, by the CLI), and for a ``--weights`` variant a copy of it
    quantized as the flags ask (``attnexport.artifact.quantize_export``: what ``export`` does
    after the lowering); cached in ``work``."""
    from attnexport.cli import export_cmd

    args = _export_args(flags)
    bf16 = args.prefill_attention == "bfloat16"
    base = work / "ours" / f"float-kv{args.kv_cache_dtype}{'-pa-bf16' if bf16 else ''}"
    if not (base / "manifest.json").exists():
        kv = [] if args.kv_cache_dtype == "auto" else ["--kv-cache-dtype", args.kv_cache_dtype]
        attention = ["--prefill-attention", "bfloat16"] if bf16 else []
        _cli("export", str(checkpoint), "--out", str(base), "--overwrite", *kv, *attention)
    quantization = export_cmd._weights(args)
    if quantization is None:
        return base
    slug = "".join(c if c.isalnum() else "-" for c in name).strip("-")
    out = work / "ours" / slug
    entry = out / "weights.json"
    expected = json.dumps(quantization.manifest_entry([], 0), sort_keys=True)
    cached = json.loads(entry.read_text()) if entry.exists() else {}
    # (an entry without "base" was made from the float export of its KV-cache dtype)
    made_from = cached.get("base", f"float-kv{args.kv_cache_dtype}")
    if cached.get("options") == expected and made_from == base.name:
        return out
    from attnexport.artifact import quantize_export

    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    manifest = quantize_export(base, out, quantization)
    seconds = time.perf_counter() - start
    entry.write_text(
        json.dumps(
            {
                "options": expected,
                "base": base.name,
                "weights": manifest["weights"],
                "seconds": seconds,
            }
        )
    )
    return out


def with_accuracy_levels(directory: Path, levels: dict[str, int], work: Path) -> Path:
    """A copy of the quantized export ``directory`` in which every MatMulNBits whose weight's
    name contains a key of ``levels`` runs at that ``accuracy_level`` (the first key that
    matches): which projections lose agreement to the activations' int8 quantization, without
    quantizing again. Cached in ``work/relevel``."""
    import onnx

    slug = "-".join(f"{k}={v}" for k, v in levels.items())
    slug = "".join(c if c.isalnum() or c in "=-" else "_" for c in slug)
    out = work / "relevel" / f"{directory.name}--{slug}"
    if (out / "manifest.json").exists():
        return out
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(directory, out, ignore=shutil.ignore_patterns("model.onnx*", "manifest.json"))
    model = onnx.load(str(directory / "model.onnx"))
    changed = 0
    for node in model.graph.node:
        if node.op_type != "MatMulNBits":
            continue
        level = next((v for k, v in levels.items() if k in node.input[1]), None)
        if level is None:
            continue
        for attribute in node.attribute:
            if attribute.name == "accuracy_level":
                attribute.i = level
                changed += 1
    if not changed:
        raise ValueError(f"--accuracy-levels {levels}: no MatMulNBits weight matches")
    onnx.save(
        model, str(out / "model.onnx"), save_as_external_data=True, location="model.onnx.data"
    )
    shutil.copy(directory / "manifest.json", out / "manifest.json")  # last: the cache's mark
    return out


class OursModel:
    """Our export in onnxruntime (native kernels): the logits of every position of a text,
    from one prefill over a paged cache (as ``attnexport verify`` drives it)."""

    def __init__(self, directory: Path, threads: int):
        import onnxruntime as ort

        from attnexport import ort_kernels
        from attnexport.artifact import manifest_cache_spec, read_manifest
        from attnexport.lowering import PagedOrtSession

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        ort_kernels.register(options)
        self.session = PagedOrtSession(directory / "model.onnx", session_options=options)
        self.manifest = read_manifest(directory)
        self.spec = manifest_cache_spec(self.manifest)

    def _run(self, inputs, kv_caches):
        feeds = dict(zip(self.manifest["input_names"], (*inputs, kv_caches), strict=True))
        return next(iter(self.session.run(feeds).values())), kv_caches

    def logits(self, ids: list[int]):
        """``[len(ids), vocab]`` float32 (NumPy)."""
        import torch

        from attnexport.runtime.step_driver import PagedDriver

        blocks = -(-len(ids) // self.spec.block_size) + 2
        driver = PagedDriver(self._run, self.spec, num_blocks=blocks)
        driver.add(ids)
        return torch.as_tensor(driver.prefill(all_logits=True)[0]).numpy()


def onnx_bytes_per_token(path: Path, *, native_kernels: bool = True) -> int:
    """Bytes of the initializers that one decoded token reads in the graph onnxruntime runs
    from the ONNX file at ``path``: the graph after its optimizations (``ORT_ENABLE_ALL``, as
    the Engine's sessions), saved and counted, so that a constant folded at load (a ``Cast``
    of a float16 table becomes a float32 one) counts at the size it has in memory; all but the
    tables only ``Gather``ed from (module doc). ``native_kernels``: register attnexport's
    kernels (our exports; a peer's ONNX file needs none)."""
    import tempfile

    import onnx
    import onnxruntime as ort

    from attnexport import ort_kernels

    with tempfile.TemporaryDirectory() as tmp:
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.log_severity_level = 3  # not its warning that the saved graph is CPU-specific
        options.optimized_model_filepath = str(Path(tmp) / "optimized.onnx")
        options.add_session_config_entry(
            "session.optimized_model_external_initializers_file_name", "optimized.onnx.data"
        )
        options.add_session_config_entry(
            "session.optimized_model_external_initializers_min_size_in_bytes", "1024"
        )
        if native_kernels:
            ort_kernels.register(options)
        ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        model = onnx.load(options.optimized_model_filepath, load_external_data=False)
    return _initializer_bytes_per_token(model)


# The inputs a gather reads only the indexed rows of: Gather's data; GatherBlockQuantized's
# data, scales and zero points (onnxruntime folds the scales' Reshape of a tied quantized table
# into a copy of its own, read by the gather alone).
GATHERED_INPUTS = {"Gather": (0,), "GatherBlockQuantized": (0, 2, 3)}


def _initializer_bytes_per_token(model) -> int:
    """Bytes of ``model``'s initializers but those only read by an embedding gather."""
    import onnx

    readers: dict[str, list] = {}
    for node in model.graph.node:
        for position, name in enumerate(node.input):
            readers.setdefault(name, []).append((node.op_type, position))
    total = 0
    for tensor in model.graph.initializer:
        uses = readers.get(tensor.name, [])
        gathered = uses and all(pos in GATHERED_INPUTS.get(op, ()) for op, pos in uses)
        if gathered:
            continue
        itemsize = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
        total += math.prod(tensor.dims) * itemsize
    return total


# ----------------------------------------------------------------------------- peers


PEER_LOGITS = {
    "llamacpp": """
import json, sys, numpy as np
from llama_cpp import Llama
job = json.loads(sys.argv[1])
llm = Llama(job["model"], n_ctx=job["n_ctx"], logits_all=True, n_threads=job["threads"],
            n_batch=512, verbose=False)
for name, ids in job["texts"].items():
    llm.reset()
    llm.eval(ids)
    np.save(job["out"] + "/" + name + ".npy", np.asarray(llm.scores[: len(ids)], np.float32))
print(json.dumps({"done": True}))
""",
    "openvino": """
import json, sys, numpy as np, torch
from optimum.intel import OVModelForCausalLM
job = json.loads(sys.argv[1])
config = {"INFERENCE_NUM_THREADS": str(job["threads"])}
model = OVModelForCausalLM.from_pretrained(job["model"], ov_config=config)
for name, ids in job["texts"].items():
    mask = torch.ones(1, len(ids), dtype=torch.long)
    out = model(input_ids=torch.tensor([ids]), attention_mask=mask)
    np.save(job["out"] + "/" + name + ".npy", out.logits[0].float().numpy())
print(json.dumps({"done": True}))
""",
    "genai": """
import json, sys, numpy as np, onnxruntime as ort
job = json.loads(sys.argv[1])
options = ort.SessionOptions()
options.intra_op_num_threads = job["threads"]
session = ort.InferenceSession(
    job["model"] + "/model.onnx", options, providers=["CPUExecutionProvider"]
)
decoder = json.load(open(job["model"] + "/genai_config.json"))["model"]["decoder"]
kv_heads, head_size = decoder["num_key_value_heads"], decoder["head_size"]
inputs = {i.name: i for i in session.get_inputs()}
for name, ids in job["texts"].items():
    n = len(ids)
    feeds = {}
    for key, info in inputs.items():
        if key == "input_ids":
            feeds[key] = np.asarray([ids], np.int64)
        elif key == "attention_mask":
            feeds[key] = np.ones((1, n), np.int64)
        elif key == "position_ids":
            feeds[key] = np.arange(n, dtype=np.int64)[None]
        elif key.startswith("past_key_values"):
            dtype = np.float16 if "float16" in info.type else np.float32
            feeds[key] = np.zeros((1, kv_heads, 0, head_size), dtype)
    logits = session.run(["logits"], feeds)[0][0]
    np.save(job["out"] + "/" + name + ".npy", logits.astype(np.float32))
print(json.dumps({"done": True}))
""",
}


def bench_module(name: str):
    """``benchmarks/<name>.py`` as a module, by generate.py's loader (benchmarks/ is not a
    package; this script's directory is on ``sys.path`` when it runs)."""
    import generate

    return generate._bench_module(name)


def peer_bytes_per_token(peer: str, model: Path) -> int | None:
    """Weight bytes one decoded token reads in a peer's model (module doc)."""
    if peer == "genai":
        return onnx_bytes_per_token(model / "model.onnx", native_kernels=False)
    if peer == "llamacpp":
        import gguf

        reader = gguf.GGUFReader(model)
        names = {t.name for t in reader.tensors}
        tied = "output.weight" not in names
        return sum(int(t.n_bytes) for t in reader.tensors if t.name != "token_embd.weight" or tied)
    if peer == "openvino":
        code = """
import json, sys
import openvino as ov
model = ov.Core().read_model(sys.argv[1])
def gathered_only(node):
    for out in node.outputs():
        for target in out.get_target_inputs():
            user = target.get_node()
            kind = user.get_type_name()
            if kind == "Gather" and target.get_index() == 0:
                continue
            if kind in ("Convert", "Subtract", "Multiply", "Reshape") and gathered_only(user):
                continue
            return False
    return True
total = 0
for op in model.get_ops():
    if op.get_type_name() == "Constant" and not gathered_only(op):
        total += op.get_byte_size()
print(json.dumps({"bytes": total}))
"""
        xml = next(model.glob("*.xml"))
        return bench_module("peers").run_json("openvino", code, args=[str(xml)])["bytes"]
    return None


def peer_leg(peer: str, fmt: str, checkpoint: Path, texts, references, work: Path, threads):
    """One peer format's quality row (or ``{"skipped": reason}``)."""
    import numpy as np

    peers = bench_module("peers")
    reason = peers.unavailable_reason(peer)
    if reason is None:
        try:
            peers.make_venv(peer)
            model = peers.model_path(peer, fmt, checkpoint, threads=threads)
        except peers.PeerUnavailable as error:
            reason = str(error)
    if reason is not None:
        return {"skipped": reason}
    out = work / "peer-logits" / f"{peer}-{fmt}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    job = {
        "model": str(model),
        "texts": texts,
        "out": str(out),
        "threads": threads,
        "n_ctx": max(len(ids) for ids in texts.values()) + 16,
    }
    peers.run_json(peer, PEER_LOGITS[peer], args=[json.dumps(job)])
    per_text = {}
    for name, ids in texts.items():
        logits = np.load(out / f"{name}.npy", mmap_mode="r")
        per_text[name] = compare(logits, np.load(references[name], mmap_mode="r"), ids)
    shutil.rmtree(out)
    return summarize(per_text) | {
        "bytes_per_token": peer_bytes_per_token(peer, Path(model)),
        "versions": peers.versions(peer),
    }


# ----------------------------------------------------------------------------- speed


def decode_speed(directories: dict[str, Path], threads: int, rounds: int) -> dict:
    """Greedy decode tokens/s at batch 1 and 8 (prompt 128, 64 new tokens) of each model,
    through the Engine and OrtExecutor, in ``rounds`` alternating rounds; best and median."""
    import numpy as np

    from attnexport.runtime import CacheConfig, Engine, OrtExecutor, SamplingParams, SchedulerConfig

    prompt, new = 128, 64
    engines = {}
    for name, directory in directories.items():
        executor = OrtExecutor(directory / "model.onnx", num_threads=threads)
        engines[name] = Engine(
            executor,
            CacheConfig(num_blocks=8 * -(-(prompt + new) // BLOCK_SIZE) + 8),
            SchedulerConfig(
                max_num_seqs=8, max_num_batched_tokens=8 * prompt, max_model_len=prompt + new
            ),
        )
    times: dict[str, dict[int, list[float]]] = {n: {1: [], 8: []} for n in engines}
    rng = np.random.default_rng(0)
    for _ in range(rounds):
        for batch in (1, 8):
            prompts = rng.integers(3, 49000, size=(batch, prompt)).tolist()
            for name, engine in engines.items():
                params = SamplingParams(max_tokens=new)
                outputs = engine.generate(prompts, params)
                first = max(o.metrics.first_token_time for o in outputs)
                end = max(o.metrics.finish_time for o in outputs)
                times[name][batch].append(batch * (new - 1) / (end - first))
    return {
        name: {f"batch {b}": {"best": max(v), "median": float(np.median(v))} for b, v in t.items()}
        for name, t in times.items()
    }


# ----------------------------------------------------------------------------- report


def table(results: dict) -> list[str]:
    lines = [
        "| variant | bytes/token (MB) | perplexity increase | top-1 agreement | mean KL (nats) "
        "| " + " | ".join(f"ppl {t}" for t in results["texts"]) + " |",
        "|---|---|---|---|---|" + "---|" * len(results["texts"]),
    ]
    reference = results["reference_ppl"]
    lines.append(
        "| transformers fp32 (reference) | | 0 | 1 | 0 | "
        + " | ".join(f"{reference[t]:.3f}" for t in results["texts"])
        + " |"
    )
    for name, row in results["legs"].items():
        if "skipped" in row or "error" in row:
            lines.append(f"| {name} | {(row.get('skipped') or row.get('error'))[:80]} | | | | |")
            continue
        size = row.get("bytes_per_token")
        lines.append(
            f"| {name} | {size / 1e6:.1f} | {100 * row['ppl_increase']:+.2f}% | "
            f"{row['top1']:.4f} | {row['kl']:.2e} | "
            + " | ".join(f"{row['ppl'][t]:.3f}" for t in results["texts"])
            + " |"
            if size
            else f"| {name} | ? | {100 * row['ppl_increase']:+.2f}% | {row['top1']:.4f} | "
            f"{row['kl']:.2e} | "
            + " | ".join(f"{row['ppl'][t]:.3f}" for t in results["texts"])
            + " |"
        )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), metavar="NAME")
    parser.add_argument("--peers", nargs="*", default=list(PEER_FORMATS), metavar="PEER")
    parser.add_argument("--max-tokens", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work", type=Path, default=ROOT / "out" / "bench_quality")
    parser.add_argument("--speed", action="store_true", help="also time greedy decoding")
    parser.add_argument(
        "--speed-only", action="store_true", help="only time greedy decoding of the variants"
    )
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of --speed")
    parser.add_argument(
        "--accuracy-levels",
        nargs="*",
        default=[],
        metavar="NAME_PART=LEVEL",
        help="score copies of the variants whose MatMulNBits with a weight name containing "
        "NAME_PART run at accuracy_level LEVEL (e.g. qkv_proj=1; embed_tokens is the tied head)",
    )
    parser.add_argument("--json", type=Path, help="also write the results as JSON here")
    parser.add_argument("--write-docs", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args()
    try:
        args.accuracy_levels = {
            part: int(level) for part, level in (a.split("=") for a in args.accuracy_levels)
        }
    except ValueError:
        parser.error("--accuracy-levels: expected NAME_PART=LEVEL ...")
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")

    import numpy as np

    checkpoint = bench_module("smollm2").build_checkpoint()
    if args.speed_only:
        directories = {
            name: variant_dir(name, VARIANTS[name], checkpoint, args.work) for name in args.variants
        }
        speed = decode_speed(directories, args.threads, args.rounds)
        print(json.dumps(speed, indent=1))
        if args.json:
            args.json.write_text(json.dumps({"speed": speed}, indent=1))
        return 0
    texts = load_texts(checkpoint, args.max_tokens)
    references = reference_logits(checkpoint, texts, args.work)
    reference_ppl = {}
    for name, ids in texts.items():
        ref = np.load(references[name], mmap_mode="r")
        sums = compare(ref, ref, ids)
        reference_ppl[name] = math.exp(sums["ref_nll"] / (len(ids) - 1))
    results = {
        "texts": list(texts),
        "tokens": {name: len(ids) for name, ids in texts.items()},
        "reference_ppl": reference_ppl,
        "legs": {},
    }
    directories = {}
    for name in args.variants:
        print(f"ours {name} ...", file=sys.stderr, flush=True)
        flags = VARIANTS[name]
        directory = variant_dir(name, flags, checkpoint, args.work)
        if args.accuracy_levels:
            directory = with_accuracy_levels(directory, args.accuracy_levels, args.work)
            name = f"{name}, accuracy levels {args.accuracy_levels}"
        directories[name] = directory
        model, per_text = OursModel(directory, args.threads), {}
        for text, ids in texts.items():
            logits = model.logits(ids)
            per_text[text] = compare(logits, np.load(references[text], mmap_mode="r"), ids)
            del logits
        del model
        gc.collect()
        results["legs"][f"ours {name}"] = summarize(per_text) | {
            "bytes_per_token": onnx_bytes_per_token(directory / "model.onnx"),
            "flags": flags,
        }
        print(json.dumps(results["legs"][f"ours {name}"]), file=sys.stderr, flush=True)
    for peer in args.peers:
        for fmt in PEER_FORMATS[peer]:
            print(f"{peer} {fmt} ...", file=sys.stderr, flush=True)
            try:
                row = peer_leg(peer, fmt, checkpoint, texts, references, args.work, args.threads)
            except Exception as error:  # a peer's failure is a row, not the end of the run
                row = {"error": f"{type(error).__name__}: {error}"}
            results["legs"][f"{peer} {fmt}"] = row
            print(json.dumps(row), file=sys.stderr, flush=True)
    if args.speed:
        results["speed"] = decode_speed(directories, args.threads, args.rounds)
    lines = table(results)
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if args.write_docs:
        bench_module("generate").write_docs(lines, title="## Quality on real weights (CPU)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
