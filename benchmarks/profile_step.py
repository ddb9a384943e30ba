"""Where a decode step goes: onnxruntime's profiler over the decode steps of one greedy batch,
node time per op type per step, for our export (OrtExecutor, the engine's path) and for an
onnxruntime-genai model (its generator, run in the genai peer's environment).

    python benchmarks/profile_step.py ours out/bench_generate/smollm2/ours-int4 --batch 8
    python benchmarks/profile_step.py genai int4 --batch 8      # the genai peer's int4 model
    python benchmarks/profile_step.py ours DIR --batch 8 --prefill  # the prefill's run instead

The profiler's node times are wall times and include its own cost (~5-10 us a node) and, on a
shared machine, time slices lost to other processes: compare op types within one profile, and
two profiles only through an op both run alike (``MatMulNBits`` of the same weights).
``--threads 1`` removes the thread pool's waits from the picture.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def per_op_type(profile: Path, prefill: bool = False) -> dict:
    """Decode-step node time by op type from an onnxruntime profile (every ``model_run``
    after the first, the prefill; ``prefill``: the first alone): ``{"steps", "run_ms", "ops":
    {op: [nodes, ms]}}`` per step."""
    events = json.loads(profile.read_text())
    runs = [e for e in events if e.get("name") == "model_run"]
    if len(runs) < 2:
        raise ValueError(f"{profile}: expected a prefill and decode runs, got {len(runs)} runs")
    prefill_end = runs[0]["ts"] + runs[0]["dur"]
    timed = runs[:1] if prefill else runs[1:]
    steps = len(timed)
    ops: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for e in events:
        in_prefill = runs[0]["ts"] <= e.get("ts", -1) <= prefill_end
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and in_prefill == prefill:
            op = e["args"].get("op_name", "?")
            ops[op][0] += 1 / steps
            ops[op][1] += e["dur"] / steps / 1000
    run_ms = sum(r["dur"] for r in timed) / steps / 1000
    return {"steps": steps, "run_ms": run_ms, "ops": dict(ops)}


def report(summary: dict, title: str) -> list[str]:
    total = sum(ms for _, ms in summary["ops"].values())
    lines = [
        f"{title}: {summary['steps']} step(s), model run {summary['run_ms']:.2f} ms, "
        f"nodes {total:.2f} ms per step",
        "",
        "| op type | nodes per step | ms per step | share |",
        "|---|---|---|---|",
    ]
    for op, (nodes, ms) in sorted(summary["ops"].items(), key=lambda kv: -kv[1][1]):
        lines.append(f"| {op} | {nodes:.0f} | {ms:.3f} | {100 * ms / total:.1f}% |")
    return lines


def _prompts(batch: int, length: int, seed: int = 0) -> list[list[int]]:
    import numpy as np

    return np.random.default_rng(seed).integers(3, 49152, size=(batch, length)).tolist()


def profile_ours(artifact: Path, batch: int, prompt_len: int, new: int, threads: int) -> Path:
    from attnexport.runtime import (
        CacheConfig,
        Engine,
        OrtExecutor,
        SamplingParams,
        SchedulerConfig,
    )
    from attnexport.runtime.executors.ort_executor import default_session_options

    options = default_session_options(threads)
    options.enable_profiling = True
    options.profile_file_prefix = str(Path(tempfile.mkdtemp()) / "ours")
    executor = OrtExecutor(artifact / "model.onnx", session_options=options)
    blocks = batch * -(-(prompt_len + new) // executor.cache_spec.block_size) + 8
    engine = Engine(
        executor,
        CacheConfig(num_blocks=blocks, enable_prefix_caching=False),
        SchedulerConfig(
            max_num_seqs=batch,
            max_num_batched_tokens=batch * prompt_len,
            max_model_len=prompt_len + new,
        ),
    )
    engine.generate(_prompts(batch, prompt_len), SamplingParams(max_tokens=new))
    return Path(executor.session.end_profiling())


GENAI_SNIPPET = """
import json, os, shutil, sys, numpy as np, onnxruntime_genai as og
from pathlib import Path
src, out, batch, plen, new, threads = sys.argv[1:7]
batch, plen, new, threads = int(batch), int(plen), int(new), int(threads)
out = Path(out)
for f in Path(src).iterdir():
    if f.name != "genai_config.json":
        os.symlink(f, out / f.name)
config = json.loads((Path(src) / "genai_config.json").read_text())
options = config["model"]["decoder"]["session_options"]
options["enable_profiling"], options["intra_op_num_threads"] = str(out / "genai"), threads
(out / "genai_config.json").write_text(json.dumps(config))
model = og.Model(str(out))
params = og.GeneratorParams(model)
params.set_search_options(max_length=plen + new, min_length=plen + new, do_sample=False,
                          batch_size=batch)
generator = og.Generator(model, params)
prompts = np.random.default_rng(0).integers(3, 49152, size=(batch, plen)).astype(np.int32)
generator.append_tokens(prompts)
while not generator.is_done():
    generator.generate_next_token()
"""


def profile_genai(fmt: str, batch: int, prompt_len: int, new: int, threads: int) -> Path:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import peers
    import smollm2

    model = peers.model_path("genai", fmt, smollm2.build_checkpoint())
    out = Path(tempfile.mkdtemp())
    args = [str(model), str(out), str(batch), str(prompt_len), str(new), str(threads)]
    # The profile is written when the process ends.
    done = peers.run_python("genai", GENAI_SNIPPET, args=args, threads=threads)
    if done.returncode != 0:
        raise RuntimeError(done.stderr.strip().splitlines()[-1])
    return max(out.glob("genai*.json"), key=lambda p: p.stat().st_mtime)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("which", choices=("ours", "genai"))
    parser.add_argument("model", help="ours: an export directory; genai: fp32, int8 or int4")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prefill", action="store_true", help="the prefill's run, not decode's")
    args = parser.parse_args()
    start = time.perf_counter()
    shape = (args.batch, args.prompt_len, args.new_tokens, args.threads)
    if args.which == "ours":
        path = profile_ours(Path(args.model), *shape)
    else:
        path = profile_genai(args.model, *shape)
    title = (
        f"{args.which} {Path(args.model).name}, batch {args.batch}, prompt {args.prompt_len}, "
        f"{args.threads} thread(s), {'prefill' if args.prefill else 'decode'} "
        f"({time.perf_counter() - start:.0f} s)"
    )
    print("\n".join(report(per_op_type(path, args.prefill), title)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
