"""The Engine with a tokenizer: text prompts in, ``text`` and streamed ``text_delta`` out, equal
to transformers' decode of the generated tokens."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from attnexport.runtime import CacheConfig, Engine, SamplingParams, TorchExecutor
from attnexport.runtime.text import REPLACEMENT_CHARACTER, Tokenizer
from tests.runtime.echo_decoder import EchoDecoder
from tests.text_tokenizers import BUILDERS

PROMPTS = ["The capital of France is", "😀 naïve", "Hello world"]


@pytest.fixture(scope="module", params=["byte_level_bpe", "sentencepiece"])
def setup(request, tmp_path_factory):
    directory = BUILDERS[request.param](tmp_path_factory.mktemp(request.param))
    tokenizer = Tokenizer.from_directory(directory)
    # the echo model's next token is a checksum: arbitrary ids, byte tokens included
    model = EchoDecoder(vocab_size=len(tokenizer.hf), max_model_len=128)
    engine = Engine(
        TorchExecutor(model, block_size=2), CacheConfig(num_blocks=256), tokenizer=tokenizer
    )
    return engine, tokenizer, AutoTokenizer.from_pretrained(str(directory))


def test_generate_takes_text_and_returns_text(setup):
    engine, _, hf = setup
    params = SamplingParams(max_tokens=24, n=2, temperature=1.0, seed=3)
    outputs = engine.generate(PROMPTS, params)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        assert output.error is None
        assert output.prompt_token_ids == hf(prompt)["input_ids"]
        for sample in output.outputs:
            expected = hf.decode(sample.token_ids, skip_special_tokens=True)
            assert sample.text == sample.text_delta == expected
        assert output.text == output.outputs[0].text


def test_stream_deltas_concatenate_to_the_final_text(setup):
    engine, _, hf = setup
    streamed: dict[tuple[str, int], str] = {}
    final = {}
    for update in engine.stream(PROMPTS, SamplingParams(max_tokens=30, n=2, seed=1, top_k=5)):
        for sample in update.outputs:
            key = (update.request_id, sample.index)
            streamed[key] = streamed.get(key, "") + sample.text_delta
            assert sample.text == streamed[key]
            if sample.finish_reason is None:  # a partial character is held back
                assert not sample.text_delta.endswith(REPLACEMENT_CHARACTER)
            else:
                final[key] = hf.decode(sample.token_ids, skip_special_tokens=True)
    assert len(final) == 2 * len(PROMPTS)
    assert all(streamed[key] == text for key, text in final.items())


def test_without_a_tokenizer_outputs_have_no_text():
    plain = Engine(TorchExecutor(EchoDecoder(), block_size=2), CacheConfig(num_blocks=64))
    output = plain.generate([[1, 2, 3]], SamplingParams(max_tokens=3))[0]
    assert output.text is None and len(output.token_ids) == 3
    with pytest.raises(TypeError, match="tokenizer"):
        plain.add_request("text")
