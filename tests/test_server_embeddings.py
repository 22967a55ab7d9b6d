"""POST /v1/embeddings on a real `asyncllm serve`, driven by the official openai client (and httpx for
what the client would refuse to send): vectors equal Hugging Face's on the same weights."""
from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from helpers import live_server, live_server_client

httpx = pytest.importorskip("httpx", reason="the server tests need the server/test extras (httpx)")
openai = pytest.importorskip("openai", reason="the server tests need the test extras (openai)")
pytest.importorskip("starlette", reason="the server tests need asyncllm[server] (starlette)")
pytest.importorskip("uvicorn", reason="the server tests need asyncllm[server] (uvicorn)")

pytestmark = pytest.mark.timeout(600)

MODEL_NAME = "tiny-qwen3"
MAX_MODEL_LEN = 256
HIDDEN = 128  # the tiny checkpoint's hidden size
TEXTS = ["Hello, my name is", "The quick brown fox jumps over the lazy dog. " * 5]


@pytest.fixture(scope="module")
def server(tiny_qwen3, tmp_path_factory):
    with live_server(tiny_qwen3, tmp_path_factory.mktemp("server"), "--served-model-name", MODEL_NAME,
                     "--max-model-len", str(MAX_MODEL_LEN), "--num-kvcache-blocks", "64",
                     "--max-num-batched-tokens", "32", "--log-level", "warning") as served:
        yield served.base


@pytest.fixture(scope="module")
def client(server):
    return live_server_client(server)


@pytest.fixture(scope="module")
def reference(tiny_qwen3):
    """(token ids of a text, HF's final-norm hidden states of token ids)."""
    from transformers import AutoModel, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    model = AutoModel.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()

    def hidden(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return model(torch.tensor([ids])).last_hidden_state[0]
    return tokenizer.encode, hidden


def expected(hidden, ids: list[int], pooling: str = "last", dimensions: int | None = None) -> torch.Tensor:
    states = hidden(ids)
    vector = states[-1] if pooling == "last" else states.mean(0)
    return torch.nn.functional.normalize(vector[:dimensions] if dimensions else vector, dim=0)


def assert_close(vector, reference: torch.Tensor) -> None:
    torch.testing.assert_close(torch.tensor(vector, dtype=torch.float32), reference, rtol=1e-4, atol=1e-5)


def test_texts_match_hf_through_the_openai_client(client, reference):
    encode, hidden = reference
    response = client.embeddings.create(model=MODEL_NAME, input=TEXTS)  # the client asks for base64
    assert response.object == "list" and response.model == MODEL_NAME
    assert [d.index for d in response.data] == [0, 1] and all(d.object == "embedding" for d in response.data)
    token_ids = [encode(text) for text in TEXTS]
    assert response.usage.prompt_tokens == response.usage.total_tokens == sum(map(len, token_ids))
    for data, ids in zip(response.data, token_ids):
        assert len(data.embedding) == HIDDEN
        assert_close(data.embedding, expected(hidden, ids))
    as_floats = client.embeddings.create(model=MODEL_NAME, input=TEXTS, encoding_format="float")
    for data, base64_data in zip(as_floats.data, response.data):  # the second time from the prefix cache
        np.testing.assert_allclose(data.embedding, base64_data.embedding, rtol=1e-5, atol=1e-6)


def test_token_ids_dimensions_and_mean_pooling(client, server, reference):
    _, hidden = reference
    ids = [[5, 6, 7, 8], list(range(1000, 1070))]  # 70 tokens: three steps of 32
    response = client.embeddings.create(model=MODEL_NAME, input=ids, dimensions=32, encoding_format="float")
    assert response.usage.prompt_tokens == 74
    for data, prompt in zip(response.data, ids):
        assert len(data.embedding) == 32
        assert_close(data.embedding, expected(hidden, prompt, dimensions=32))
    one = client.embeddings.create(model=MODEL_NAME, input=ids[1], extra_body={"pooling": "mean"})
    assert len(one.data) == 1
    assert_close(one.data[0].embedding, expected(hidden, ids[1], pooling="mean"))
    raw = httpx.post(f"{server}/v1/embeddings", timeout=60,
                     json={"input": ids[0], "encoding_format": "base64", "normalize": False}).json()
    vector = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    torch.testing.assert_close(torch.from_numpy(vector.copy()), hidden(ids[0])[-1], rtol=1e-4, atol=1e-5)


def test_an_embedding_beside_a_streamed_completion(client, reference):
    encode, hidden = reference
    stream = client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=40, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    first = next(iter(stream))
    response = client.embeddings.create(model=MODEL_NAME, input=TEXTS[1])
    assert_close(response.data[0].embedding, expected(hidden, encode(TEXTS[1])))
    finish = [chunk.choices[0].finish_reason for chunk in stream if chunk.choices]
    assert first.choices and finish[-1] == "length"


BAD = [
    ({}, "input", "required"),
    ({"input": ""}, "input", "empty"),
    ({"input": []}, "input", "empty array"),
    ({"input": ["ok", ""]}, "input", "input[1]"),
    ({"input": [["a"]]}, "input", "input[0]"),
    ({"input": {"text": "hi"}}, "input", "an object"),
    ({"input": ["x"] * 2049}, "input", "at most 2048"),
    ({"input": [1, 151936]}, "input", "vocabulary"),
    ({"input": [[1] * (MAX_MODEL_LEN + 1)]}, "input", "max_model_len"),
    ({"input": "word " * 2000}, "input", "max_model_len"),
    ({"input": "hi", "encoding_format": "hex"}, "encoding_format", "'float' or 'base64'"),
    ({"input": "hi", "dimensions": 0}, "dimensions", ">= 1"),
    ({"input": "hi", "dimensions": HIDDEN + 1}, "dimensions", "hidden size"),
    ({"input": "hi", "dimensions": "8"}, "dimensions", "integer"),
    ({"input": "hi", "pooling": "max"}, "pooling", "'mean'"),
    ({"input": "hi", "normalize": "yes"}, "normalize", "boolean"),
    ({"input": "hi", "model": "other"}, "model", "does not exist"),
]


@pytest.mark.parametrize("body,param,says", BAD, ids=[f"{p}: {s}" for _, p, s in BAD])
def test_bad_requests_are_openai_errors_naming_the_field(server, body, param, says):
    response = httpx.post(f"{server}/v1/embeddings", json=body, timeout=60)
    assert response.status_code == (404 if param == "model" else 400), response.text
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_the_server_is_idle_and_serves_after_the_errors(server, client):
    metrics = httpx.get(f"{server}/metrics", timeout=10).text
    in_use = [line for line in metrics.splitlines() if line.startswith("asyncllm_kv_blocks_in_use")]
    assert in_use and float(in_use[0].split()[-1]) == 0, in_use
    assert len(client.embeddings.create(model=MODEL_NAME, input="Hello").data[0].embedding) == HIDDEN
