"""Decoder-only architectures vs transformers: logits of a ragged prefill and 8 decode steps
(max abs error <= 1e-4, fp32) and 32 greedy tokens, through eager, the saved ``.pt2`` and ONNX
on onnxruntime (bodies and native kernels), then greedy tokens of ragged batches through the
engine on both runtime executors. Each case is a checkpoint built by transformers and imported
with ``from_pretrained``; the configs exercise the options the importer honours, with sliding
windows shorter than the longest prompt, so that prompts and generations cross them. Every
case is exported once (``.pt2`` and ``.onnx``) for all its legs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import transformers

from attnexport.models import load_model
from attnexport.runtime import CacheConfig, Engine, SamplingParams, SchedulerConfig
from attnexport.runtime.step_driver import PagedDriver
from attnexport.tolerances import model_tolerance
from tests.models.executors import (
    ENGINE_EXECUTORS,
    PAGED_EXECUTORS,
    Exports,
    engine_executor,
    make_runner,
    paged_runner,
    teacher_forced_logits,
    write_exports,
)
from tests.models.hf_reference import (
    TINY_DECODER,
    WIDE_INIT,
    build_checkpoint,
    causal_lm_logits,
    greedy_generate,
)
from tests.real_model import skip_unless_slow

BLOCK_SIZE = 4
NUM_BLOCKS = 96
PROMPTS = ([5, 17, 3, 99, 42, 8, 1], [7, *range(20, 43)], [11, 2])
DECODE_STEPS = 8
GREEDY_STEPS = 32
ATOL = model_tolerance(torch.float32)

_COMMON = TINY_DECODER
_WIDE = WIDE_INIT  # for the configs with other size names (BLOOM, GPT-2)

# name -> (transformers class, config)
CASES = {
    "llama-gqa-llama3rope-bias": (
        "LlamaForCausalLM",
        lambda: transformers.LlamaConfig(
            **_COMMON,
            num_attention_heads=4,
            num_key_value_heads=2,
            attention_bias=True,
            mlp_bias=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
    ),
    "llama-mha-tied-headdim": (
        "LlamaForCausalLM",
        lambda: transformers.LlamaConfig(
            **_COMMON,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=24,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "linear", "rope_theta": 1000.0, "factor": 2.0},
        ),
    ),
    "mistral-window": (
        "MistralForCausalLM",
        lambda: transformers.MistralConfig(
            **_COMMON, num_attention_heads=4, num_key_value_heads=1, sliding_window=5
        ),
    ),
    "qwen2-window-layer1": (
        "Qwen2ForCausalLM",
        lambda: transformers.Qwen2Config(
            **_COMMON,
            num_attention_heads=4,
            num_key_value_heads=2,
            use_sliding_window=True,
            sliding_window=6,
            max_window_layers=1,
            tie_word_embeddings=True,
        ),
    ),
    "qwen3-qknorm-window-bias": (
        "Qwen3ForCausalLM",
        lambda: transformers.Qwen3Config(
            **_COMMON,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            attention_bias=True,
            use_sliding_window=True,
            sliding_window=5,
            max_window_layers=1,
            rms_norm_eps=1e-5,
        ),
    ),
    "gemma2-softcaps-window": (
        "Gemma2ForCausalLM",
        lambda: transformers.Gemma2Config(
            **_COMMON,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=5,
            # caps the wide initialisation reaches (scores ~ +-10, logits ~ +-15)
            attn_logit_softcapping=3.0,
            final_logit_softcapping=5.0,
            # tied, the scaled input embedding dominates the last hidden state of these random
            # weights and greedy decoding repeats the last prompt token
            tie_word_embeddings=False,
        ),
    ),
    "gemma3-qknorm-localrope-window": (
        "Gemma3ForCausalLM",
        lambda: transformers.Gemma3TextConfig(
            **{**_COMMON, "num_hidden_layers": 3},
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=6,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 4.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            },
            final_logit_softcapping=6.0,
            tie_word_embeddings=False,
        ),
    ),
    "phi3-longrope-short-partial-window": (
        "Phi3ForCausalLM",
        lambda: transformers.Phi3Config(
            **_COMMON,
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=5,
            max_position_embeddings=4096,
            original_max_position_embeddings=128,  # never reached: the short factors
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 500.0,
                "partial_rotary_factor": 0.5,
                "short_factor": [1.0, 1.5, 2.0, 4.0],
                "long_factor": [2.0, 3.0, 8.0, 16.0],
            },
        ),
    ),
    "phi3-longrope-long-su": (
        "Phi3ForCausalLM",
        lambda: transformers.Phi3Config(
            **_COMMON,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=256,
            # every sequence is longer: the long factors from the prompt on
            original_max_position_embeddings=1,
            rope_scaling={
                "type": "su",
                "attention_factor": 1.2,
                "original_max_position_embeddings": 1,
                "short_factor": [1.0 + i / 4 for i in range(8)],
                "long_factor": [1.0 + i for i in range(8)],
            },
        ),
    ),
    "bloom-alibi6heads-postln": (
        "BloomForCausalLM",
        lambda: transformers.BloomConfig(
            hidden_size=48,
            n_layer=2,
            n_head=6,
            apply_residual_connection_post_layernorm=True,
            **_WIDE,
        ),
    ),
    "gpt2-untied-layerscale": (
        "GPT2LMHeadModel",
        lambda: transformers.GPT2Config(
            n_positions=80,
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_inner=80,
            **_WIDE,
            scale_attn_by_inverse_layer_idx=True,
            tie_word_embeddings=False,
        ),
    ),
}


@dataclass
class Loaded:
    name: str
    hf_model: object
    model: object


@pytest.fixture(scope="module", params=list(CASES))
def loaded(request, tmp_path_factory) -> Loaded:
    hf_class, make_config = CASES[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    hf_model = build_checkpoint(hf_class, make_config(), directory)
    return Loaded(request.param, hf_model, load_model(directory))


@pytest.fixture(scope="module")
def exports(loaded, tmp_path_factory) -> Exports:
    return write_exports(loaded.model, BLOCK_SIZE, tmp_path_factory.mktemp(f"{loaded.name}-x"))


@pytest.fixture(scope="module")
def hf_greedy(loaded) -> list[tuple[list[int], torch.Tensor]]:
    """transformers' greedy tokens and logits of each prompt, generated alone."""
    return [greedy_generate(loaded.hf_model, prompt, GREEDY_STEPS) for prompt in PROMPTS]


# The .pt2 leg runs the program the ONNX legs are converted from, on the eager leg's kernels:
# a family's own code is checked by those; the .pt2 file itself by these two families.
PT2_CASES = ("llama-gqa-llama3rope-bias", "gemma3-qknorm-localrope-window")


@pytest.fixture(scope="module", params=PAGED_EXECUTORS)
def runner(request, loaded, exports):
    if request.param == "pt2" and loaded.name not in PT2_CASES:
        skip_unless_slow(f"the eager and ONNX legs check this family; the .pt2: {PT2_CASES}")
    return paged_runner(loaded.model, request.param, exports)


def _driver(loaded: Loaded, runner) -> PagedDriver:
    return PagedDriver(runner, loaded.model.cache_spec(BLOCK_SIZE), NUM_BLOCKS, seed=1)


def test_prefill_and_decode_logits_match_transformers(loaded, runner):
    driver = _driver(loaded, runner)
    for prompt in PROMPTS:
        driver.add(prompt)
    logits = teacher_forced_logits(driver, DECODE_STEPS, vocab_size=128)
    for seq, (prompt, ours) in enumerate(zip(PROMPTS, logits, strict=True)):
        reference = causal_lm_logits(loaded.hf_model, driver.sequences[seq].tokens)
        assert ours.dtype == torch.float32
        assert ours.shape == reference.shape == (len(prompt) + DECODE_STEPS, 128)
        torch.testing.assert_close(ours, reference, atol=ATOL, rtol=0)


def test_greedy_tokens_match_transformers(loaded, runner, hf_greedy):
    driver = _driver(loaded, runner)
    for prompt in PROMPTS:
        driver.add(prompt)
    ours, our_logits = driver.greedy(GREEDY_STEPS)
    for tokens, logits, (expected, expected_logits) in zip(
        ours, our_logits, hf_greedy, strict=True
    ):
        assert tokens == expected
        torch.testing.assert_close(logits, expected_logits, atol=ATOL, rtol=0)
    assert len({t for tokens in ours for t in tokens}) > 3, "degenerate greedy output"


# The engine legs run the families whose windows, soft caps, q/k norms and LongRoPE came with
# issue 22 (the engine on the older ones: tests/runtime/test_executors.py, tests/cli).
ENGINE_CASES = [name for name in CASES if name.startswith(("qwen3", "gemma", "phi3"))]
# The engine's scheduling is the executor's caller, whatever the executor: the default run
# takes every family on the native kernels (what serving runs) and one on all three.
ENGINE_EXECUTOR = "ort-native"
ENGINE_ALL_EXECUTORS = "gemma3-qknorm-localrope-window"


@pytest.mark.parametrize("loaded", ENGINE_CASES, indirect=True)
@pytest.mark.parametrize("executor", ENGINE_EXECUTORS)
def test_engine_greedy_matches_transformers(loaded, exports, hf_greedy, executor):
    """The prompts as one ragged batch through the engine (continuous batching, prefills
    chunked at 16 tokens beside decodes) on a runtime executor: each sequence's greedy
    tokens are those transformers generates for it alone."""
    if executor != ENGINE_EXECUTOR and loaded.name != ENGINE_ALL_EXECUTORS:
        skip_unless_slow(
            f"the paged legs run this family on every executor, the engine on {ENGINE_EXECUTOR}"
        )
    engine = Engine(
        engine_executor(executor, exports),
        CacheConfig(num_blocks=NUM_BLOCKS),
        SchedulerConfig(max_model_len=128, max_num_batched_tokens=16),
    )
    outputs = engine.generate([list(p) for p in PROMPTS], SamplingParams(max_tokens=GREEDY_STEPS))
    assert [o.token_ids for o in outputs] == [tokens for tokens, _ in hf_greedy]


def test_chunked_prefill_mixed_with_decode_matches_transformers(loaded):
    """Prompts computed in chunks of 3 tokens while another sequence decodes: sliding windows
    and RoPE positions must hold across chunk boundaries."""
    driver = PagedDriver(
        make_runner(loaded.model, "eager", BLOCK_SIZE, None),
        loaded.model.cache_spec(BLOCK_SIZE),
        NUM_BLOCKS,
    )
    long_prompt, short_prompt = PROMPTS[1], PROMPTS[0]
    driver.add(long_prompt)
    driver.add(short_prompt)
    collected = {0: [], 1: []}
    collected[1].append(driver.step({1: len(short_prompt)}, all_logits=True)[1])
    done = 0
    while done < len(long_prompt):
        chunk = min(3, len(long_prompt) - done)
        driver.append(1, done % 128)
        out = driver.step({0: chunk, 1: 1}, all_logits=True)
        collected[0].append(out[0])
        collected[1].append(out[1])
        done += chunk
    for seq in (0, 1):
        reference = causal_lm_logits(loaded.hf_model, driver.sequences[seq].tokens)
        torch.testing.assert_close(torch.cat(collected[seq]), reference, atol=ATOL, rtol=0)


def test_soft_capped_gemma2_matches_the_float64_reference(tmp_path):
    """Gemma 2 run in float64 (eager) against transformers in float64 on a prompt longer than
    the window: equal to the rounding of the float32 logits the forward returns, where
    dropping the soft caps moves the logits by far more."""
    make_config = CASES["gemma2-softcaps-window"][1]
    hf_model = build_checkpoint("Gemma2ForCausalLM", make_config(), tmp_path / "capped").double()
    uncapped = make_config()
    uncapped.attn_logit_softcapping = uncapped.final_logit_softcapping = None
    hf_uncapped = build_checkpoint("Gemma2ForCausalLM", uncapped, tmp_path / "uncapped").double()
    model = load_model(tmp_path / "capped", dtype=torch.float64)
    driver = PagedDriver(make_runner(model, "eager", BLOCK_SIZE, None), model.cache_spec(4), 16)
    driver.add(PROMPTS[1])
    ours = driver.prefill(all_logits=True)[0].double()
    with torch.no_grad():
        reference = hf_model(torch.tensor([PROMPTS[1]])).logits[0]
        without_caps = hf_uncapped(torch.tensor([PROMPTS[1]])).logits[0]
    assert (ours - reference).abs().max() < 2e-6
    assert (without_caps - reference).abs().max() > 1.0


# LongRoPE past the switch length: transformers' generate recomputes a sequence with the long
# factors when it grows past original_max_position_embeddings; the engine preempts it by
# recomputation at that step (attnexport.runtime.scheduler).
ROPE_SWITCH = 12
CROSSING_PROMPTS = (
    PROMPTS[0],  # below the switch, generation crosses it
    PROMPTS[1],  # longer than the switch, prefilled in chunks of at most 16 tokens
    PROMPTS[2],  # 8 tokens only: never crosses
    PROMPTS[1][:9],  # below the switch, the first blocks of PROMPTS[1] (computed long)
)
CROSSING_MAX_TOKENS = (GREEDY_STEPS, GREEDY_STEPS, 8, GREEDY_STEPS)


@dataclass
class Crossing:
    checkpoint: Path
    model: object
    exports: Exports
    hf_tokens: list[list[int]]


@pytest.fixture(scope="module")
def crossing(tmp_path_factory) -> Crossing:
    """A Phi-3 LongRoPE checkpoint with a 12-token switch, exported once, and transformers'
    greedy tokens of :data:`CROSSING_PROMPTS`, each generated alone."""
    config = transformers.Phi3Config(
        **_COMMON,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        original_max_position_embeddings=ROPE_SWITCH,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 500.0,
            "partial_rotary_factor": 0.5,
            "short_factor": [1.0, 1.5, 2.0, 4.0],
            "long_factor": [3.0, 6.0, 12.0, 32.0],
        },
    )
    directory = tmp_path_factory.mktemp("phi3-crossing")
    hf_model = build_checkpoint("Phi3ForCausalLM", config, directory)
    model = load_model(directory)
    exports = write_exports(model, BLOCK_SIZE, tmp_path_factory.mktemp("phi3-crossing-x"))
    hf_tokens = [
        greedy_generate(hf_model, list(prompt), steps)[0]
        for prompt, steps in zip(CROSSING_PROMPTS, CROSSING_MAX_TOKENS, strict=True)
    ]
    return Crossing(directory, model, exports, hf_tokens)


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-prefix-cache", "prefix-cache"])
@pytest.mark.parametrize("executor", ENGINE_EXECUTORS)
def test_longrope_generation_crossing_the_switch_matches_transformers(
    crossing, executor, prefix_caching
):
    """A ragged batch through the engine: a sequence whose generation crosses the switch
    length, one whose prompt is longer than it (chunked at 16 tokens, every chunk past it),
    one that never reaches it, and one sharing the first blocks of the long prompt while
    below it: greedy tokens equal transformers' generate on each alone."""
    if prefix_caching and executor != ENGINE_EXECUTOR:
        skip_unless_slow(
            f"the scheduler recomputes whatever the executor: prefix caching on {ENGINE_EXECUTOR}"
        )
    assert crossing.model.rope_switch_length == ROPE_SWITCH
    runtime = engine_executor(executor, crossing.exports)
    assert runtime.rope_switch_length == ROPE_SWITCH  # the .onnx: from its graph contract
    engine = Engine(
        runtime,
        CacheConfig(num_blocks=NUM_BLOCKS, enable_prefix_caching=prefix_caching),
        SchedulerConfig(max_model_len=64, max_num_batched_tokens=16),
    )
    params = [SamplingParams(max_tokens=n) for n in CROSSING_MAX_TOKENS]
    outputs = engine.generate([list(p) for p in CROSSING_PROMPTS], params)
    assert [o.token_ids for o in outputs] == crossing.hf_tokens
    # the two that cross are recomputed once each; the long prompt never is
    assert engine.stats.num_rope_recomputations == 2
    assert engine.block_manager.num_used_blocks() == 0


def test_longrope_request_whose_recomputation_exceeds_the_token_budget_is_refused(crossing):
    """With fewer tokens a step than the switch length + 1, a request that would grow (or
    whose prompt is) past the switch is refused when added, naming the budget, before any
    step runs; one that stays below it is taken."""
    engine = Engine(
        engine_executor("ort-bodies", crossing.exports),
        CacheConfig(num_blocks=NUM_BLOCKS),
        SchedulerConfig(max_model_len=64, max_num_batched_tokens=ROPE_SWITCH),
    )
    with pytest.raises(ValueError, match=r"max_num_batched_tokens: 12 tokens .* >= 13"):
        engine.add_request(list(PROMPTS[1]), SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        engine.add_request(list(PROMPTS[0]), SamplingParams(max_tokens=7))  # 7 + 7 - 1 > 12
    assert engine.stats.num_steps == 0 and not engine.has_unfinished_requests()
    (output,) = engine.generate([list(PROMPTS[0])], SamplingParams(max_tokens=6))
    assert output.token_ids == crossing.hf_tokens[0][:6]
    # without a SchedulerConfig (the CLI's engine) the default budget holds the switch
    default = Engine(engine_executor("ort-bodies", crossing.exports)).scheduler_config
    assert default.max_num_batched_tokens == 2048
    from attnexport.runtime import TorchExecutor

    phi3_128k = TorchExecutor(crossing.exports.program, rope_switch_length=4096)
    engine = Engine(phi3_128k, CacheConfig(num_blocks=512))
    assert engine.scheduler_config.max_num_batched_tokens == 4097
    # a SchedulerConfig that sets other limits but leaves the budget unset (attnexport serve's)
    engine = Engine(phi3_128k, CacheConfig(num_blocks=512), SchedulerConfig(max_num_seqs=8))
    assert engine.scheduler_config.max_num_batched_tokens == 4097
    assert engine.scheduler.config.max_num_batched_tokens == 4097


def test_longrope_export_records_the_switch_for_the_loader(crossing, tmp_path):
    """``attnexport export``'s manifest records the switch length, and the loader hands it to
    TorchExecutor (a ``.pt2`` holds no such metadata itself)."""
    from attnexport.artifact import ExportOptions, export_artifact
    from attnexport.runtime.loading import load_executor

    out = tmp_path / "export"
    manifest = export_artifact(
        str(crossing.checkpoint), out, ExportOptions(formats=("pt2",), block_size=BLOCK_SIZE)
    )
    assert manifest["rope_switch_length"] == ROPE_SWITCH
    assert load_executor(out, executor="torch").rope_switch_length == ROPE_SWITCH
