"""``attnexport serve`` of an encoder artifact (the real all-MiniLM-L6-v2 export): OpenAI's
``/v1/embeddings`` through the openai client equals ``attnexport embed``, as floats and as
base64, for texts and token ids; the shared routes work; generation routes are refused."""

from __future__ import annotations

import json

import numpy as np
import pytest

openai = pytest.importorskip("openai")

from attnexport.cli.main import main  # noqa: E402
from tests.serve.helpers import running_server  # noqa: E402

TEXTS = ["A man is eating food.", "A man is riding a horse.", "Das ist ein Satz."]


@pytest.fixture(scope="module")
def minilm(minilm_artifact):
    return minilm_artifact


@pytest.fixture(scope="module")
def url(minilm):
    with running_server(minilm, name="minilm") as url:
        yield url


def _embed_command(artifact, capsys) -> np.ndarray:
    args = ["embed", str(artifact), "--json", *(a for t in TEXTS for a in ("--text", t))]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out)
    return np.array([e["embedding"] for e in result["embeddings"]], dtype=np.float32)


def test_embeddings_equal_the_embed_command(url, minilm, capsys):
    expected = _embed_command(minilm, capsys)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    floats = client.embeddings.create(model="minilm", input=TEXTS, encoding_format="float")
    assert [d.index for d in floats.data] == [0, 1, 2]
    np.testing.assert_array_equal(
        np.array([d.embedding for d in floats.data], np.float32), expected
    )
    # The client's default asks for base64 and decodes it.
    default = client.embeddings.create(model="minilm", input=TEXTS)
    np.testing.assert_array_equal(
        np.array([d.embedding for d in default.data], np.float32), expected
    )
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > len(TEXTS)
    one = client.embeddings.create(model="minilm", input=TEXTS[1], encoding_format="float")
    np.testing.assert_allclose(np.array(one.data[0].embedding), expected[1], atol=1e-6)


def test_token_ids_shared_routes_and_refusals(url):
    import httpx

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    ids = httpx.post(f"{url}/tokenize", json={"prompt": TEXTS[0]}).json()["tokens"]
    by_ids = client.embeddings.create(model="minilm", input=[ids], encoding_format="float")
    by_text = client.embeddings.create(model="minilm", input=[TEXTS[0]], encoding_format="float")
    np.testing.assert_allclose(by_ids.data[0].embedding, by_text.data[0].embedding, atol=1e-6)
    assert httpx.post(f"{url}/detokenize", json={"tokens": ids}).json()["prompt"].lower() == (
        TEXTS[0].lower()
    )
    assert client.models.retrieve("minilm").id == "minilm"
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other", input=TEXTS)
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        client.embeddings.create(model="minilm", input=TEXTS, dimensions=8)
    with pytest.raises(openai.BadRequestError, match="encoder"):
        client.completions.create(model="minilm", prompt="x")
