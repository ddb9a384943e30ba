"""BART (encoder-decoder) vs transformers: the encoder runs inside the step that admits a
sequence, its keys/values go to the paged cross cache once, and later steps pass zero encoder
tokens. Logits of a ragged prefill + 8 decode steps (<= 1e-4, fp32) and 32 greedy tokens,
through eager, the ExportedProgram and ONNX."""

from __future__ import annotations

import pytest
import torch

from attnexport.models import load_model
from attnexport.runtime.step_driver import PagedDriver
from attnexport.tolerances import model_tolerance
from tests.models.executors import EXECUTORS, make_runner, teacher_forced_logits
from tests.models.hf_reference import greedy_generate, tiny_bart

BLOCK_SIZE = 4
NUM_BLOCKS = 128
ENCODER_INPUTS = ([0, 8, 15, 22, 9, 2], [0, *range(30, 51), 2], [0, 5, 2])
DECODER_PROMPTS = ([2, 0, 7], [2], [2, 0, 11, 12, 13, 14])
DECODE_STEPS = 8
GREEDY_STEPS = 32
ATOL = model_tolerance(torch.float32)

CASES = {
    "tied-scaled": dict(scale_embedding=True, tie_word_embeddings=True),
    "untied-gelu_new-heads": dict(
        tie_word_embeddings=False,
        activation_function="gelu_new",
        encoder_attention_heads=2,
        decoder_attention_heads=8,
        encoder_ffn_dim=72,
    ),
}


def _bart(directory, **overrides):
    """A transformers BART (d_model 64, vocabulary 96, no special or forced tokens) saved into
    ``directory``; ``overrides`` replace ``BartConfig`` fields."""
    sizes = dict(vocab_size=96, d_model=64, encoder_attention_heads=4, init_std=0.2)
    ffn = dict(encoder_ffn_dim=96, decoder_ffn_dim=80)
    tokens = ("forced_eos_token_id", "forced_bos_token_id", "eos_token_id", "bos_token_id")
    return tiny_bart(directory, **{**sizes, **ffn, **dict.fromkeys(tokens), **overrides})


@pytest.fixture(scope="module", params=list(CASES))
def loaded(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    hf_model = _bart(directory, **CASES[request.param])
    # A non-zero bias shows that final_logits_bias is applied (transformers initialises zeros).
    with torch.no_grad():
        hf_model.final_logits_bias.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(3))
    hf_model.save_pretrained(directory)
    return hf_model, load_model(directory)


@pytest.fixture(scope="module", params=EXECUTORS)
def runner(request, loaded, tmp_path_factory):
    return make_runner(loaded[1], request.param, BLOCK_SIZE, tmp_path_factory.mktemp("run"))


def _driver(model, runner) -> PagedDriver:
    driver = PagedDriver(runner, model.cache_spec(BLOCK_SIZE), NUM_BLOCKS, seed=2)
    for encoder_ids, prompt in zip(ENCODER_INPUTS, DECODER_PROMPTS, strict=True):
        driver.add(prompt, encoder_ids=encoder_ids)
    return driver


def test_encoding_step_matches_transformers(loaded, runner):
    """The step that admits every sequence: encoder, cross-cache writes, decoder prefill."""
    hf_model, model = loaded
    driver = _driver(model, runner)
    out = driver.prefill(all_logits=True)
    for seq, (encoder_ids, prompt) in enumerate(zip(ENCODER_INPUTS, DECODER_PROMPTS, strict=True)):
        with torch.no_grad():
            reference = hf_model(
                input_ids=torch.tensor([encoder_ids]), decoder_input_ids=torch.tensor([prompt])
            ).logits[0]
        torch.testing.assert_close(out[seq], reference, atol=ATOL, rtol=0)


def test_prefill_and_decode_logits_match_transformers(loaded, runner):
    hf_model, model = loaded
    driver = _driver(model, runner)
    logits = teacher_forced_logits(driver, DECODE_STEPS, vocab_size=96)
    for seq, (encoder_ids, ours) in enumerate(zip(ENCODER_INPUTS, logits, strict=True)):
        with torch.no_grad():
            reference = hf_model(
                input_ids=torch.tensor([encoder_ids]),
                decoder_input_ids=torch.tensor([driver.sequences[seq].tokens]),
            ).logits[0]
        assert ours.shape == reference.shape
        torch.testing.assert_close(ours, reference, atol=ATOL, rtol=0)


def test_greedy_tokens_match_transformers(loaded, runner):
    hf_model, model = loaded
    ours, our_logits = _driver(model, runner).greedy(GREEDY_STEPS)
    for i, (encoder_ids, prompt) in enumerate(zip(ENCODER_INPUTS, DECODER_PROMPTS, strict=True)):
        expected, expected_logits = greedy_generate(
            hf_model, encoder_ids, GREEDY_STEPS, decoder_input_ids=torch.tensor([prompt])
        )
        assert ours[i] == expected
        # Random post-LN BART repeats tokens under greedy search, so the logits each token was
        # chosen from are compared too.
        torch.testing.assert_close(our_logits[i], expected_logits, atol=ATOL, rtol=0)


def test_admitting_a_sequence_while_others_decode(loaded):
    """A step that encodes a new sequence while another only decodes (one encoder token
    count per sequence, zero for the decoding one)."""
    hf_model, model = loaded
    driver = PagedDriver(
        make_runner(model, "eager", BLOCK_SIZE, None), model.cache_spec(BLOCK_SIZE), NUM_BLOCKS
    )
    first = driver.add(DECODER_PROMPTS[0], encoder_ids=ENCODER_INPUTS[0])
    logits_first = [driver.prefill(all_logits=True)[first]]
    driver.append(first, 5)
    second = driver.add(DECODER_PROMPTS[2], encoder_ids=ENCODER_INPUTS[2])
    out = driver.step({first: 1, second: len(DECODER_PROMPTS[2])}, all_logits=True)
    logits_first.append(out[first])
    for seq, logits in ((first, torch.cat(logits_first)), (second, out[second])):
        with torch.no_grad():
            reference = hf_model(
                input_ids=torch.tensor([driver.sequences[seq].encoder_ids]),
                decoder_input_ids=torch.tensor([driver.sequences[seq].tokens]),
            ).logits[0]
        torch.testing.assert_close(logits, reference, atol=ATOL, rtol=0)
