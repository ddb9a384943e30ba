"""``benchmarks/generate.py --model smollm2``: the real SmolLM2-135M-Instruct checkpoint
(benchmarks/smollm2.py) against the CPU peers (benchmarks/peers.py), by precision class:

* fp32: ``ours fp32``, ``ours fp32-kv8`` (``--kv-cache-dtype int8``: OpenVINO's CPU cache is u8,
  llama.cpp's float16), their projections ``attnexport.LosslessMatMul*`` (the export's float32
  default: the checkpoint's float32 weights, de-quantized from GGUF Q4_1/Q8_0, read as their
  exact codes, outputs bit for bit those of float32 panels), ``ours fp32-panels-kv8``
  (``--no-lossless-weights``: float32 panels, ``attnexport.PackedMatMul``); llama.cpp F32,
  OpenVINO fp32, onnxruntime-genai fp32, vLLM CPU fp32;
* 8-bit: ``ours int8`` (``--weights int8``), ``ours int8-kv8`` (also ``--kv-cache-dtype int8``),
  ``ours int8-b64-kv8`` (also ``--weights-block-size 64``), ``ours int8-b64-p8-kv8`` (also
  ``--weights-prefill-activations int8``), ``ours int8-b64-p8b-kv8`` (and ``--prefill-attention
  bfloat16``); llama.cpp Q8_0, OpenVINO int8,
  onnxruntime-genai int8;
* 4-bit: ``ours int4`` (``--weights int4``: attnexport.MatMul4Bits), ``ours int4-kv8`` (also
  ``--kv-cache-dtype int8``), ``ours int4-h4-kv8`` (also a 4-bit logits projection),
  ``ours int4-p8-kv8`` (``--weights-prefill-activations int8``: a prefill's activations in int8
  steps), ``ours int4-p8b-kv8`` (and ``--prefill-attention bfloat16``: its attention in
  bfloat16 pairs), ``ours int4-d8b-kv8`` (and ``--weights-decode-activations int8``: every
  call's activations in int8 steps), ``ours int4-h4-d8b-kv8`` (and a 4-bit logits projection),
  ``ours int4-a8-kv8`` (``--weights-activations int8``: MatMulNBits, the default before);
  llama.cpp Q4_0, OpenVINO int4 (group 64, ratio 1.0), onnxruntime-genai int4.

Every leg runs in its own process (a peer's in its own environment) on the same random
prompts (token ids, seed 0; a warm-up generation of 4 tokens on other prompts of the same shape
first), greedy, exactly ``--new-tokens`` new tokens per sequence, ``--threads`` threads. Legs
alternate within every (prompt length, batch) point and every repeat; the table gives the
median of the repeats: decode tok/s = batch x (new - 1) / (last token - first token of the
last sequence), TTFT = until every sequence has its first token, peak RSS of the process.
A peer that cannot install or convert is skipped with its reason.

    python benchmarks/generate.py --model smollm2 --write-docs            # full: ~2-3 hours
    python benchmarks/generate.py --model smollm2 --quick                 # batch 1/8, prompt 128
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLASSES = ("fp32", "8-bit", "4-bit")
# Our legs: name -> (class, `attnexport export` flags beyond the checkpoint).
OURS = {
    "fp32": ("fp32", []),
    "fp32-kv8": ("fp32", ["--kv-cache-dtype", "int8"]),
    # The float32 weights as float32 panels: the export's projections before it read the
    # checkpoint's GGUF-born weights as their exact codes (LosslessMatMul*, the default).
    "fp32-panels-kv8": ("fp32", ["--kv-cache-dtype", "int8", "--no-lossless-weights"]),
    "int8": ("8-bit", ["--weights", "int8"]),
    "int8-kv8": ("8-bit", ["--weights", "int8", "--kv-cache-dtype", "int8"]),
    # Blocks of 64: 149.7 MB a token, not 164.7, top-1 0.975 (docs/benchmarks.md, quality).
    "int8-b64-kv8": (
        "8-bit",
        ["--weights", "int8", "--weights-block-size", "64", "--kv-cache-dtype", "int8"],
    ),
    # A prefill's activations (calls of 128 rows or more) rounded to int8 steps: vpdpbusd on
    # AVX512_VNNI; decode keeps int16 (docs/quantization.md, the quality it costs).
    "int8-b64-p8-kv8": (
        "8-bit",
        [
            *("--weights", "int8", "--weights-block-size", "64", "--kv-cache-dtype", "int8"),
            *("--weights-prefill-activations", "int8"),
        ],
    ),
    # And the attention of a prefill in bfloat16 pairs (vdpbf16ps on AVX512_BF16), as
    # OpenVINO's int8/int4 compute on such CPUs (docs/lowering.md, prefill_bf16).
    "int8-b64-p8b-kv8": (
        "8-bit",
        [
            *("--weights", "int8", "--weights-block-size", "64", "--kv-cache-dtype", "int8"),
            *("--weights-prefill-activations", "int8", "--prefill-attention", "bfloat16"),
        ],
    ),
    "int4": ("4-bit", ["--weights", "int4"]),
    "int4-kv8": ("4-bit", ["--weights", "int4", "--kv-cache-dtype", "int8"]),
    # The logits projection in 4 bits too, as genai's and OpenVINO's int4: ~84 MB a token read,
    # +10% perplexity, top-1 0.81 (theirs: +34%, 0.65-0.69; docs/benchmarks.md, quality).
    "int4-h4-kv8": (
        "4-bit",
        [
            *("--weights", "int4", "--kv-cache-dtype", "int8"),
            *("--lm-head", "int4", "--lm-head-block-size", "32"),
        ],
    ),
    "int4-p8-kv8": (
        "4-bit",
        [
            *("--weights", "int4", "--kv-cache-dtype", "int8"),
            *("--weights-prefill-activations", "int8"),
        ],
    ),
    "int4-p8b-kv8": (
        "4-bit",
        [
            *("--weights", "int4", "--kv-cache-dtype", "int8"),
            *("--weights-prefill-activations", "int8", "--prefill-attention", "bfloat16"),
        ],
    ),
    # Every call's activations in int8 steps (our kernel, int8_from_rows 1), as OpenVINO
    # rounds its int4 models' activations per group of 32: a batched decode's products with
    # vpdpbusd too.
    "int4-d8b-kv8": (
        "4-bit",
        [
            *("--weights", "int4", "--kv-cache-dtype", "int8"),
            *("--weights-prefill-activations", "int8", "--weights-decode-activations", "int8"),
            *("--prefill-attention", "bfloat16"),
        ],
    ),
    # A 4-bit logits projection with the fast prefill and decode: the 4-bit peers' bytes a
    # token (genai's head is 4-bit too), a one-token decode reads ~11 MB less.
    "int4-h4-d8b-kv8": (
        "4-bit",
        [
            *("--weights", "int4", "--kv-cache-dtype", "int8"),
            *("--lm-head", "int4", "--lm-head-block-size", "32"),
            *("--weights-prefill-activations", "int8", "--weights-decode-activations", "int8"),
            *("--prefill-attention", "bfloat16"),
        ],
    ),
    # The int4 default before int16 activations: MatMulNBits at accuracy level 4 (int8
    # activations), hqq's offsets through AddBlockOffsets.
    "int4-a8-kv8": (
        "4-bit",
        ["--weights", "int4", "--weights-activations", "int8", "--kv-cache-dtype", "int8"],
    ),
}
PEER_TITLES = {"llamacpp": "llama.cpp", "openvino": "OpenVINO", "vllm": "vLLM", "genai": "genai"}
LEG_TIMEOUT_S = 3600
DOCS_TITLE = "## The real model against the CPU peers"


def _module(name: str):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return __import__(name)
    finally:
        sys.path.pop(0)


@dataclass
class Leg:
    """One column of the comparison: ours (``peer`` None, ``variant`` a key of OURS) or a
    peer's format."""

    name: str
    klass: str
    peer: str | None
    variant: str
    model: Path | None = None
    skipped: str | None = None


def plan_legs(args, checkpoint: Path, log) -> list[Leg]:
    """The selected legs, with their models made (ours exported, the peers' converted); a
    leg that cannot be made carries the reason."""
    peers = _module("peers")
    legs = []
    for variant in args.ours:
        klass = OURS[variant][0]
        if klass in args.classes:
            legs.append(Leg(f"ours {variant}", klass, None, variant))
    for name in args.peers:
        for klass, fmt in peers.get_peer(name).formats.items():
            if klass in args.classes:
                legs.append(Leg(f"{PEER_TITLES[name]} {fmt}", klass, name, fmt))
    for leg in legs:
        try:
            leg.model = (
                _ours_model(args, checkpoint, leg.variant, log)
                if leg.peer is None
                else (_peer_model(peers, leg, checkpoint, args.threads, log))
            )
        except (peers.PeerUnavailable, RuntimeError, subprocess.CalledProcessError) as error:
            leg.skipped = str(error).strip().splitlines()[0][:200] if str(error) else repr(error)
            log(f"{leg.name}: skipped: {leg.skipped}")
    return legs


def export_stamp(flags: list[str], root: Path = ROOT) -> str:
    """What an export of ours depends on: its flags and attnexport's Python sources (the
    lowering, quantizer and models that write the file), hashed."""
    import hashlib

    digest = hashlib.sha256("\0".join(flags).encode())
    for source in sorted((root / "attnexport").rglob("*.py")):
        digest.update(str(source.relative_to(root)).encode())
        digest.update(source.read_bytes())
    return digest.hexdigest()


def _ours_model(args, checkpoint: Path, variant: str, log) -> Path:
    out = args.work / f"ours-{variant}"
    # An export made by other sources is made again: kept, it measured the old graph.
    stamp, stamp_file = export_stamp(OURS[variant][1]), out / "export_stamp"
    reusable = stamp_file.is_file() and stamp_file.read_text() == stamp
    if not ((out / "model.onnx").is_file() and reusable):
        log(f"ours {variant}: attnexport export {' '.join(OURS[variant][1])}")
        command = [
            sys.executable,
            "-c",
            "import sys; from attnexport.cli import main; sys.exit(main())",
            "export",
            str(checkpoint),
            "--out",
            str(out),
            "--overwrite",
            *OURS[variant][1],
        ]
        env = _our_env(args.threads)
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"export failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
        stamp_file.write_text(stamp)
    return out


def _peer_model(peers, leg: Leg, checkpoint: Path, threads: int, log) -> Path:
    reason = peers.unavailable_reason(leg.peer)
    if reason and "no environment yet" not in reason:
        raise peers.PeerUnavailable(reason)
    peers.make_venv(leg.peer, log=log)
    log(f"{leg.name}: model")
    return peers.model_path(leg.peer, leg.variant, checkpoint, threads=threads)


def _our_env(threads: int) -> dict[str, str]:
    import os

    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TORCHINDUCTOR_COMPILE_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """The random prompts every leg runs (generate.py's, so our leg makes the same)."""
    import numpy as np

    return np.random.default_rng(seed).integers(3, vocab, size=(batch, length)).tolist()


def run_leg(args, leg: Leg, batch: int, prompt_len: int) -> dict:
    """One timed generation of ``leg``; a failure is a result with ``error``."""
    if leg.skipped:
        return {"skipped": leg.skipped}
    try:
        if leg.peer is None:
            return _run_ours(args, leg, batch, prompt_len)
        payload = {
            "prompts": prompts(batch, prompt_len, args.vocab, 0),
            "warmup_prompts": prompts(batch, prompt_len, args.vocab, 1),
            "new_tokens": args.new_tokens,
        }
        return _module("peers").run_leg(
            leg.peer, leg.variant, leg.model, payload, threads=args.threads, timeout=LEG_TIMEOUT_S
        )
    except (RuntimeError, subprocess.TimeoutExpired, ValueError) as error:
        return {"error": str(error).strip().splitlines()[-1][:300]}


def _run_ours(args, leg: Leg, batch: int, prompt_len: int) -> dict:
    command = [
        sys.executable,
        str(ROOT / "benchmarks" / "generate.py"),
        "--leg",
        "ours",
        "--artifact",
        str(leg.model),
        "--batch",
        str(batch),
        "--threads",
        str(args.threads),
        "--vocab",
        str(args.vocab),
        "--prompt-len",
        str(prompt_len),
        "--new-tokens",
        str(args.new_tokens),
    ]
    done = subprocess.run(
        command, env=_our_env(args.threads), capture_output=True, text=True, timeout=LEG_TIMEOUT_S
    )
    if done.returncode != 0:
        raise RuntimeError((done.stderr or done.stdout).strip().splitlines()[-1])
    return json.loads(done.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- report


def summarize(runs: list[dict]) -> dict:
    """The median decode tok/s and TTFT of a point's repeats, the largest peak RSS."""
    good = [r for r in runs if "decode_tok_s" in r]
    if not good:
        return next(iter(runs), {"error": "not run"})
    return {
        "decode_tok_s": statistics.median(r["decode_tok_s"] for r in good),
        "ttft_s": statistics.median(r["ttft_s"] for r in good),
        "peak_rss_mb": max(r.get("peak_rss_mb", 0) for r in good),
        "runs": len(good),
        "describe": good[0].get("describe", ""),
    }


def tables(legs: list[Leg], results: dict, batches, prompt_lens) -> list[str]:
    lines = []
    for prompt_len in prompt_lens:
        header = "| class | leg | " + " | ".join(
            f"b{b} tok/s | b{b} TTFT s | b{b} RSS MB" for b in batches
        )
        lines += [f"Prompt {prompt_len}:", "", header + " |", "|---" * (2 + 3 * len(batches)) + "|"]
        for leg in legs:
            cells = []
            for b in batches:
                r = summarize(results[leg.name].get(f"{prompt_len}x{b}", []))
                if "decode_tok_s" in r:
                    cells += [
                        f"{r['decode_tok_s']:.1f}",
                        f"{r['ttft_s']:.2f}",
                        f"{r['peak_rss_mb']:.0f}",
                    ]
                else:
                    cells += [(r.get("skipped") or r.get("error") or "not run")[:70], "", ""]
            lines.append(f"| {leg.klass} | {leg.name} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ratio_lines(legs, results, batches, prompt_lens)
    return lines


def ratio_lines(legs: list[Leg], results: dict, batches, prompt_lens) -> list[str]:
    """Ours / the best peer of the same class: decode tok/s (goal >= 1.2) and TTFT (goal
    <= 1), at every point."""
    lines = [
        "Ours / best peer of the class (decode tok/s ratio, goal >= 1.2; TTFT ratio, goal "
        "<= 1.0; the best peer named):",
        "",
        "| ours | " + " | ".join(f"p{p} b{b}" for p in prompt_lens for b in batches) + " |",
        "|---" * (1 + len(prompt_lens) * len(batches)) + "|",
    ]
    for ours in (leg for leg in legs if leg.peer is None):
        cells = []
        for p in prompt_lens:
            for b in batches:
                mine = summarize(results[ours.name].get(f"{p}x{b}", []))
                peers = [
                    (summarize(results[leg.name].get(f"{p}x{b}", [])), leg.name)
                    for leg in legs
                    if leg.peer is not None and leg.klass == ours.klass
                ]
                peers = [(r, n) for r, n in peers if "decode_tok_s" in r]
                if "decode_tok_s" not in mine or not peers:
                    cells.append("")
                    continue
                best, name = max(peers, key=lambda rn: rn[0]["decode_tok_s"])
                ttft = min(r["ttft_s"] for r, _ in peers)
                cells.append(
                    f"{mine['decode_tok_s'] / best['decode_tok_s']:.2f}x {name} / "
                    f"TTFT {mine['ttft_s'] / ttft:.2f}x"
                )
        lines.append(f"| {ours.name} | " + " | ".join(cells) + " |")
    return lines


def header(args, legs: list[Leg], versions: dict) -> list[str]:
    import platform

    import onnxruntime

    cpu = _cpu_name()
    peer_versions = "; ".join(
        f"{PEER_TITLES[p]}: " + ", ".join(f"{k} {v}" for k, v in vs.items())
        for p, vs in versions.items()
    )
    return [
        f"SmolLM2-135M-Instruct (benchmarks/smollm2.py: 30 layers, hidden 576, 9/3 heads, vocab "
        f"49152, tied embeddings), random prompts (seed 0), {args.new_tokens} new tokens, greedy,"
        f" {args.threads} threads, median of {args.repeat} alternating repeat(s); {cpu}, "
        f"{platform.system()} {platform.release()}; onnxruntime {onnxruntime.__version__}; "
        f"{peer_versions}.",
        "",
        f"    python benchmarks/generate.py {' '.join(args.argv)}",
        "",
    ]


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


# ----------------------------------------------------------------------------- driver


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="generate.py --model smollm2", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--model", choices=("smollm2",), default="smollm2")
    parser.add_argument(
        "--quick", action="store_true", help="batch 1 and 8, prompt 128, 32 new tokens, 1 repeat"
    )
    parser.add_argument("--batches", type=int, nargs="+")
    parser.add_argument("--prompt-lens", type=int, nargs="+")
    parser.add_argument("--new-tokens", type=int)
    parser.add_argument("--repeat", type=int)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--classes", nargs="+", choices=CLASSES, default=list(CLASSES))
    parser.add_argument("--ours", nargs="*", choices=list(OURS), default=list(OURS))
    parser.add_argument(
        "--peers",
        nargs="*",
        default=["llamacpp", "openvino", "vllm", "genai"],
        choices=list(PEER_TITLES),
    )
    parser.add_argument("--work", type=Path, default=ROOT / "out" / "bench_generate" / "smollm2")
    parser.add_argument("--json", type=Path, help="also write every run's result as JSON here")
    parser.add_argument("--write-docs", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args(argv)
    quick = {"batches": [1, 8], "prompt_lens": [128], "new_tokens": 32, "repeat": 1}
    full = {"batches": [1, 8, 32], "prompt_lens": [128, 1024], "new_tokens": 64, "repeat": 3}
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.argv = argv
    return args


def main(argv: list[str]) -> int:
    args = parse(argv)

    def log(line: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)

    checkpoint = _module("smollm2").build_checkpoint()
    args.vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    args.work.mkdir(parents=True, exist_ok=True)
    legs = plan_legs(args, checkpoint, log)
    peers = _module("peers")
    versions = {}
    for name in dict.fromkeys(leg.peer for leg in legs if leg.peer and not leg.skipped):
        try:
            versions[name] = peers.versions(name)
        except RuntimeError as error:
            versions[name] = {"error": str(error)[:80]}
    results: dict[str, dict[str, list[dict]]] = {leg.name: {} for leg in legs}
    for repeat in range(args.repeat):
        for prompt_len in args.prompt_lens:
            for batch in args.batches:
                # Rotate the order every repeat: no leg always runs right after the same one.
                order = legs[repeat % len(legs) :] + legs[: repeat % len(legs)]
                for leg in order:
                    result = run_leg(args, leg, batch, prompt_len)
                    results[leg.name].setdefault(f"{prompt_len}x{batch}", []).append(result)
                    shown = {k: v for k, v in result.items() if k != "first_tokens"}
                    log(f"repeat {repeat} prompt {prompt_len} batch {batch} {leg.name}: {shown}")
    lines = [*header(args, legs, versions), *tables(legs, results, args.batches, args.prompt_lens)]
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps({"versions": versions, "results": results}, indent=1))
    if args.write_docs:
        _module("generate").write_docs(lines, DOCS_TITLE)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
