"""Two replicas of the embedded model on Ray Serve behind one endpoint: answers, routing, metrics, streaming."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from tests.serve_ray.conftest import deploy, ray_cluster

from tokenriver.engine.llm import LLM
from tokenriver.params import SamplingParams

PROMPTS = [f"Question {i}: what is {i} plus {i}? Answer:" for i in range(8)]
LONG_PREFIX = (
    "You are a meticulous assistant for a shipping company. Answer in one short sentence, cite the "
    "relevant policy number, and never invent a tracking number. Policies: 1) refunds within 30 days; "
    "2) damaged parcels are replaced; 3) express delivery costs extra. "
)


@pytest.fixture(scope="module")
def base_url():
    with ray_cluster() as port:
        deploy(2, "prefix")
        yield f"http://127.0.0.1:{port}"


async def _complete(client: httpx.AsyncClient, prompt: str, max_tokens: int = 8) -> httpx.Response:
    return await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})


def test_64_concurrent_requests_are_answered_as_one_engine_answers_them(base_url):
    reference = LLM(max_num_kv_tokens=4096, num_threads=1).generate(
        PROMPTS, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False
    )
    expected = {prompt: output.outputs[0].text for prompt, output in zip(PROMPTS, reference)}

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
            return await asyncio.gather(*(_complete(client, PROMPTS[i % len(PROMPTS)]) for i in range(64)))

    responses = asyncio.run(run())
    assert [r.status_code for r in responses] == [200] * 64
    for i, response in enumerate(responses):
        assert response.json()["choices"][0]["text"] == expected[PROMPTS[i % len(PROMPTS)]]
    assert len({r.headers["x-tokenriver-replica"] for r in responses}) == 2


def test_requests_sharing_a_long_prefix_land_on_one_replica(base_url):
    with httpx.Client(base_url=base_url, timeout=120) as client:
        before = {r["replica_id"] for r in client.get("/v1/replicas").json()["data"]}
        replicas = {
            _sync_complete(client, LONG_PREFIX + f"Customer {i}: where is my parcel?").headers["x-tokenriver-replica"]
            for i in range(6)
        }
        assert len(replicas) == 1
        (chosen,) = replicas
        time.sleep(2.5)  # replicas post their metrics every second
        per_replica = client.get("/metrics/replicas").text
    assert chosen in before
    hits = _sample(per_replica, f'tokenriver_prefix_cache_hit_tokens_total{{replica="{chosen}"}}')
    assert hits >= 5 * 48  # five later requests each reuse at least three full blocks of the prefix


def test_streaming_engine_info_and_aggregated_metrics(base_url):
    with httpx.Client(base_url=base_url, timeout=120) as client:
        with client.stream(
            "POST",
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 6, "stream": True},
        ) as response:
            assert response.status_code == 200
            events = [line for line in response.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[0][6:])["object"] == "chat.completion.chunk"
        assert client.get("/v1/engine").json()["block_size"] == 16
        time.sleep(2.5)  # replicas post their metrics every second: let both post after the last request
        aggregated, per_replica = client.get("/metrics").text, client.get("/metrics/replicas").text
    replica_ids = [r for r in {line.split('replica="')[1].split('"')[0] for line in per_replica.splitlines()}]
    assert len(replica_ids) == 2
    for name in ("tokenriver_prefix_cache_queried_tokens_total", "tokenriver_engine_steps_total"):
        total = sum(_sample(per_replica, f'{name}{{replica="{r}"}}') for r in replica_ids)
        assert _sample(aggregated, name) == total > 0


def _sync_complete(client: httpx.Client, prompt: str) -> httpx.Response:
    response = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0})
    assert response.status_code == 200
    return response


def _sample(text: str, key: str) -> float:
    for line in text.splitlines():
        if line.startswith(key + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{key} not in metrics")
