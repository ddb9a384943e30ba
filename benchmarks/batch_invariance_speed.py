"""What the batch-invariance rows cost a decode, and what dropping the ones the CPU does not
need gives back: greedy decode tok/s of one export through the Engine with the runtime's row
dropping (``attnexport.batch_invariance.session_source``) on and off, in alternating rounds in
one process (the same prompts; a machine's load moves both legs alike).

    python benchmarks/batch_invariance_speed.py EXPORT_DIR [--batch 1] [--rounds 6]
        [--prompt-len 128] [--new-tokens 32]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path


def _engine(export: Path, drop_rows: bool, max_num_seqs: int):
    import attnexport.batch_invariance as batch_invariance
    from attnexport.runtime import CacheConfig, SchedulerConfig, engine_from_path

    real = batch_invariance.session_source
    if not drop_rows:
        batch_invariance.session_source = lambda path, options: str(path)
    try:
        return engine_from_path(
            export,
            cache_config=CacheConfig(num_blocks=512, enable_prefix_caching=False),
            scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=1024),
        )
    finally:
        batch_invariance.session_source = real


def _decode_rate(engine, prompts: list[list[int]], new_tokens: int) -> float:
    """Decoded tokens per second after the last first token (the prefill left out)."""
    from attnexport.runtime import SamplingParams

    params = SamplingParams(max_tokens=new_tokens + 1, min_tokens=new_tokens + 1)
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    total = time.perf_counter() - start
    first = max(o.metrics.first_token_time for o in outputs) - min(
        o.metrics.arrival_time for o in outputs
    )
    return len(prompts) * new_tokens / (total - first)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export", type=Path)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    engines = {
        "rows dropped": _engine(args.export, True, args.batch),
        "rows kept": _engine(args.export, False, args.batch),
    }
    prompts = [
        [100 + (i * 7 + j) % 5000 for j in range(args.prompt_len)] for i in range(args.batch)
    ]
    rates: dict[str, list[float]] = {name: [] for name in engines}
    order = list(engines.items())
    for round_ in range(args.rounds):
        for name, engine in order if round_ % 2 == 0 else order[::-1]:
            rates[name].append(_decode_rate(engine, prompts, args.new_tokens))
    for name, values in rates.items():
        print(f"{name}: {statistics.median(values):.1f} tok/s median, {max(values):.1f} best")
    ratio = statistics.median(rates["rows dropped"]) / statistics.median(rates["rows kept"])
    print(f"dropped / kept (medians): {ratio:.3f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
