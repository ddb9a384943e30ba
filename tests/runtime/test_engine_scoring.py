"""The engine's log-probabilities, penalties and grammars on the real SmolLM2 export: scores
equal transformers' log_softmax in float32, a request scores the same alone, batched, chunked
or after another request cached its prompt, and a constrained or penalized request next to a
plain one leaves the plain one's tokens as they are alone."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from attnexport.runtime import CacheConfig, SamplingParams, SchedulerConfig
from attnexport.runtime.engine import engine_from_path
from attnexport.runtime.structured_output import GrammarCompiler, StructuredOutput
from attnexport.tolerances import model_tolerance

EOS = 2
TEXT = (
    "The Amazon rainforest covers much of the Amazon basin of South America. The basin "
    "spans nine nations, and the majority of the forest is contained within Brazil."
)


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_checkpoint))


def _engine(artifact, tokenizer=None, budget: int = 2048, caching: bool = True):
    grammars = GrammarCompiler(tokenizer, 49152, [EOS]) if tokenizer is not None else None
    return engine_from_path(
        artifact,
        cache_config=CacheConfig(memory_bytes=96 << 20, enable_prefix_caching=caching),
        scheduler_config=SchedulerConfig(max_model_len=256, max_num_batched_tokens=budget),
        grammars=grammars,
        num_threads=2,
    )


@pytest.fixture(scope="module")
def engine(smollm2_fp32_artifact, hf_tokenizer):
    return _engine(smollm2_fp32_artifact, hf_tokenizer)


@pytest.fixture(scope="module")
def reference(smollm2_checkpoint):
    """ids -> transformers' float32 ``log_softmax`` rows ``[len(ids), vocab]``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(smollm2_checkpoint), dtype=torch.float32)

    def log_softmax(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)

    return log_softmax


def _scored(engine, prompts, **params):
    params = SamplingParams(max_tokens=4, logprobs=5, prompt_logprobs=5, **params)
    return engine.generate(prompts, params)


def test_scores_equal_transformers_log_softmax(engine, hf_tokenizer, reference):
    prompt = hf_tokenizer.encode(TEXT)
    [output] = _scored(engine, [prompt])
    ids = prompt + output.token_ids
    rows = reference(ids)
    entries = output.prompt_logprobs[1:] + output.outputs[0].logprobs
    assert output.prompt_logprobs[0] is None and len(entries) == len(ids) - 1
    tolerance = model_tolerance(torch.float32)
    for position, entry in enumerate(entries):
        row = rows[position]
        assert entry.token_id == ids[position + 1]
        assert abs(entry.logprob - float(row[entry.token_id])) <= tolerance
        assert abs(entry.rank - (1 + int((row > row[entry.token_id]).sum()))) <= 1
        expected = torch.topk(row, 5).values.tolist()
        assert max(abs(a - b) for a, b in zip(entry.top_logprobs, expected, strict=True)) <= (
            tolerance
        )
    # Greedy: every generated token is its row's most likely one.
    assert all(e.rank == 1 and e.top_ids[0] == e.token_id for e in output.outputs[0].logprobs)


def test_a_request_scores_the_same_alone_batched_chunked_and_after_a_cached_prompt(
    engine, smollm2_fp32_artifact, hf_tokenizer
):
    prompt = hf_tokenizer.encode(TEXT)
    [alone] = _scored(engine, [prompt])
    others = [hf_tokenizer.encode("Hello there"), prompt[:20], list(reversed(prompt))]
    batched = _scored(engine, [others[0], prompt, *others[1:]])[1]
    chunked_engine = _engine(smollm2_fp32_artifact, budget=8)
    [chunked] = _scored(chunked_engine, [prompt])
    # The prompt is now in the prefix cache of both engines; a scoring request computes it.
    engine.generate([prompt], SamplingParams(max_tokens=1))
    [after] = _scored(engine, [prompt])
    for other in (batched, chunked, after):
        assert other.token_ids == alone.token_ids
        assert len(other.prompt_logprobs) == len(prompt)
        for mine, theirs in zip(
            alone.prompt_logprobs[1:] + alone.outputs[0].logprobs,
            other.prompt_logprobs[1:] + other.outputs[0].logprobs,
            strict=True,
        ):
            assert mine.token_id == theirs.token_id and mine.top_ids == theirs.top_ids
            assert abs(mine.logprob - theirs.logprob) <= 1e-5


def test_constrained_and_penalized_requests_leave_their_neighbours_alone(engine, hf_tokenizer):
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 24},
            "founded": {"type": "integer", "minimum": 0, "maximum": 2100},
        },
        "required": ["city", "founded"],
    }
    chat = hf_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name a city and the year it was founded, as JSON."}],
        add_generation_prompt=True,
        return_dict=False,
    )
    plain = SamplingParams(max_tokens=12, stop_token_ids=(EOS,))
    [alone] = engine.generate([chat], plain)
    structured = SamplingParams(
        max_tokens=48,
        stop_token_ids=(EOS,),
        structured=StructuredOutput("json_schema", json.dumps(schema)),
    )
    penalized = SamplingParams(
        max_tokens=12,
        stop_token_ids=(EOS,),
        repetition_penalty=1.5,
        frequency_penalty=1.0,
        logit_bias={alone.token_ids[0]: -100.0},
        logprobs=2,
    )
    outputs = engine.generate([chat, chat, chat], [structured, plain, penalized])
    assert outputs[1].token_ids == alone.token_ids
    answer = json.loads(hf_tokenizer.decode(outputs[0].token_ids, skip_special_tokens=True))
    jsonschema.validate(answer, schema)
    assert outputs[0].finish_reason == "stop"
    assert outputs[2].token_ids[0] != alone.token_ids[0]  # banned by its bias
    # Log-probabilities stay the model's: the banned token keeps its raw score.
    assert outputs[2].outputs[0].logprobs[0].top_ids[0] == alone.token_ids[0]
