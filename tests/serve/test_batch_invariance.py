"""Batch invariance on the real checkpoint: for every export the CLI makes by default (float32,
``--weights int8``, ``--weights int4``), the greedy tokens of a prompt decoded alone equal its
tokens when it runs with others (mixed prompt lengths, prefills chunked beside decodes),
through the engine and through the server with concurrent clients. The int4 default (hqq) is
quantized only with ATTNEXPORT_SLOW_TESTS=1 (tests/real_model.py); ``int4-rtn`` runs the same
MatMulNBits kernels in every run. The default run keeps the cases no other test covers (the
skip reasons say which); ATTNEXPORT_SLOW_TESTS=1 runs them all.

int4 at accuracy level 4 once changed 8 of 16 greedy answers when batched: MatMulNBits runs a
one-row input through a kernel of its own (attnexport.batch_invariance)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from attnexport.cli.verify_text import TEXT
from attnexport.runtime import CacheConfig, SamplingParams, SchedulerConfig, engine_from_path
from tests.real_model import HQQ_SECONDS, slow_param

NEW_TOKENS = 16
MAX_MODEL_LEN = 256  # the longest prompt (113 tokens) and its answer, with room
# (offset, length) in characters of the verify text: prompts of 5, 74, 13, 113 and 4 tokens.
CUTS = ((0, 12), (40, 300), (100, 60), (200, 400), (700, 8))
PROMPTS = [TEXT[o : o + n] for o, n in CUTS]


FP32_COVERED = "float32 alone and batched: tests/runtime/test_engine_scoring.py"
SERVED = "the server's batching is the engine's: int4-rtn covers it in the default run"


def _artifact(name: str, smollm2_fp32_artifact, smollm2_quantized):
    return smollm2_fp32_artifact if name == "fp32" else smollm2_quantized(name)


def _engine_and_prompts(artifact, prefix_caching: bool, **scheduler):
    """An engine of ``artifact`` (128 blocks, ``max_num_seqs`` 8, ``scheduler``'s limits) and
    :data:`PROMPTS` as its tokenizer's ids."""
    from attnexport.runtime import Tokenizer

    tokenizer = Tokenizer.from_directory(artifact)
    engine = engine_from_path(
        artifact,
        cache_config=CacheConfig(num_blocks=128, enable_prefix_caching=prefix_caching),
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_model_len=MAX_MODEL_LEN, **scheduler),
    )
    return engine, [tokenizer.encode(p) for p in PROMPTS]


@pytest.mark.parametrize(
    "name",
    [slow_param("fp32", FP32_COVERED), "int8", "int4-rtn", slow_param("int4", HQQ_SECONDS)],
)
def test_the_engine_decodes_a_prompt_alike_alone_and_in_a_mixed_batch(
    name, smollm2_fp32_artifact, smollm2_quantized
):
    artifact = _artifact(name, smollm2_fp32_artifact, smollm2_quantized)
    # 48 tokens a step: the long prompts' prefills are chunked and run beside decodes.
    engine, prompts = _engine_and_prompts(artifact, False, max_num_batched_tokens=48)
    params = SamplingParams(max_tokens=NEW_TOKENS)
    alone = [list(engine.generate([p], params)[0].token_ids) for p in prompts]
    # Rotated: each prompt sits elsewhere in the batch than in the prompt list.
    rotated = prompts[2:] + prompts[:2]
    together = [list(o.token_ids) for o in engine.generate(rotated, params)]
    assert together == alone[2:] + alone[:2]


@pytest.mark.parametrize(
    "name",
    [
        slow_param("fp32", SERVED),
        slow_param("int8", SERVED),
        "int4-rtn",
        slow_param("int4", HQQ_SECONDS),
    ],
)
def test_the_server_answers_a_prompt_alike_alone_and_among_concurrent_clients(
    name, smollm2_fp32_artifact, smollm2_quantized
):
    pytest.importorskip("fastapi", reason="needs the serve extra (fastapi, uvicorn)")
    openai = pytest.importorskip("openai", reason="needs the dev extra (the openai client)")
    from tests.serve.helpers import running_server

    def complete(url: str, prompt: str) -> list[int]:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
        completion = client.completions.create(
            model="export",
            prompt=prompt,
            max_tokens=NEW_TOKENS,
            temperature=0,
            extra_body={"return_token_ids": True},
        )
        return completion.choices[0].token_ids  # type: ignore[attr-defined]

    with running_server(
        _artifact(name, smollm2_fp32_artifact, smollm2_quantized),
        name="export",
        max_model_len=MAX_MODEL_LEN,
        kv_cache_bytes=64 << 20,
    ) as url:
        alone = [complete(url, p) for p in PROMPTS]
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            concurrent = list(pool.map(lambda p: complete(url, p), PROMPTS))
    assert concurrent == alone


@pytest.mark.parametrize("name", ["int8", slow_param("int4", HQQ_SECONDS)])
def test_a_prefix_cache_hit_answers_as_the_prompt_computed_whole(
    name, smollm2_fp32_artifact, smollm2_quantized
):
    """The second time a prompt comes, its leading blocks are cached and only its tail is
    computed: the tail's rows must run the same attention path as when the prompt was
    computed whole (a one-token tail ran the decode path: the 113-token prompt, 7 cached
    blocks and 1 token, answered otherwise in int8)."""
    artifact = _artifact(name, smollm2_fp32_artifact, smollm2_quantized)
    engine, prompts = _engine_and_prompts(artifact, True)
    params = SamplingParams(max_tokens=NEW_TOKENS)
    whole = [engine.generate([p], params)[0] for p in prompts]
    cached = [engine.generate([p], params)[0] for p in prompts]
    assert [o.metrics.num_cached_prompt_tokens for o in whole] == [0] * len(prompts)
    assert sum(o.metrics.num_cached_prompt_tokens for o in cached) >= 96 + 64
    assert [o.token_ids for o in cached] == [o.token_ids for o in whole]
