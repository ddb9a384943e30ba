"""What exporting the real checkpoint costs: wall time and peak memory of ``attnexport export``
(float32, ``--weights int4``, ``--weights int8``) and ``attnexport verify``, against
onnxruntime-genai's builder and optimum-intel's ``optimum-cli export openvino`` on the same
checkpoint (SmolLM2-135M-Instruct, :mod:`smollm2`), each in its own venv (:mod:`peers`).

Every leg is a fresh process tree started from this small process (no torch here, so a child
inherits no peak of ours). Its peak is the larger of the sum of the tree's resident sets,
sampled every 20 ms, and the ``ru_maxrss`` of the largest process (``wait4``), which catches a
spike between samples. Legs alternate within each repeat; best and median are reported, and
"x weights" divides the peak by the checkpoint's safetensors bytes.

    python benchmarks/export_cost.py --repeats 3
    python benchmarks/export_cost.py --legs ours-fp32 genai-fp32 --ours main=/work/main --ours .
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import peers  # noqa: E402

CLI = ("-m", "attnexport")
"""The command line as the ``attnexport`` console script runs it (``attnexport.cli.entry``; a
tree given with ``--ours`` needs its ``attnexport/__main__.py``, 2026-11-28 on)."""
OURS = {
    "ours-fp32": [],
    "ours-int4": ["--weights", "int4"],
    "ours-int8": ["--weights", "int8"],
    # the transformers path (any decoder's): transformers' model traced, then the rewrite rules
    "ours-fp32-transformers": ["--impl", "transformers"],
}
PEER_LEGS = {
    "genai-fp32": ("genai", "fp32"),
    "genai-int4": ("genai", "int4"),
    "genai-int8": ("genai", "int8"),
    "openvino-fp32": ("openvino", "fp32"),
    "openvino-int4": ("openvino", "int4"),
    "openvino-int8": ("openvino", "int8"),
}
LEGS = (*OURS, "ours-verify", *PEER_LEGS)
DEFAULT_LEGS = ("ours-fp32", "ours-verify", "ours-int4", "genai-fp32", "genai-int4")
DEFAULT_LEGS += ("openvino-fp32", "openvino-int4")


def _tree_rss(pid: int) -> int:
    """Bytes resident in process ``pid`` and its descendants (0 once it is gone)."""
    import psutil

    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            total += process.memory_info().rss
    return total


def measure(
    command: list[str], env: dict[str, str], log: Path, cwd: Path, ok: tuple[int, ...] = (0,)
) -> dict:
    """Runs ``command`` in ``cwd``; returns ``seconds`` (wall) and ``peak_mb`` (module doc)."""
    with log.open("w") as out:
        start = time.perf_counter()
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        peak = [0]
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], _tree_rss(process.pid))
                done.wait(0.02)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        _, status, usage = os.wait4(process.pid, 0)
        seconds = time.perf_counter() - start
        done.set()
        sampler.join()
        process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode not in ok:
        tail = "\n".join(log.read_text().splitlines()[-15:])
        raise RuntimeError(f"{' '.join(command[:6])}... exited {process.returncode}:\n{tail}")
    return {"seconds": seconds, "peak_mb": max(peak[0], usage.ru_maxrss * 1024) / 2**20}


def leg_command(leg: str, tree: Path, checkpoint: Path, out: Path) -> tuple[list[str], dict]:
    """The command and environment of ``leg`` (``ours-*`` run the tree ``tree``'s code)."""
    if leg in OURS:
        env = peers.peer_env(extra={"PYTHONPATH": str(tree)})
        return [
            sys.executable,
            *CLI,
            "export",
            str(checkpoint),
            "--out",
            str(out),
            *OURS[leg],
        ], env
    if leg == "ours-verify":
        env = peers.peer_env(extra={"PYTHONPATH": str(tree)})
        return [sys.executable, *CLI, "verify", str(out)], env
    name, fmt = PEER_LEGS[leg]
    return peers.conversion_command(name, checkpoint, fmt, out), peers.peer_env()


def weights_bytes(checkpoint: Path) -> int:
    return sum(path.stat().st_size for path in checkpoint.glob("*.safetensors"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--legs", nargs="+", choices=LEGS, default=list(DEFAULT_LEGS))
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument(
        "--ours",
        action="append",
        default=[],
        metavar="[LABEL=]TREE",
        help="a checkout whose attnexport runs the ours-* legs (repeatable; default: this one)",
    )
    args = parser.parse_args(argv)
    if args.checkpoint is None:
        import smollm2

        args.checkpoint = smollm2.build_checkpoint()
    trees = {}
    for given in args.ours or [str(HERE.parent)]:
        label, _, path = given.rpartition("=")
        trees[label or Path(path).resolve().name] = Path(path).resolve()
    runs = [
        (leg, label) for leg in args.legs for label in (trees if leg.startswith("ours") else [""])
    ]
    for leg in args.legs:
        if leg in PEER_LEGS and (reason := peers.unavailable_reason(PEER_LEGS[leg][0])):
            sys.exit(f"{leg}: {reason}")
    weights = weights_bytes(args.checkpoint)
    results: dict[tuple[str, str], list[dict]] = {run: [] for run in runs}
    scratch = Path(tempfile.mkdtemp(prefix="export-cost-"))
    try:
        for repeat in range(args.repeats):
            for leg, label in runs:
                tree = trees.get(label, HERE.parent)
                fp32 = scratch / f"ours-fp32-{label}"  # ours-fp32's output, what verify reads
                exported = fp32 if leg in ("ours-fp32", "ours-verify") else scratch / leg
                if leg == "ours-verify" and not fp32.exists():
                    command, env = leg_command("ours-fp32", tree, args.checkpoint, fp32)
                    measure(command, env, scratch / "setup.log", tree)
                elif leg != "ours-verify":
                    shutil.rmtree(exported, ignore_errors=True)
                command, env = leg_command(leg, tree, args.checkpoint, exported)
                # in the tree: ``python -c`` puts the working directory first on sys.path
                # verify's exit 1 (a comparison over its tolerance) is still a measurement
                ok = (0, 1) if leg == "ours-verify" else (0,)
                result = measure(command, env, scratch / f"{leg}-{label}.log", tree, ok)
                results[(leg, label)].append(result)
                name = f"{leg} [{label}]" if label else leg
                print(
                    f"repeat {repeat + 1} {name}: {result['seconds']:.1f} s, "
                    f"{result['peak_mb']:.0f} MB",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"\n{args.checkpoint}: weights {weights / 2**20:.0f} MiB, {args.repeats} repeats\n")
    print(
        "| leg | time best (s) | time median (s) | peak best (MiB) | peak median (MiB) "
        "| peak / weights |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for (leg, label), rows in results.items():
        seconds = [r["seconds"] for r in rows]
        peaks = [r["peak_mb"] for r in rows]
        name = f"{leg} [{label}]" if label and len(trees) > 1 else leg
        print(
            f"| {name} | {min(seconds):.1f} | {statistics.median(seconds):.1f} | "
            f"{min(peaks):.0f} | {statistics.median(peaks):.0f} | "
            f"{statistics.median(peaks) * 2**20 / weights:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
