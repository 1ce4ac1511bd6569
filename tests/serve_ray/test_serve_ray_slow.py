"""Slow Ray Serve tests (each redeploys replicas): a replica killed under load, and routing policies compared."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import httpx
import pytest
from tests.serve_ray.conftest import deploy, ray_cluster

from tokenriver.engine.llm import LLM
from tokenriver.params import SamplingParams

pytestmark = pytest.mark.slow

SYSTEM_PROMPTS = [
    f"System {k}: you are assistant number {k} of the help desk. " + "Be brief and exact. " * 6 for k in range(4)
]


@pytest.fixture(scope="module")
def base_url():
    with ray_cluster() as port:
        yield f"http://127.0.0.1:{port}"


def _live_replicas(client: httpx.Client, count: int, without: str | None = None) -> list[dict]:
    """Wait (up to a minute) until `count` replicas post, none of them `without`."""
    for _ in range(60):
        replicas = client.get("/v1/replicas").json()["data"]
        if len(replicas) == count and all(r["replica_id"] != without for r in replicas):
            return replicas
        time.sleep(1)
    raise AssertionError(f"expected {count} live replicas other than {without}, got {replicas}")


def test_killing_a_replica_mid_load_loses_no_unstreamed_request(base_url):
    deploy(2, "round_robin")
    prompts = [f"Item {i}: the colour of the sky is" for i in range(24)]
    # 96 tokens each, EOS ignored: the load still runs when the victim dies (the defaults are fast enough to finish
    # 24 tokens before then).
    reference = LLM(max_num_kv_tokens=4096, num_threads=1).generate(
        prompts, SamplingParams(max_tokens=96, temperature=0, ignore_eos=True), use_tqdm=False
    )
    with httpx.Client(base_url=base_url, timeout=120) as client:
        victim = _live_replicas(client, 2)[0]

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
            tasks = [
                asyncio.create_task(
                    client.post(
                        "/v1/completions",
                        json={"prompt": prompt, "max_tokens": 96, "temperature": 0, "ignore_eos": True},
                    )
                )
                for prompt in prompts
            ]
            await asyncio.sleep(1.5)
            os.kill(victim["pid"], signal.SIGKILL)
            return await asyncio.gather(*tasks)

    responses = asyncio.run(run())
    assert [r.status_code for r in responses] == [200] * len(prompts)
    assert [r.json()["choices"][0]["text"] for r in responses] == [o.outputs[0].text for o in reference]
    assert all(r.headers["x-tokenriver-replica"] != victim["replica_id"] for r in responses)
    with httpx.Client(base_url=base_url, timeout=120) as client:  # Ray Serve starts a replacement
        _live_replicas(client, 2, without=victim["replica_id"])


def _hit_rate(base_url: str, router: str) -> float:
    deploy(2, router)
    requests = [
        SYSTEM_PROMPTS[user % len(SYSTEM_PROMPTS)] + f"User {user}: my order {user} is late, why?" for user in range(24)
    ]
    # A seeded random order: in strict rotation, round robin over two replicas would keep each system prompt on
    # one replica by accident.
    random.Random(0).shuffle(requests)

    async def run() -> None:
        async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
            for start in range(0, len(requests), 4):  # four users at a time
                batch = [
                    client.post("/v1/completions", json={"prompt": p, "max_tokens": 2, "temperature": 0})
                    for p in requests[start : start + 4]
                ]
                assert all(r.status_code == 200 for r in await asyncio.gather(*batch))

    asyncio.run(run())
    time.sleep(2.5)  # replicas post their metrics every second
    with httpx.Client(base_url=base_url, timeout=120) as client:
        text = client.get("/metrics").text
    values = {
        line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line and not line.startswith("#")
    }
    return values["tokenriver_prefix_cache_hit_tokens_total"] / values["tokenriver_prefix_cache_queried_tokens_total"]


def test_prefix_aware_routing_hits_the_cache_more_than_round_robin(base_url):
    round_robin = _hit_rate(base_url, "round_robin")
    prefix = _hit_rate(base_url, "prefix")
    assert prefix > round_robin
