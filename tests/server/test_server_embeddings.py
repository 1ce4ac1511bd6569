"""POST /v1/embeddings with the official openai SDK, and POST /v1/rerank, against a real server on the defaults.

The SDK asks for base64 unless told otherwise: its decoded vectors must equal the float format's numbers exactly.
Inputs sent together equal the same inputs sent one by one (the engine batches them; the defaults are exact).
Bad input is a 400 in OpenAI's shape naming the field, and the engine holds nothing afterwards.
"""

from __future__ import annotations

import math

import httpx
import openai
import pytest

TEXTS = ["The cat sat on the mat.", "Paris is the capital of France.", "Blocks of sixteen tokens each."]


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0, timeout=120) as client:
        yield client


def post(server, route: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + route, json=body, headers=server.headers(), timeout=120)


def test_sdk_embeddings_are_the_float_format_exactly(server, client, model):
    response = client.embeddings.create(model=model, input=TEXTS)
    assert [item.index for item in response.data] == [0, 1, 2]
    assert response.usage.prompt_tokens == response.usage.total_tokens > len(TEXTS)
    floats = post(server, "/v1/embeddings", {"input": TEXTS, "encoding_format": "float"}).json()
    for item, plain in zip(response.data, floats["data"]):
        assert item.embedding == plain["embedding"]
        assert math.isclose(sum(x * x for x in item.embedding), 1.0, rel_tol=1e-5)


def test_together_equals_one_by_one(client, model):
    together = [item.embedding for item in client.embeddings.create(model=model, input=TEXTS).data]
    alone = [client.embeddings.create(input=text, model=model).data[0].embedding for text in TEXTS]
    assert together == alone


def test_dimensions_token_ids_and_pooling(server, client, model):
    short = client.embeddings.create(model=model, input=TEXTS[0], dimensions=32).data[0].embedding
    assert len(short) == 32 and math.isclose(sum(x * x for x in short), 1.0, rel_tol=1e-5)
    ids = post(server, "/tokenize", {"prompt": TEXTS[0]}).json()["tokens"]
    by_ids = client.embeddings.create(model=model, input=[ids]).data[0].embedding
    assert by_ids == client.embeddings.create(model=model, input=TEXTS[0]).data[0].embedding
    mean = post(server, "/v1/embeddings", {"input": TEXTS[0], "pooling": "mean", "encoding_format": "float"})
    assert mean.status_code == 200 and mean.json()["data"][0]["embedding"] != by_ids


def test_rerank(server):
    query = "Where is Paris?"
    body = post(server, "/v1/rerank", {"query": query, "documents": TEXTS}).json()
    results = body["results"]
    assert sorted(r["index"] for r in results) == [0, 1, 2]
    assert [r["relevance_score"] for r in results] == sorted((r["relevance_score"] for r in results), reverse=True)
    assert all(r["document"]["text"] == TEXTS[r["index"]] for r in results)
    for result in results:
        alone = post(server, "/rerank", {"query": query, "documents": [{"text": TEXTS[result["index"]]}]}).json()
        assert alone["results"][0]["relevance_score"] == result["relevance_score"]
    top = post(server, "/v1/rerank", {"query": query, "documents": TEXTS, "top_n": 1, "return_documents": False})
    assert top.json()["results"] == [{"index": results[0]["index"], "relevance_score": results[0]["relevance_score"]}]


@pytest.mark.parametrize(
    "route, body, param",
    [
        ("/v1/embeddings", {"input": []}, "input"),
        ("/v1/embeddings", {"input": ""}, "input"),
        ("/v1/embeddings", {"input": "x", "dimensions": 0}, "dimensions"),
        ("/v1/embeddings", {"input": "x", "dimensions": 100_000}, "dimensions"),
        ("/v1/embeddings", {"input": [[1, 2], [10**9]]}, "input"),
        ("/v1/embeddings", {"input": "word " * 700}, "input"),
        ("/v1/embeddings", {"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ("/v1/embeddings", {"input": "x", "frobnicate": 1}, "frobnicate"),
        ("/v1/rerank", {"query": "x", "documents": []}, "documents"),
        ("/v1/rerank", {"query": "x", "documents": ["a"], "top_n": 0}, "top_n"),
        ("/v1/rerank", {"documents": ["a"]}, "query"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(server, route, body, param):
    response = post(server, route, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"].split("[")[0] == param, error
    engine = httpx.get(server.url + "/v1/engine", headers=server.headers(), timeout=60).json()
    assert (engine["num_running"], engine["num_waiting"], engine["num_blocks_used"]) == (0, 0, 0)


def test_every_route_needs_the_key(server):
    for route in ("/v1/embeddings", "/v1/rerank", "/rerank", "/v2/rerank"):
        response = httpx.post(server.url + route, json={"input": "x", "query": "x", "documents": ["a"]}, timeout=60)
        assert response.status_code == 401, route
