"""The real checkpoint's float32 export (tests/real_model.py) prefills a long prompt in chunks,
beside a short one that arrives with it, through the native kernels' tiled prefill (several
tiles, chunks of keys, a prefill chunk over cached context, a mixed batch) and generates the
greedy tokens transformers generates for each prompt alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from attnexport.runtime import SamplingParams, SchedulerConfig, engine_from_path
from tests.helpers import requires_ort_kernels
from tests.real_model import transformers_greedy

LONG_TOKENS = 1100  # 3 chunks of the budget below
BUDGET = 512
NEW_TOKENS = 16
TEXT = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


@requires_ort_kernels
def test_chunked_prefill_of_a_long_prompt_matches_transformers(
    smollm2_checkpoint, smollm2_fp32_artifact
):
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_checkpoint)
    long = tokenizer(TEXT.read_text())["input_ids"][:LONG_TOKENS]
    short = tokenizer("The paged KV cache of a language model")["input_ids"]
    assert len(long) == LONG_TOKENS

    expected = transformers_greedy(
        smollm2_checkpoint,
        (long, short),
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        pad_token_id=tokenizer.eos_token_id,
    )
    engine = engine_from_path(
        smollm2_fp32_artifact, scheduler_config=SchedulerConfig(max_num_batched_tokens=BUDGET)
    )
    assert engine.executor.kernels == "native"
    outputs = engine.generate([long, short], SamplingParams(max_tokens=NEW_TOKENS))
    assert [o.token_ids for o in outputs] == expected
    # The long prompt ran in chunks, and the short one started before the long one's last.
    assert engine.stats.num_steps >= LONG_TOKENS // BUDGET + NEW_TOKENS
    assert outputs[1].metrics.first_token_time < outputs[0].metrics.first_token_time
