"""Chunked prefill bounds the time to first token of a short request that arrives while a long
prompt is prefilled: the long prompt's chunks leave ``waiting_reserve_tokens`` of the step's
budget to waiting requests, so the short one starts in the next step. Asserted by steps and
scheduled tokens (what the engine computed between its arrival and its first token), never by
wall time."""

from __future__ import annotations

import dataclasses

import pytest

from attnexport.models.llama import LlamaConfig, LlamaForCausalLM
from attnexport.runtime import CacheConfig, Engine, SamplingParams, SchedulerConfig, TorchExecutor

LONG, SHORT = 1024, 24
BUDGET = 512  # the long prompt takes 2 chunks alone
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def model():
    """The zoo's tiny Llama with room for the long prompt."""
    config = dataclasses.replace(LlamaConfig.tiny(), max_position_embeddings=LONG + 64)
    return LlamaForCausalLM.from_config(config)


def _engine(model, **scheduler) -> Engine:
    executor = TorchExecutor(model, block_size=BLOCK_SIZE)
    cache = CacheConfig(num_blocks=(LONG + 2 * SHORT) // BLOCK_SIZE + 8)
    return Engine(executor, cache, SchedulerConfig(max_num_batched_tokens=BUDGET, **scheduler))


def _prompts() -> tuple[list[int], list[int]]:
    long = [(7 * i + 3) % 256 for i in range(LONG)]
    return long, [(5 * i + 1) % 256 for i in range(SHORT)]


def _arrive_during_the_long_prefill(engine: Engine) -> tuple[int, int, dict[str, list[int]]]:
    """The long prompt's first step, then the short request: returns (steps, tokens computed)
    from the short one's arrival to its first token, and every request's tokens at the end."""
    long, short = _prompts()
    params = SamplingParams(max_tokens=2)
    engine.add_request(long, params, request_id="long")
    engine.step()
    assert engine.stats.num_computed_tokens == BUDGET
    engine.add_request(short, params, request_id="short")
    computed_before, steps = engine.stats.num_computed_tokens, 0
    while not engine.get_output("short").token_ids:
        engine.step()
        steps += 1
    computed = engine.stats.num_computed_tokens - computed_before
    while engine.has_unfinished_requests():
        engine.step()
    return steps, computed, {r: engine.get_output(r).token_ids for r in ("long", "short")}


def test_a_short_request_starts_in_the_step_after_it_arrives(model):
    engine = _engine(model)
    steps, computed, tokens = _arrive_during_the_long_prefill(engine)
    assert steps == 1
    # One step's budget: half the long prompt's next chunk (the default reserve) and the short
    # prompt, where without the reserve the whole next chunk ran first.
    assert computed == BUDGET // 2 + SHORT
    # The long prompt still finishes: its prefill went on beside the short request.
    assert len(tokens["long"]) == len(tokens["short"]) == 2


def test_no_reserve_lets_the_long_prompt_finish_first(model):
    steps, computed, _ = _arrive_during_the_long_prefill(_engine(model, waiting_reserve_tokens=0))
    assert steps == 2
    assert computed == BUDGET + SHORT + 1  # the long chunk, then the short prompt and a decode
