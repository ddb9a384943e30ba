"""Decode-step time of an exported model on onnxruntime as the KV cache grows: IO binding with
the cache input and its ``_out`` output bound to one buffer (in place, the recipe of
``attnexport.lowering.ort_session``) versus a plain ``InferenceSession.run`` (which copies every
cache in and out).

The model is the zoo's Llama (2 layers, hidden 256, 4 heads over 1 KV head, fp32); the step
decodes 8 sequences of 100 cached tokens. Only ``num_blocks`` changes between rows, so an
in-place step should cost the same at every size.

Usage::

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/ort_cache_update.py [--blocks 1024 8192 65536]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from attnexport.custom_ops import ScheduledSequence, build_attention_metadata
from attnexport.lowering import PagedOrtSession, to_onnx
from benchmarks.export_time import build

BLOCK_SIZE, SEQS, CONTEXT = 16, 8, 100


def decode_inputs(model, num_blocks: int) -> dict:
    per_seq = -(-(CONTEXT + 1) // BLOCK_SIZE)
    sequences = [
        ScheduledSequence(
            CONTEXT, 1, list(range(num_blocks - (i + 1) * per_seq, num_blocks - i * per_seq))
        )
        for i in range(SEQS)
    ]
    meta = build_attention_metadata(sequences, BLOCK_SIZE)
    return {
        "input_ids": torch.arange(SEQS, dtype=torch.int64),
        "positions": torch.full((SEQS,), CONTEXT, dtype=torch.int64),
        "slot_mapping": meta.slot_mapping,
        "block_tables": meta.block_tables,
        "seq_lens": meta.seq_lens,
        "query_start_loc": meta.query_start_loc,
        "logits_indices": torch.arange(SEQS, dtype=torch.int64),
        "kv_caches": model.cache_spec(BLOCK_SIZE).allocate(num_blocks),
    }


def median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[1024, 8192, 65536])
    args = parser.parse_args()
    model = build(2, 256)
    sample = model.export_sample(BLOCK_SIZE)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "llama.onnx"
        to_onnx(
            model, sample.args, path, dynamic_shapes=sample.dynamic_shapes, output_names=["logits"]
        )
        session = PagedOrtSession(path)
        print(f"torch {torch.__version__}, threads {torch.get_num_threads()}\n")
        print("| num_blocks | cache (MiB) | IO binding, in place (ms) | plain run (ms) |")
        print("|---:|---:|---:|---:|")
        for num_blocks in args.blocks:
            inputs = decode_inputs(model, num_blocks)
            caches = inputs["kv_caches"]
            mib = sum(c.numel() * c.element_size() for c in caches) / 2**20
            in_place = median_ms(lambda inputs=inputs: session.run(inputs), 20)
            feeds = {k: v.numpy() for k, v in inputs.items() if k != "kv_caches"}
            feeds.update({f"kv_caches_{i}": c.numpy() for i, c in enumerate(caches)})
            plain = median_ms(lambda feeds=feeds: session.session.run(None, feeds), 3)
            print(f"| {num_blocks} | {mib:.0f} | {in_place:.2f} | {plain:.1f} |")


if __name__ == "__main__":
    main()
