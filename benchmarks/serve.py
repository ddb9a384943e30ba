"""Serving benchmark on CPU: requests arriving as a Poisson process at several rates, each with
a prompt and output length drawn (seeded) from a fixed mixed distribution, streamed over HTTP
from

* ``attnexport``   ``attnexport serve`` on our ONNX export of the checkpoint (continuous
                   batching over the paged KV cache, onnxruntime with the native kernels),
* ``genai``        onnxruntime-genai on the model its builder makes from the same checkpoint,
                   served the way its users must (it has no server): one ``og.Generator`` per
                   request, ``--genai-workers`` of them at a time, behind the same HTTP stack
                   (FastAPI + uvicorn, OpenAI-style streaming); run with ``--genai-python``,
* ``transformers`` Hugging Face ``generate`` per request (one at a time) behind that front.

Reported per leg and rate: achieved requests/s and output tokens/s, time to first token (TTFT)
and inter-token latency (ITL) p50/p99 as the client sees them, and the KV-cache memory in use
(attnexport: its ``attnexport_kv_bytes_in_use`` gauge, sampled; the others: the cache their
running requests hold, from the bytes per token). A leg at a rate is *sustained* when its p99
TTFT stays under ``--ttft-slo`` seconds. Every front runs in its own process; the legs take
turns on the machine. ``--quick`` is a smoke test on a tiny model.

``--structured`` measures instead what log-probabilities and constrained decoding cost: the real
SmolLM2-135M-Instruct export (``benchmarks/smollm2.py``; a grammar needs the tokenizer) served
twice, ``attnexport`` with plain requests and ``attnexport+structured`` with ``logprobs: 1`` and
a JSON schema (``STRUCTURED_SCHEMA``: an object whose array cannot close before 256 tokens, so
every request runs to its ``max_tokens`` as the plain ones do) on every request; the two legs
alternate ``--repeat`` times and the sustained rates of each repeat are reported side by side.

    python benchmarks/serve.py --genai-python /path/to/genai-venv/bin/python --write-docs
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

LEGS = ("attnexport", "genai", "transformers")
STRUCTURED_LEGS = ("attnexport", "attnexport+structured")
STRUCTURED_SCHEMA = {
    "type": "object",
    "properties": {
        "notes": {
            "type": "array",
            "items": {"type": "string", "maxLength": 24},
            "minItems": 128,
        }
    },
    "required": ["notes"],
}
# The mixed distribution: (length, weight) of prompts and of outputs.
PROMPT_LENGTHS = ((32, 3), (128, 4), (384, 2), (1024, 1))
OUTPUT_LENGTHS = ((16, 3), (64, 4), (128, 2), (256, 1))
QUICK_PROMPT_LENGTHS = ((8, 1), (24, 1), (48, 1))
QUICK_OUTPUT_LENGTHS = ((4, 1), (12, 1), (24, 1))


# ----------------------------------------------------------------------------- workload
def workload(count: int, rate: float, quick: bool, vocab: int, seed: int) -> list[dict]:
    """``count`` requests: Poisson arrival offsets at ``rate`` per second, prompt token ids and
    output lengths from the mixed distribution (the same for every leg at a rate)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    prompts = QUICK_PROMPT_LENGTHS if quick else PROMPT_LENGTHS
    outputs = QUICK_OUTPUT_LENGTHS if quick else OUTPUT_LENGTHS

    def draw(table):
        values, weights = zip(*table, strict=True)
        return rng.choice(values, p=np.asarray(weights) / sum(weights))

    offsets = np.cumsum(rng.exponential(1.0 / rate, size=count))
    offsets -= offsets[0]
    return [
        {
            "at": float(offset),
            "prompt": rng.integers(3, vocab, size=int(draw(prompts))).tolist(),
            "max_tokens": int(draw(outputs)),
        }
        for offset in offsets
    ]


# ----------------------------------------------------------------------------- the client
async def _one(client, url: str, request: dict, start: float, record: dict) -> None:
    import httpx

    await asyncio.sleep(max(0.0, start + request["at"] - time.perf_counter()))
    body = {
        "model": "bench",
        "prompt": request["prompt"],
        "max_tokens": request["max_tokens"],
        "stream": True,
        "ignore_eos": True,
        "return_token_ids": True,
        **request.get("extra", {}),
    }
    sent = time.perf_counter()
    times: list[float] = []
    gaps: list[float] = []  # per token after the first: its chunk's gap, spread over its tokens
    try:
        await _stream(client, url, body, times, gaps, record)
    except httpx.HTTPError as error:  # a server that broke the connection fails the request
        record["error"] = f"{type(error).__name__}: {error}"
    record["sent"] = sent
    if "error" not in record:
        record.update(times=times, gaps=gaps)


async def _stream(client, url: str, body: dict, times: list, gaps: list, record: dict) -> None:
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            record["error"] = f"HTTP {response.status_code}"
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                record["error"] = chunk["error"]["message"]
                return
            now = time.perf_counter()
            count = len(chunk["choices"][0].get("token_ids") or [])
            if count and times:
                gaps += [(now - times[-1]) / count] * count
            elif count > 1:
                gaps += [0.0] * (count - 1)
            times += [now] * count


async def drive(url: str, requests: list[dict], kv_probe) -> dict:
    """Sends ``requests`` at their arrival offsets, streams every answer; returns the
    latency and throughput summary (and the KV probe's samples)."""
    import httpx

    records = [{} for _ in requests]
    samples: list[float] = []
    limits = httpx.Limits(max_connections=len(requests) + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        stop = asyncio.Event()

        async def probe():
            while not stop.is_set():
                # A busy or broken server: the requests' records say which.
                with contextlib.suppress(httpx.HTTPError):
                    samples.append(await kv_probe(client))
                await asyncio.sleep(0.05)

        prober = asyncio.create_task(probe())
        start = time.perf_counter()
        await asyncio.gather(
            *(_one(client, url, r, start, rec) for r, rec in zip(requests, records, strict=True))
        )
        end = time.perf_counter()
        stop.set()
        await prober
    return summarize(records, start, end, samples)


def _percentile(values: list[float], q: float) -> float | None:
    import numpy as np

    return float(np.percentile(values, q)) if values else None


def summarize(records: list[dict], start: float, end: float, kv: list[float]) -> dict:
    done = [r for r in records if r.get("times")]
    ttft = [r["times"][0] - r["sent"] for r in done]
    itl = [gap for r in done for gap in r["gaps"]]
    tokens = sum(len(r["times"]) for r in done)
    seconds = end - start
    return {
        "requests": len(records),
        "completed": len(done),
        "errors": sorted({r["error"] for r in records if "error" in r})[:3],
        "seconds": seconds,
        "req_s": len(done) / seconds,
        "out_tok_s": tokens / seconds,
        "ttft_p50": _percentile(ttft, 50),
        "ttft_p99": _percentile(ttft, 99),
        "itl_p50": _percentile(itl, 50),
        "itl_p99": _percentile(itl, 99),
        "kv_mib_peak": max(kv, default=0.0) / 2**20,
        "kv_mib_mean": (sum(kv) / len(kv) if kv else 0.0) / 2**20,
    }


# ----------------------------------------------------------------------------- legs
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_leg(leg: str, args) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(args.threads)}
    if leg.startswith("attnexport"):
        served = args.work / "smollm2" if args.structured else args.work / "ours" / "model.onnx"
        command = [
            sys.executable, "-m", "attnexport.cli.main", "serve",
            str(served), "--port", str(port),
            "--served-model-name", "bench",
            "--num-threads", str(args.threads), "--max-num-seqs", str(args.max_num_seqs),
            "--kv-cache-memory", str(args.kv_cache_gib), "--log-level", "warning",
        ]  # fmt: skip
    else:
        python = args.genai_python if leg == "genai" else sys.executable
        workers = args.genai_workers if leg == "genai" else 1
        command = [
            python, __file__, "--front", leg, "--port", str(port), "--work", str(args.work),
            "--threads", str(args.threads), "--workers", str(workers),
        ]  # fmt: skip
    log = args.work / f"{leg}.log"
    with log.open("wb") as output:  # (the child keeps its own descriptor)
        process = subprocess.Popen(command, env=env, stderr=output, stdout=output)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    import httpx

    while True:
        if process.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{leg}: the server exited ({log}): {tail}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"{leg}: the server did not start")
        time.sleep(0.5)


def kv_probe_for(leg: str, url: str):
    if leg.startswith("attnexport"):

        async def probe(client) -> float:
            text = (await client.get(f"{url}/metrics")).text
            for line in text.splitlines():
                if line.startswith("attnexport_kv_bytes_in_use{"):
                    return float(line.rsplit(" ", 1)[1])
            return 0.0

        return probe

    async def probe(client) -> float:
        return float((await client.get(f"{url}/kv")).json()["bytes"])

    return probe


def run_leg(leg: str, args, rates: list[float]) -> dict[float, dict]:
    process, url = start_leg(leg, args)
    results = {}
    try:
        warm = _extra(workload(4, 100.0, args.quick, args.vocab, seed=99), leg)
        asyncio.run(drive(url, warm, kv_probe_for(leg, url)))
        for i, rate in enumerate(rates):
            requests = _extra(workload(args.requests, rate, args.quick, args.vocab, seed=i), leg)
            results[rate] = asyncio.run(drive(url, requests, kv_probe_for(leg, url)))
            print(f"{leg} @ {rate} req/s: {results[rate]}", file=sys.stderr)
            seconds = results[rate]["seconds"]
            if args.leg_budget and seconds > args.leg_budget:  # higher rates only take longer
                for later in rates[i + 1 :]:
                    results[later] = {"skipped": f"not run: {seconds:.0f} s at {rate:g} req/s"}
                break
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
    return results


def _extra(requests: list[dict], leg: str) -> list[dict]:
    """The structured leg's requests: the same, with logprobs and the JSON schema."""
    if leg.endswith("+structured"):
        schema = {
            "type": "json_schema",
            "json_schema": {"name": "notes", "schema": STRUCTURED_SCHEMA},
        }
        for request in requests:
            request["extra"] = {"logprobs": 1, "response_format": schema}
    return requests


def run_structured(args) -> dict:
    """The plain and the structured leg on the SmolLM2 export, alternating ``--repeat``
    times."""
    import smollm2

    served = args.work / "smollm2"
    if not (served / "manifest.json").exists():
        from attnexport.cli.main import main as cli

        if cli(["export", str(smollm2.build_checkpoint()), "--out", str(served)]) != 0:
            raise RuntimeError("the SmolLM2 export failed")
    repeats = []
    for repeat in range(args.repeat):
        results = {leg: run_leg(leg, args, args.rates) for leg in STRUCTURED_LEGS}
        best = sustained(results, args.ttft_slo)
        print(f"repeat {repeat}: sustained {best}", file=sys.stderr)
        repeats.append({"results": results, "sustained": best})
    return repeats


# ----------------------------------------------------------------------------- report
def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def table(results: dict[str, dict[float, dict]], rates: list[float]) -> list[str]:
    lines = [
        "| leg | offered req/s | achieved req/s | output tok/s | TTFT p50 / p99 ms "
        "| ITL p50 / p99 ms | KV MiB peak / mean | failed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for leg, by_rate in results.items():
        for rate in rates:
            r = by_rate.get(rate)
            if r is None:
                continue
            if "skipped" in r:
                lines.append(f"| {leg} | {rate:g} | skipped: {r['skipped']} | | | | | |")
                continue
            lines.append(
                f"| {leg} | {rate:g} | {r['req_s']:.2f} | {r['out_tok_s']:.0f} "
                f"| {_ms(r['ttft_p50'])} / {_ms(r['ttft_p99'])} "
                f"| {_ms(r['itl_p50'])} / {_ms(r['itl_p99'])} "
                f"| {r['kv_mib_peak']:.1f} / {r['kv_mib_mean']:.1f} "
                f"| {r['requests'] - r['completed']} |"
            )
    return lines


def sustained(results: dict[str, dict[float, dict]], slo: float) -> dict[str, float]:
    """Per leg: the highest offered rate up to which every rate kept its p99 TTFT under
    ``slo`` with every request completed (0 when the lowest did not)."""
    best = {}
    for leg, by_rate in results.items():
        best[leg] = 0.0
        for rate in sorted(by_rate):
            r = by_rate[rate]
            ok = (
                "skipped" not in r
                and r["completed"] == r["requests"]
                and r["ttft_p99"] is not None
                and r["ttft_p99"] <= slo
            )
            if not ok:
                break
            best[leg] = rate
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, few requests")
    parser.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0, 2.0, 4.0])
    parser.add_argument("--requests", type=int, default=40, help="requests per rate")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--kv-cache-gib", type=float, default=1.0)
    parser.add_argument("--ttft-slo", type=float, default=2.0, help="seconds of p99 TTFT")
    parser.add_argument("--legs", nargs="+", default=list(LEGS), choices=LEGS)
    parser.add_argument("--work", type=Path, default=ROOT / "out" / "bench_generate")
    parser.add_argument("--genai-python", default=sys.executable)
    parser.add_argument("--genai-workers", type=int, default=4)
    parser.add_argument(
        "--leg-budget",
        type=float,
        default=300.0,
        help="seconds: a leg whose rate took longer skips its higher rates (0: never)",
    )
    parser.add_argument("--json", type=Path, help="also write the results as JSON here")
    parser.add_argument("--write-docs", action="store_true", help="update docs/benchmarks.md")
    parser.add_argument(
        "--report", type=Path, help="print (or --write-docs) the table of a --json run instead"
    )
    # Internal: run a baseline leg's HTTP front in this process.
    parser.add_argument("--front", choices=("genai", "transformers"), help=argparse.SUPPRESS)
    parser.add_argument(
        "--structured",
        action="store_true",
        help="plain against logprobs + JSON-schema requests on the SmolLM2 export",
    )
    parser.add_argument("--repeat", type=int, default=2, help="--structured: alternations")
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--workers", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.front:
        import serve_front  # in the leg's interpreter: fastapi, uvicorn and the leg's library

        serve_front.main(args)
        return 0
    if args.report:
        return report(json.loads(args.report.read_text()), args)

    # The checkpoint, our export and genai's build are benchmarks/generate.py's (one home).
    import generate

    if args.quick:
        args.rates, args.requests = [2.0, 8.0], 8
    config = generate.QUICK_CONFIG if args.quick else generate.FULL_CONFIG
    args.vocab = config["vocab_size"]
    if args.structured:
        args.vocab = 49152
        args.work.mkdir(parents=True, exist_ok=True)
        repeats = run_structured(args)
        if args.json:
            args.json.write_text(json.dumps(repeats, indent=1))
        for i, repeat in enumerate(repeats):
            print(f"repeat {i}:")
            print("\n".join(table(repeat["results"], args.rates)))
            plain, structured = (repeat["sustained"].get(leg, 0.0) for leg in STRUCTURED_LEGS)
            ratio = structured / plain if plain else float("nan")
            print(
                f"sustained: plain {plain:g} req/s, structured {structured:g} req/s ({ratio:.2f}x)"
            )
        return 0
    args.work = args.work / ("quick" if args.quick else "full")
    checkpoint = args.work / "ckpt"
    if not (checkpoint / "config.json").exists():
        generate.make_checkpoint(checkpoint, args.quick)
    if not (args.work / "ours" / "model.onnx").exists():
        generate.export_onnx(checkpoint, args.work / "ours" / "model.onnx")
    legs = list(args.legs)
    if "genai" in legs and not (args.work / "genai" / "genai_config.json").exists():
        try:
            generate.build_genai(args.genai_python, checkpoint, args.work / "genai", args.threads)
        except (subprocess.CalledProcessError, OSError) as error:
            print(f"genai: cannot build ({error}); pass --genai-python", file=sys.stderr)

    results: dict[str, dict[float, dict]] = {}
    for leg in legs:
        try:
            results[leg] = run_leg(leg, args, args.rates)
        except RuntimeError as error:
            print(str(error), file=sys.stderr)
            results[leg] = {
                rate: {"skipped": str(error).splitlines()[0][:80]} for rate in args.rates
            }

    import platform

    import onnxruntime

    header = (
        f"{'Tiny smoke-test model' if args.quick else 'Llama-like ~125M model'} "
        f"({'x'.join(str(v) for v in config.values())} hidden/intermediate/layers/heads/"
        "kv-heads/vocab, fp32, random weights seed 0); "
        f"{args.requests} requests per rate, Poisson arrivals, prompt lengths "
        f"{_mix(QUICK_PROMPT_LENGTHS if args.quick else PROMPT_LENGTHS)} and output lengths "
        f"{_mix(QUICK_OUTPUT_LENGTHS if args.quick else OUTPUT_LENGTHS)} tokens (seeded), greedy, "
        f"streamed; {args.threads} threads per server; genai: {args.genai_workers} generators "
        f"at a time; {platform.processor() or platform.machine()}, onnxruntime "
        f"{onnxruntime.__version__}. TTFT and ITL as the client sees them (a chunk of k "
        "tokens counts k gaps of 1/k of its wait)."
    )
    run = {"header": header, "rates": args.rates, "results": results}
    if args.json:
        args.json.write_text(json.dumps(run, indent=1))
    return report(run, args)


def report(run: dict, args) -> int:
    """Prints (and with ``--write-docs`` writes) the table of a run and its sustained rates."""
    rates = [float(r) for r in run["rates"]]
    results = {
        leg: {float(rate): r for rate, r in by_rate.items()}
        for leg, by_rate in run["results"].items()
    }
    best = sustained(results, args.ttft_slo)
    lines = [
        run["header"],
        "",
        *table(results, rates),
        "",
        f"Sustained rate (the highest offered rate up to which every rate kept p99 TTFT <= "
        f"{args.ttft_slo:g} s and completed every request): "
        + ", ".join(f"{leg} {rate:g} req/s" for leg, rate in best.items())
        + ".",
    ]
    print("\n".join(lines))
    if args.write_docs:
        import generate  # (one home for rewriting a section of docs/benchmarks.md)

        generate.write_docs(lines, "## Serving (CPU)")
    return 0


def _mix(table_: tuple[tuple[int, int], ...]) -> str:
    total = sum(w for _, w in table_)
    return "{" + ", ".join(f"{n}: {w / total:.0%}" for n, w in table_) + "}"


if __name__ == "__main__":
    sys.exit(main())
