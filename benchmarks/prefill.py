"""Prefill on CPU: the time to first token of one prompt of 128 to 4096 tokens on the real model
(SmolLM2-135M-Instruct, benchmarks/smollm2.py; float32, ``--threads`` threads), for

* ``ort-native``  attnexport's OrtExecutor with the native kernels, the engine's defaults (a
                  prompt over 2048 tokens is prefilled in chunks of ``max_num_batched_tokens``
                  = 2048),
* ``ort-bodies``  the same export run by the attnexport nodes' standard-op bodies,
* ``hf``          transformers' ``generate`` (float32, its default sdpa attention), one new token,
* ``before``      (``--baseline-tree DIR``) ``ort-native`` with another checkout's attnexport and
                  kernels, e.g. main's: the before/after of a change,

and the TTFT of a short request that arrives while a long prompt is prefilled in chunks
(``ort-native``; ``fairness``): a 4096-token prompt computes its first chunk, then a 64-token
request arrives; its TTFT and the steps until its first token, with the scheduler's default
``waiting_reserve_tokens`` (half the budget) and with none, beside its TTFT alone.

Each leg is a worker process that loads its model once (export and checkpoint made first, then
reused from ``--work``); the driver runs ``--rounds`` rounds, and in every round each prompt
length is timed by every leg in turn, so that the legs alternate on a shared machine. Every
leg gets the same random prompt (token ids, seed = the length) and must produce the same greedy
first token (float32). Printed per length: each leg's best and median TTFT over the rounds and
its ratio to ``hf`` (per round, the two ran back to back), best and median.

    python benchmarks/prefill.py [--lengths 128 512 1024 2048 4096] [--rounds 3] [--threads 2] \\
        [--baseline-tree /path/to/main] [--markdown]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LEGS = ("ort-native", "ort-bodies", "hf")
LONG, SHORT = 4096, 64
MAX_LEN = LONG + 64
BLOCK_SIZE = 16


def _prompt(length: int, vocab: int, seed: int) -> list[int]:
    import numpy as np

    return np.random.default_rng(seed).integers(100, vocab - 100, size=length).tolist()


# ----------------------------------------------------------------------------- workers


class OursWorker:
    """attnexport's engine over the export: TTFT of one prompt; the fairness scenario."""

    def __init__(self, model: Path, kernels: str, threads: int) -> None:
        from attnexport.runtime import OrtExecutor

        self.executor = OrtExecutor(model, num_threads=threads, kernels=kernels)
        self.vocab = self.executor.vocab_size

    def _engine(self, **scheduler):
        from attnexport.runtime import CacheConfig, Engine, SchedulerConfig

        blocks = 2 * (MAX_LEN // BLOCK_SIZE) + 8
        return Engine(
            self.executor,
            CacheConfig(num_blocks=blocks, enable_prefix_caching=False),
            SchedulerConfig(max_model_len=MAX_LEN, max_num_seqs=4, **scheduler),
        )

    def ttft(self, length: int) -> dict:
        from attnexport.runtime import SamplingParams

        engine = self._engine()
        out = engine.generate([_prompt(length, self.vocab, length)], SamplingParams(max_tokens=1))
        metrics = out[0].metrics
        return {
            "ttft_s": metrics.first_token_time - metrics.arrival_time,
            "token": out[0].token_ids[0],
            "steps": engine.stats.num_steps,
        }

    def fairness(self, reserve: int | None) -> dict:
        """The short request's TTFT and steps when it arrives after the long prompt's first
        chunk (``reserve``: the scheduler's ``waiting_reserve_tokens``; -1: the short prompt
        alone)."""
        from attnexport.runtime import SamplingParams

        one = SamplingParams(max_tokens=1)
        short = _prompt(SHORT, self.vocab, 1)
        engine = self._engine(waiting_reserve_tokens=None if reserve is None else max(reserve, 0))
        if reserve != -1:
            engine.add_request(_prompt(LONG, self.vocab, 2), one, request_id="long")
            engine.step()
        engine.add_request(short, one, request_id="short")
        steps = 0
        while not engine.get_output("short").token_ids:
            engine.step()
            steps += 1
        metrics = engine.get_output("short").metrics
        if reserve != -1:
            engine.abort("long")
        return {"ttft_s": metrics.first_token_time - metrics.arrival_time, "steps": steps}


class HfWorker:
    """transformers' ``generate`` of one new token (greedy, float32)."""

    def __init__(self, checkpoint: Path, threads: int) -> None:
        import torch
        import transformers

        torch.set_num_threads(threads)
        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            checkpoint, dtype=torch.float32
        ).eval()
        self.vocab = self.model.config.vocab_size

    def ttft(self, length: int) -> dict:
        ids = self.torch.tensor([_prompt(length, self.vocab, length)])
        start = time.perf_counter()
        with self.torch.inference_mode():
            out = self.model.generate(
                ids, max_new_tokens=1, do_sample=False, pad_token_id=self.model.config.eos_token_id
            )
        return {"ttft_s": time.perf_counter() - start, "token": int(out[0, -1])}


def worker_main(leg: str, args) -> None:
    """Serves JSON requests on stdin, one a line: {"op": "ttft", "length": n} or
    {"op": "fairness", "reserve": r}."""
    if leg == "hf":
        worker = HfWorker(args.work / "ckpt", args.threads)
    else:
        worker = OursWorker(args.work / "ours" / "model.onnx", leg.split("-")[-1], args.threads)
    worker.ttft(64)  # warm-up
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        cpu = time.process_time()
        if request["op"] == "ttft":
            result = worker.ttft(request["length"])
        else:
            result = worker.fairness(request["reserve"])
        print(json.dumps(result | {"cpu_s": time.process_time() - cpu}), flush=True)


class Worker:
    def __init__(self, leg: str, args, tree: Path | None = None) -> None:
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
        env["PYTHONPATH"] = str(tree or ROOT)
        command = [sys.executable, __file__, "--worker", "native" if tree else leg]
        command += ["--work", str(args.work), "--threads", str(args.threads)]
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        self.receive()

    def request(self, **request) -> dict:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return self.receive()

    def receive(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"worker exited with {self.process.wait()}")
        return json.loads(line)

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


# ----------------------------------------------------------------------------- driver


def prepare(work: Path) -> None:
    """The checkpoint (a link to the cached build) and our float32 export, once."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import smollm2

    work.mkdir(parents=True, exist_ok=True)
    checkpoint = smollm2.build_checkpoint()
    if not (work / "ckpt").exists():
        (work / "ckpt").symlink_to(checkpoint)
    if not (work / "ours" / "manifest.json").is_file():
        code = "import sys; from attnexport.cli import main; sys.exit(main())"
        command = [sys.executable, "-c", code, "export", str(checkpoint), "--out"]
        subprocess.run([*command, str(work / "ours"), "--overwrite"], check=True, cwd=ROOT)


def _stats(values: list[float]) -> tuple[float, float]:
    return min(values), statistics.median(values)


def run(args) -> dict:
    prepare(args.work)
    legs = list(args.legs) + (["before"] if args.baseline_tree else [])
    workers = {}
    for leg in legs:
        tree = args.baseline_tree if leg == "before" else None
        workers[leg] = Worker(leg, args, tree)
    ttft = {leg: {n: [] for n in args.lengths} for leg in legs}
    cpu = {leg: {n: [] for n in args.lengths} for leg in legs}
    tokens = {n: {} for n in args.lengths}
    fairness = {name: [] for name in ("alone", "reserve", "none")}
    for round_ in range(args.rounds):
        for n in args.lengths:
            for leg in legs:
                result = workers[leg].request(op="ttft", length=n)
                ttft[leg][n].append(result["ttft_s"])
                cpu[leg][n].append(result["cpu_s"])
                tokens[n][leg] = result["token"]
                print(f"round {round_} length {n} {leg}: {result}", file=sys.stderr, flush=True)
        if args.fairness and "ort-native" in workers:
            for name, reserve in (("alone", -1), ("reserve", None), ("none", 0)):
                result = workers["ort-native"].request(op="fairness", reserve=reserve)
                fairness[name].append(result)
                print(f"round {round_} fairness {name}: {result}", file=sys.stderr, flush=True)
    for worker in workers.values():
        worker.close()
    return {"ttft": ttft, "cpu": cpu, "tokens": tokens, "fairness": fairness, "legs": legs}


def _table(results: dict, key: str, lengths: list[int]) -> list[str]:
    """Per prompt length: each leg's best / median, and its ratio to hf's (per round)."""
    legs, times = results["legs"], results[key]
    others = [leg for leg in legs if leg != "hf"] if "hf" in legs else []
    lines = [
        "| prompt | "
        + " | ".join(f"{leg} s" for leg in legs)
        + "".join(f" | {leg} / hf" for leg in others)
        + " | same token |",
        "|---" * (2 + len(legs) + len(others)) + "|",
    ]
    for n in lengths:
        cells = ["{:.3f} / {:.3f}".format(*_stats(times[leg][n])) for leg in legs]
        for leg in others:
            ratios = [a / b for a, b in zip(times[leg][n], times["hf"][n], strict=True)]
            cells.append("{:.2f} / {:.2f}".format(*_stats(ratios)))
        same = len(set(results["tokens"][n].values())) == 1
        lines.append(f"| {n} | " + " | ".join(cells) + f" | {'yes' if same else 'NO'} |")
    return lines


def report(results: dict, args) -> str:
    rounds = len(next(iter(next(iter(results["ttft"].values())).values())))
    lines = [
        f"TTFT of one prompt, wall seconds (best / median of {rounds} rounds), and each leg's "
        "over hf's (per round; best / median):",
        "",
        *_table(results, "ttft", args.lengths),
        "",
        "The same requests in CPU seconds of the leg's process (a measure that other processes "
        "on the cores disturb less; spinning worker threads count):",
        "",
        *_table(results, "cpu", args.lengths),
    ]
    fairness = results["fairness"]
    if fairness["alone"]:
        lines += [
            "",
            f"A {SHORT}-token request arriving after the first chunk of a {LONG}-token prompt "
            "(ort-native; best / median):",
            "",
            "| scheduler | short request's TTFT s | steps to its first token |",
            "|---|---|---|",
        ]
        titles = {
            "alone": "short request alone",
            "reserve": "waiting_reserve_tokens default (1024)",
            "none": "waiting_reserve_tokens=0",
        }
        for name, title in titles.items():
            times = [r["ttft_s"] for r in fairness[name]]
            steps = sorted({r["steps"] for r in fairness[name]})
            lines.append(
                f"| {title} | {'{:.3f} / {:.3f}'.format(*_stats(times))} | "
                f"{', '.join(map(str, steps))} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024, 2048, 4096])
    parser.add_argument("--legs", nargs="+", choices=LEGS, default=list(LEGS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-fairness", dest="fairness", action="store_false")
    parser.add_argument("--baseline-tree", type=Path, help="a checkout to run as leg 'before'")
    parser.add_argument("--work", type=Path, default=Path.home() / ".cache/attnexport/prefill")
    parser.add_argument("--json", type=Path, help="write the raw results here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker_main(args.worker, args)
    results = run(args)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print(report(results, args))


if __name__ == "__main__":
    main()
