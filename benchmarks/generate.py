"""Generation benchmark on CPU: decode tokens/s and time to first token of a ~125M Llama-like
model (random weights, seed 0) for

* ``ort``        attnexport's OrtExecutor on the model exported with ``to_onnx``
                 (its defaults: native kernels, spinning worker threads as in onnxruntime and
                 onnxruntime-genai; ``ort-nospin``: threads that do not spin, for shared
                 cores; ``ort-bodies``: the attnexport nodes' standard-op bodies instead of the
                 native kernels; ``ort-int4`` / ``ort-int8``: the same export with int4 / int8
                 weights, ``attnexport export --weights int4|int8`` defaults: MatMulNBits,
                 block size 32, symmetric, accuracy level 4, lm_head quantized),
* ``torch-sdpa`` attnexport's TorchExecutor (eager, sdpa backend),
* ``torch-ipex`` attnexport's TorchExecutor on the ipex backend (run with ``--ipex-python``),
* ``hf``         Hugging Face transformers ``generate`` (eager, its own contiguous cache),
* ``genai``      onnxruntime-genai on the model its builder makes from the same checkpoint
                 (run with ``--genai-python``, an interpreter that has ``onnxruntime_genai``;
                 ``genai-int4``: its builder's ``-p int4 -e cpu``, what its CPU users deploy),

at batch 1/8/32 (prompt 128 tokens, 128 new tokens, greedy, ``--threads`` threads), plus the KV
memory the paged cache allocates for a batch of mixed lengths against onnxruntime-genai's
contiguous cache. ``--kv-cache-dtype auto int8`` (one or more of auto, float32, float16,
bfloat16, int8) exports the ort legs' model with caches of each dtype (``attnexport export
--kv-cache-dtype``; ``auto`` is the model's float32) and runs every ort leg once per dtype,
alternating in the same run (legs named e.g. ``ort-int4 kv=int8``), e.g. with ``--prompt-len
2048`` where the cache dominates.
Every leg runs in its own process; all legs of one invocation share the
machine in turn, so ratios between them are comparable. ``--quick`` is a smoke test on a tiny
model.

``--quality`` adds what the quantized legs cost in accuracy: every ONNX leg (ours and
onnxruntime-genai's) computes teacher-forced next-token logits of the same fixed prompts, compared
with transformers' float32 model: top-1 agreement, mean KL(fp32 || leg) and the largest logit
error.

    python benchmarks/generate.py --genai-python /path/to/venv/bin/python \\
        --ipex-python .venv-ipex/bin/python --write-docs
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FULL_CONFIG = {
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "vocab_size": 32000,
}
QUICK_CONFIG = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
}
LEGS = (
    "ort",
    "ort-int4",
    "ort-int8",
    "ort-nospin",
    "ort-bodies",
    "torch-sdpa",
    "torch-ipex",
    "hf",
    "genai",
    "genai-int4",
)
GENAI_PRECISION = {"genai": "fp32", "genai-int4": "int4"}
BLOCK_SIZE = 16
# Room for the long-context row (prompt 2048 + new tokens); also the contiguous cache length
# onnxruntime-genai allocates by default (its context_length), as the memory row says.
MAX_POSITIONS = 4096
# The quality pass: teacher-forced logits of every position of these prompts.
QUALITY_PROMPTS, QUALITY_LENGTH, QUALITY_SEED = 4, 128, 7
QUALITY_LEGS = ("ort", "ort-int4", "ort-int8", "genai", "genai-int4")
# The mixed batch of the memory comparison: prompt lengths, each followed by 32 new tokens.
MIXED_PROMPTS = (37, 512, 100, 1000, 250, 64, 700, 180)
MIXED_NEW = 32


# ----------------------------------------------------------------------------- preparation


def make_checkpoint(directory: Path, quick: bool) -> None:
    """A transformers LlamaForCausalLM with random weights (seed 0) and a WordLevel tokenizer
    (onnxruntime-genai's builder insists on one)."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    config = transformers.LlamaConfig(
        **(QUICK_CONFIG if quick else FULL_CONFIG),
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    vocab = {f"t{i}": i for i in range(config.vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="t0", bos_token="t1", eos_token="t2"
    ).save_pretrained(directory)


def export_onnx(checkpoint: Path, path: Path, kv_cache_dtype: str = "auto") -> float:
    """Our ONNX export of the checkpoint (caches of ``kv_cache_dtype``); returns the seconds
    it took."""
    import torch

    from attnexport.lowering import to_onnx
    from attnexport.models import load_model

    model = load_model(checkpoint)
    cache_dtype = None if kv_cache_dtype == "auto" else getattr(torch, kv_cache_dtype)
    sample = model.export_sample(BLOCK_SIZE, cache_dtype)
    start = time.perf_counter()
    to_onnx(
        model,
        sample.args,
        path,
        dynamic_shapes=sample.dynamic_shapes,
        output_names=["logits"],
        cache_spec=model.cache_spec(BLOCK_SIZE, cache_dtype),
        metadata={"max_position_embeddings": str(MAX_POSITIONS)},
    )
    return time.perf_counter() - start


def quantize_onnx(float_path: Path, path: Path, fmt: str) -> float:
    """Our export with ``fmt`` (int4/int8) weights, made from the float one; returns the
    seconds the quantization took."""
    import shutil

    from attnexport.lowering import WeightQuantization, quantize_weights

    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(float_path, path)
    start = time.perf_counter()
    quantize_weights(path, WeightQuantization(fmt))
    return time.perf_counter() - start


def build_genai(python: str, checkpoint: Path, out: Path, threads: int, precision: str) -> None:
    """onnxruntime-genai's builder on the checkpoint (``-p precision -e cpu``, its defaults
    otherwise), with ``threads`` intra-op threads."""
    builder = [python, "-m", "onnxruntime_genai.models.builder"]
    subprocess.run(
        [*builder, "-i", str(checkpoint), "-o", str(out), "-p", precision, "-e", "cpu"],
        check=True,
        capture_output=True,
    )
    config_path = out / "genai_config.json"
    config = json.loads(config_path.read_text())
    options = config["model"]["decoder"]["session_options"]
    options["intra_op_num_threads"], options["inter_op_num_threads"] = threads, 1
    config_path.write_text(json.dumps(config, indent=1))


# ----------------------------------------------------------------------------- legs


def _prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import numpy as np

    return np.random.default_rng(seed).integers(3, vocab, size=(batch, length)).tolist()


def _engine_leg(args, executor) -> dict:
    from attnexport.runtime import CacheConfig, Engine, SamplingParams, SchedulerConfig

    length = args.prompt_len + args.new_tokens
    blocks = args.batch * -(-length // BLOCK_SIZE)
    engine = Engine(
        executor,
        CacheConfig(num_blocks=blocks + 8, enable_prefix_caching=False),
        SchedulerConfig(
            max_num_seqs=max(args.batch, 1),
            max_num_batched_tokens=args.batch * args.prompt_len,
            max_model_len=length,
        ),
    )
    params = SamplingParams(max_tokens=args.new_tokens)
    engine.generate(_prompts(args.batch, args.prompt_len, args.vocab, 1), SamplingParams(4))
    start = time.perf_counter()
    outputs = engine.generate(_prompts(args.batch, args.prompt_len, args.vocab, 0), params)
    end = time.perf_counter()
    first = max(o.metrics.first_token_time for o in outputs)
    assert all(len(o.token_ids) == args.new_tokens for o in outputs)
    return {
        **rates(args.batch, args.new_tokens, start, first, end),
        "describe": engine.executor.describe(),
        "first_tokens": list(outputs[0].token_ids),
    }


def ours_dir(args, weights: str = "") -> Path:
    """The directory of our export: ``ours``, with ``-<weights>`` and ``-kv<cache dtype>``."""
    kv = "" if args.kv_cache_dtype == "auto" else f"-kv{args.kv_cache_dtype}"
    return args.work / f"ours{'-' + weights if weights else ''}{kv}"


def leg_ort(args, spin: bool = True, kernels: str = "native", weights: str = "") -> dict:
    from attnexport.runtime import OrtExecutor

    kv = args.kv_cache_dtype
    path = ours_dir(args, weights) / "model.onnx"
    executor = OrtExecutor(path, num_threads=args.threads, spin=spin, kernels=kernels)
    result = _engine_leg(args, executor)
    del result["first_tokens"]
    return result | {"kernels": executor.kernels, "kv_cache_dtype": kv}


def leg_ours(args) -> dict:
    """Our OrtExecutor (its defaults) on the export directory ``args.artifact`` (the real
    model's benchmark, benchmarks/generate_smollm2.py), with this process's peak RSS."""
    import resource

    from attnexport.runtime import OrtExecutor

    executor = OrtExecutor(Path(args.artifact) / "model.onnx", num_threads=args.threads)
    result = _engine_leg(args, executor)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return result | {"peak_rss_mb": peak}


def leg_torch(args, backend: str) -> dict:
    from attnexport.custom_ops import registered_backends
    from attnexport.models import load_model
    from attnexport.runtime import TorchExecutor

    if backend not in {b.name for b in registered_backends()}:
        return {"skipped": f"the {backend} backend is not registered in this build"}
    model = load_model(args.work / "ckpt")
    result = _engine_leg(args, TorchExecutor(model, backend=backend, block_size=BLOCK_SIZE))
    del result["first_tokens"]
    return result


def timed_hf_generate(model, prompts: list[list[int]], new: int, **kwargs) -> dict:
    """One greedy ``model.generate`` of ``new`` tokens: its time to first token and decode
    tokens/s, both from the same run (the first token is timed by a stopping criterion, which
    transformers calls once per generated token). Two separately timed runs, subtracted, gave
    a negative rate when the longer run happened to be the faster one."""
    import torch
    import transformers

    class FirstToken(transformers.StoppingCriteria):
        time: float | None = None

        def __call__(self, input_ids, scores, **_):
            if self.time is None:
                self.time = time.perf_counter()
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    first = FirstToken()
    ids = torch.tensor(prompts)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids,
            max_new_tokens=new,
            min_new_tokens=new,
            stopping_criteria=transformers.StoppingCriteriaList([first]),
            **kwargs,
        )
    end = time.perf_counter()
    if out.shape[1] - ids.shape[1] != new or first.time is None:
        raise RuntimeError(f"hf: expected {new} new tokens, got {out.shape[1] - ids.shape[1]}")
    return rates(len(prompts), new, start, first.time, end)


def rates(batch: int, new: int, start: float, first: float, end: float) -> dict:
    """``ttft_s`` and ``decode_tok_s`` of one run that started at ``start``, produced its
    first token at ``first`` and its ``new``-th at ``end`` (one clock)."""
    if new < 2:
        raise ValueError(f"new: decode speed needs at least 2 new tokens, got {new}")
    if not start <= first < end:
        raise ValueError(f"times out of order: start {start}, first token {first}, end {end}")
    return {"ttft_s": first - start, "decode_tok_s": batch * (new - 1) / (end - first)}


def leg_hf(args) -> dict:
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(args.work / "ckpt").eval()
    kwargs = {"do_sample": False, "pad_token_id": 2}
    timed_hf_generate(model, _prompts(args.batch, args.prompt_len, args.vocab, 1), 4, **kwargs)
    prompts = _prompts(args.batch, args.prompt_len, args.vocab, 0)
    return {
        **timed_hf_generate(model, prompts, args.new_tokens, **kwargs),
        "describe": f"transformers {transformers.__version__} eager",
    }


def leg_genai(args, name: str = "genai") -> dict:
    """onnxruntime-genai's model ``name`` (built by build_genai): benchmarks/peer_legs.py's leg,
    on this benchmark's prompts."""
    request = {
        "model": str(args.work / name),
        "prompts": _prompts(args.batch, args.prompt_len, args.vocab, 0),
        "warmup_prompts": _prompts(args.batch, args.prompt_len, args.vocab, 1),
        "new_tokens": args.new_tokens,
    }
    result = _bench_module("peer_legs").leg_genai(request)
    del result["first_tokens"]
    return result


def leg_memory(args) -> dict:
    """Peak KV blocks the paged engine holds for the mixed batch vs the tokens it stores."""
    from attnexport.runtime import CacheConfig, Engine, OrtExecutor, SamplingParams, SchedulerConfig

    executor = OrtExecutor(ours_dir(args) / "model.onnx", num_threads=args.threads)
    prompts = [_prompts(1, n, args.vocab, i)[0] for i, n in enumerate(MIXED_PROMPTS)]
    engine = Engine(
        executor,
        CacheConfig(num_blocks=MAX_POSITIONS // BLOCK_SIZE * 4, enable_prefix_caching=False),
        SchedulerConfig(max_num_batched_tokens=4096, max_model_len=MAX_POSITIONS),
    )
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(max_tokens=MIXED_NEW))
    peak = {"bytes_in_use": 0}
    while engine.has_unfinished_requests():
        engine.step()
        usage = engine.kv_cache_usage()
        if usage["bytes_in_use"] > peak["bytes_in_use"]:
            peak = usage
    spec = executor.cache_spec
    per_token = spec.bytes_per_block // spec.block_size
    longest = max(MIXED_PROMPTS) + MIXED_NEW
    return {
        "per_token_bytes": per_token,
        "tokens_stored": peak["tokens_stored"],
        "paged_bytes": peak["bytes_in_use"],
        "genai_bytes_longest": len(MIXED_PROMPTS) * longest * per_token,
        "genai_bytes_default": len(MIXED_PROMPTS) * MAX_POSITIONS * per_token,
    }


def run_leg(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    legs = {
        "ort": leg_ort,
        "ort-nospin": lambda a: leg_ort(a, spin=False),
        "ort-bodies": lambda a: leg_ort(a, kernels="bodies"),
        "ort-int4": lambda a: leg_ort(a, weights="int4"),
        "ort-int8": lambda a: leg_ort(a, weights="int8"),
        "torch-sdpa": lambda a: leg_torch(a, "sdpa"),
        "torch-ipex": lambda a: leg_torch(a, "ipex"),
        "hf": leg_hf,
        "genai": leg_genai,
        "genai-int4": lambda a: leg_genai(a, "genai-int4"),
        "memory": leg_memory,
        "ours": leg_ours,
        "quality-hf": quality_hf,
        "quality-ort": quality_ort,
        "quality-ort-int4": lambda a: quality_ort(a, "int4"),
        "quality-ort-int8": lambda a: quality_ort(a, "int8"),
        "quality-genai": lambda a: quality_genai(a, "genai"),
        "quality-genai-int4": lambda a: quality_genai(a, "genai-int4"),
    }
    return legs[args.leg](args)


# ----------------------------------------------------------------------------- quality


def _quality_prompts(vocab: int) -> list[list[int]]:
    return _prompts(QUALITY_PROMPTS, QUALITY_LENGTH, vocab, QUALITY_SEED)


def _save_logits(args, leg: str, logits) -> dict:
    """Writes ``logits`` [prompts * length, vocab] float32 for the driver to compare."""
    import numpy as np

    path = args.work / "quality" / f"{leg}.npy"
    path.parent.mkdir(parents=True, exist_ok=True)
    np.save(path, np.asarray(logits, dtype=np.float32))
    return {"logits": str(path)}


def quality_hf(args) -> dict:
    """The reference: transformers' float32 model, one forward per prompt."""
    import torch
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(args.work / "ckpt").eval()
    with torch.inference_mode():
        logits = [model(torch.tensor([p])).logits[0] for p in _quality_prompts(args.vocab)]
    return _save_logits(args, "hf", torch.cat(logits).numpy())


def quality_ort(args, weights: str = "") -> dict:
    """Our ONNX model (native kernels): the logits of every prompt position from one prefill
    over a paged cache (attnexport.runtime.step_driver, as ``attnexport verify`` drives it)."""
    import onnxruntime as ort
    import torch

    from attnexport import ort_kernels
    from attnexport.lowering import PagedOrtSession
    from attnexport.models import load_model
    from attnexport.runtime.step_driver import PagedDriver

    model = load_model(args.work / "ckpt")
    sample = model.export_sample(block_size=BLOCK_SIZE)
    kv = args.kv_cache_dtype
    spec = model.cache_spec(BLOCK_SIZE, None if kv == "auto" else getattr(torch, kv))
    options = ort.SessionOptions()
    options.intra_op_num_threads = args.threads
    ort_kernels.register(options)
    path = ours_dir(args, weights) / "model.onnx"
    session = PagedOrtSession(path, session_options=options)

    def runner(inputs, kv_caches):
        feeds = dict(zip(sample.input_names, (*inputs, kv_caches), strict=True))
        outputs = session.run(feeds)
        return next(iter(outputs.values())), kv_caches

    prompts = _quality_prompts(args.vocab)
    blocks = len(prompts) * -(-QUALITY_LENGTH // BLOCK_SIZE) + 4
    driver = PagedDriver(runner, spec, num_blocks=blocks)
    for prompt in prompts:
        driver.add(prompt)
    logits = driver.prefill(all_logits=True)
    logits = torch.cat([logits[i] for i in sorted(logits)])
    return _save_logits(args, ours_dir(args, weights).name, logits)


def quality_genai(args, name: str) -> dict:
    """onnxruntime-genai's model: teacher-forced one token at a time (its generator returns
    the logits of the last appended token)."""
    import numpy as np
    import onnxruntime_genai as og

    model = og.Model(str(args.work / name))
    rows = []
    for prompt in _quality_prompts(args.vocab):
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=QUALITY_LENGTH + 1, do_sample=False, batch_size=1)
        generator = og.Generator(model, params)
        for token in prompt:
            generator.append_tokens(np.asarray([[token]], dtype=np.int32))
            rows.append(np.asarray(generator.get_logits(), dtype=np.float32).reshape(-1))
    return _save_logits(args, name, np.stack(rows))


def compare_logits(leg_path: str, reference_path: str) -> dict:
    """Top-1 agreement, mean KL(reference || leg) in nats and max abs logit error of one
    leg's quality logits against the reference's."""
    import numpy as np

    logits = np.load(leg_path).astype(np.float64)
    reference = np.load(reference_path).astype(np.float64)
    if logits.shape != reference.shape:
        return {"error": f"logits {logits.shape} vs reference {reference.shape}"}

    def log_softmax(x):
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    log_p, log_q = log_softmax(reference), log_softmax(logits)
    return {
        "top1_agreement": float((logits.argmax(-1) == reference.argmax(-1)).mean()),
        "kl": float((np.exp(log_p) * (log_p - log_q)).sum(-1).mean()),
        "max_abs": float(np.abs(logits - reference).max()),
    }


def _quality_lines(quality: dict) -> list[str]:
    lines = [
        f"Quality against transformers' float32 model: teacher-forced next-token logits of "
        f"{QUALITY_PROMPTS} prompts x {QUALITY_LENGTH} tokens (seed {QUALITY_SEED}).",
        "",
        "| executor | top-1 agreement | mean KL (nats) | max abs logit error |",
        "|---|---|---|---|",
    ]
    for leg, q in quality.items():
        if "kl" in q:
            lines.append(
                f"| {leg} | {q['top1_agreement']:.4f} | {q['kl']:.2e} | {q['max_abs']:.4f} |"
            )
        else:
            lines.append(f"| {leg} | {(q.get('skipped') or q.get('error') or '')[:60]} | | |")
    return lines


# ----------------------------------------------------------------------------- driver


def _python_for(leg: str, args) -> str | None:
    if leg == "torch-ipex":
        return args.ipex_python
    if leg.removeprefix("quality-") in GENAI_PRECISION:
        return args.genai_python
    return sys.executable


def _spawn(leg: str, python: str, args, batch: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), TORCHINDUCTOR_COMPILE_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    command = [python, str(Path(__file__).resolve()), "--leg", leg, "--work", str(args.work)]
    command += ["--batch", str(batch), "--threads", str(args.threads), "--vocab", str(args.vocab)]
    command += ["--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens)]
    command += ["--kv-cache-dtype", args.kv_cache_dtype]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        return {"error": lines[-1] if lines else f"exit {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _table(results: dict, batches: list[int]) -> list[str]:
    header = "| executor | " + " | ".join(
        f"batch {b} decode tok/s | batch {b} TTFT s" for b in batches
    )
    lines = [header + " |", "|---" * (1 + 2 * len(batches)) + "|"]
    for leg, per_batch in results.items():
        cells = []
        for b in batches:
            r = per_batch.get(b, {})
            if "decode_tok_s" in r:
                cells += [f"{r['decode_tok_s']:.1f}", f"{r['ttft_s']:.3f}"]
            else:
                note = r.get("skipped") or r.get("error") or "not run"
                cells += [note[:60], ""]
        lines.append(f"| {leg} | " + " | ".join(cells) + " |")
    return lines


def _memory_lines(memory: dict) -> list[str]:
    if "paged_bytes" not in memory:
        return [f"KV memory comparison not run: {memory.get('error', memory)}"]
    stored = memory["tokens_stored"] * memory["per_token_bytes"]

    def row(name, allocated):
        over = 100 * (allocated / stored - 1)
        return f"| {name} | {allocated / 2**20:.1f} | {stored / 2**20:.1f} | {over:+.1f}% |"

    lengths = ", ".join(str(n) for n in MIXED_PROMPTS)
    return [
        f"KV memory for a batch of {len(MIXED_PROMPTS)} prompts ({lengths} tokens) each "
        f"generating {MIXED_NEW} tokens, at the peak (block size {BLOCK_SIZE}):",
        "",
        "| cache | allocated MiB | tokens stored MiB | overhead |",
        "|---|---|---|---|",
        row("attnexport paged (blocks in use)", memory["paged_bytes"]),
        row("contiguous, max length = longest sequence", memory["genai_bytes_longest"]),
        row(
            f"contiguous, max length = {MAX_POSITIONS} (genai default)",
            memory["genai_bytes_default"],
        ),
    ]


def _genai_python() -> str:
    peers = _bench_module("peers")
    return (
        str(peers.venv_python("genai")) if not peers.unavailable_reason("genai") else sys.executable
    )


def _bench_module(name: str):
    """A sibling script of benchmarks/ as a module (benchmarks/ is not a package)."""
    import importlib.util

    key = f"attnexport_bench_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, ROOT / "benchmarks" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


def write_docs(lines: list[str], title: str = "## Generation (CPU)") -> None:
    """Replaces (or appends) the section ``title`` of docs/benchmarks.md (up to the next
    ``## `` heading) with ``lines``."""
    path = ROOT / "docs" / "benchmarks.md"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    section = "\n".join([title, "", *lines]) + "\n"
    if title in text:
        start = text.index(title)
        following = text.find("\n## ", start + len(title))
        text = text[:start] + section + (text[following + 1 :] if following >= 0 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


def main() -> int:
    from attnexport.model_interface import KV_CACHE_DTYPES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        choices=("llama125m", "smollm2"),
        default="llama125m",
        help="llama125m: the random-weight ~125M Llama (the legs above); smollm2: the real "
        "SmolLM2-135M-Instruct against the CPU peers (benchmarks/generate_smollm2.py)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny model, batch 1 and 2")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument(
        "--kv-cache-dtype",
        nargs="+",
        choices=KV_CACHE_DTYPES,
        default=["auto"],
        help="KV cache dtype(s) of the ort legs' export (default auto: the model's float32); "
        "with several, every ort leg runs once per dtype, alternating in the same run",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=1, help="runs per leg; the best counts")
    parser.add_argument("--legs", nargs="+", default=list(LEGS), choices=LEGS)
    parser.add_argument("--work", type=Path, default=ROOT / "out" / "bench_generate")
    parser.add_argument("--ipex-python", default=str(ROOT / ".venv-ipex" / "bin" / "python"))
    parser.add_argument(
        "--genai-python",
        default=_genai_python(),
        help="an interpreter with onnxruntime_genai (default: the genai environment of "
        "benchmarks/peers.py when it is ready, else this one)",
    )
    parser.add_argument("--json", type=Path, help="also write the results as JSON here")
    parser.add_argument(
        "--quality", action="store_true", help="also compare the ONNX legs' logits with fp32"
    )
    parser.add_argument("--write-docs", action="store_true", help="update docs/benchmarks.md")
    # Internal: run one leg in this process and print its JSON result.
    parser.add_argument("--leg", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--artifact", help=argparse.SUPPRESS)
    parser.add_argument(
        "--vocab", type=int, default=FULL_CONFIG["vocab_size"], help=argparse.SUPPRESS
    )
    chosen, _ = parser.parse_known_args()
    if chosen.model == "smollm2" and not chosen.leg:
        return _bench_module("generate_smollm2").main(sys.argv[1:])
    args = parser.parse_args()
    kv_cache_dtypes, args.kv_cache_dtype = args.kv_cache_dtype, args.kv_cache_dtype[0]
    if args.leg:
        print(json.dumps(run_leg(args)))
        return 0

    if args.quick:
        args.batches, args.prompt_len, args.new_tokens = [1, 2], 16, 8
    args.vocab = (QUICK_CONFIG if args.quick else FULL_CONFIG)["vocab_size"]
    args.work = args.work / ("quick" if args.quick else "full")
    checkpoint = args.work / "ckpt"
    if not (checkpoint / "config.json").exists():
        print(f"checkpoint -> {checkpoint}", file=sys.stderr)
        make_checkpoint(checkpoint, args.quick)
    legs = list(args.legs)
    for args.kv_cache_dtype in kv_cache_dtypes:
        if not (ours_dir(args) / "model.onnx").exists():
            seconds = export_onnx(checkpoint, ours_dir(args) / "model.onnx", args.kv_cache_dtype)
            print(f"to_onnx (kv {args.kv_cache_dtype}): {seconds:.1f} s", file=sys.stderr)
        for fmt in ("int4", "int8"):
            quantized = ours_dir(args, fmt) / "model.onnx"
            if f"ort-{fmt}" in legs and not quantized.exists():
                seconds = quantize_onnx(ours_dir(args) / "model.onnx", quantized, fmt)
                print(f"quantize {fmt}: {seconds:.1f} s", file=sys.stderr)
    # (leg, KV cache dtype) pairs: the ort legs once per dtype, the others once.
    runs = [
        (leg, kv)
        for leg in legs
        for kv in (kv_cache_dtypes if leg.startswith("ort") else kv_cache_dtypes[:1])
    ]

    def run_name(leg: str, kv: str) -> str:
        return leg if not leg.startswith("ort") or kv == "auto" else f"{leg} kv={kv}"

    for name, precision in GENAI_PRECISION.items():
        out = args.work / name
        if name not in legs or (out / "genai_config.json").exists():
            continue
        try:
            build_genai(args.genai_python, checkpoint, out, args.threads, precision)
        except subprocess.CalledProcessError as error:
            last = error.stderr.decode(errors="replace").strip().splitlines()[-1:]
            print(f"{name}: the builder failed: {''.join(last) or error}", file=sys.stderr)
        except OSError as error:
            print(f"{name}: cannot run the builder ({error}); pass --genai-python", file=sys.stderr)

    results: dict[str, dict[int, dict]] = {run_name(leg, kv): {} for leg, kv in runs}
    # Legs alternate within each repeat, and the best repeat counts: on a shared machine this
    # gives every leg the same chances of a quiet moment.
    for repeat in range(args.repeat):
        for batch in args.batches:
            for leg, args.kv_cache_dtype in runs:
                key = run_name(leg, args.kv_cache_dtype)
                python = _python_for(leg, args)
                if not python or not Path(python).exists():
                    results[key][batch] = {"skipped": f"no interpreter for {leg}: {python}"}
                    continue
                result = _spawn(leg, python, args, batch)
                print(f"repeat {repeat} batch {batch} {key}: {result}", file=sys.stderr)
                best = results[key].get(batch, {})
                if result.get("decode_tok_s", 0) >= best.get("decode_tok_s", -1):
                    results[key][batch] = result
    args.kv_cache_dtype = kv_cache_dtypes[0]
    memory = _spawn("memory", sys.executable, args, 1) if "ort" in legs else {}
    quality = {}
    if args.quality:
        reference = _spawn("quality-hf", sys.executable, args, 1)
        for leg, args.kv_cache_dtype in runs:
            if leg not in QUALITY_LEGS:
                continue
            python = _python_for(f"quality-{leg}", args)
            result = _spawn(f"quality-{leg}", python, args, 1)
            if "logits" in result and "logits" in reference:
                result = compare_logits(result["logits"], reference["logits"])
            quality[run_name(leg, args.kv_cache_dtype)] = result
            print(f"quality {run_name(leg, args.kv_cache_dtype)}: {result}", file=sys.stderr)
        args.kv_cache_dtype = kv_cache_dtypes[0]

    import platform

    import onnxruntime
    import torch

    lines = [
        f"{'Tiny smoke-test model' if args.quick else 'Llama-like ~125M model'} "
        f"({'x'.join(str(v) for v in (QUICK_CONFIG if args.quick else FULL_CONFIG).values())} "
        "hidden/intermediate/layers/heads/kv-heads/vocab, fp32, random weights seed 0), "
        f"prompt {args.prompt_len}, {args.new_tokens} new tokens, greedy, {args.threads} threads;"
        f" {platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"onnxruntime {onnxruntime.__version__}, ort legs' KV cache dtype "
        f"{' / '.join(kv_cache_dtypes)}. TTFT = prefill of the whole batch. Best of "
        f"{args.repeat} alternating run(s) per leg.",
        "",
        *_table(results, args.batches),
        "",
        *_memory_lines(memory),
        *(["", *_quality_lines(quality)] if quality else []),
    ]
    print("\n".join(lines))
    if args.json:
        payload = {"results": results, "memory": memory, "quality": quality}
        args.json.write_text(json.dumps(payload, indent=1))
    if args.write_docs:
        write_docs(lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
