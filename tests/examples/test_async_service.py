"""The example service answers /health quickly while a training job runs (the event loop
is not blocked), streams progress, and cancels jobs."""

import asyncio
import json
import time

import pytest
from aiohttp.test_utils import TestClient, TestServer

from examples.async_service import make_app


@pytest.mark.asyncio
async def test_health_latency_while_training():
    async with TestClient(TestServer(make_app(), host="127.0.0.1")) as client:
        r = await client.post("/jobs", json={"steps": 200, "layers": 4, "embd": 128, "batch": 8})
        assert r.status == 201
        job = (await r.json())["id"]
        # wait until training is really under way
        for _ in range(200):
            if (await (await client.get(f"/jobs/{job}")).json())["done"] >= 2:
                break
            await asyncio.sleep(0.05)
        latencies = []
        for _ in range(200):
            t0 = time.perf_counter()
            r = await client.get("/health")
            assert r.status == 200 and (await r.json())["running_jobs"] == 1
            latencies.append(time.perf_counter() - t0)
            await asyncio.sleep(0.005)
        latencies.sort()
        p99 = latencies[int(0.99 * len(latencies)) - 1]
        assert p99 < 0.050, f"/health p99 {p99 * 1e3:.1f} ms while training"
        view = await (await client.get(f"/jobs/{job}")).json()
        assert view["status"] == "running" and view["done"] >= 2
        r = await client.delete(f"/jobs/{job}")
        assert (await r.json())["status"] == "cancelled"


@pytest.mark.asyncio
async def test_events_stream_to_the_end():
    async with TestClient(TestServer(make_app(), host="127.0.0.1")) as client:
        r = await client.post("/jobs", json={"steps": 3, "layers": 2, "embd": 64, "batch": 4})
        job = (await r.json())["id"]
        r = await asyncio.wait_for(client.get(f"/jobs/{job}/events"), 60)
        lines = [json.loads(x) for x in (await asyncio.wait_for(r.text(), 60)).splitlines()]
        assert [x["step"] for x in lines[:-1]] == [0, 1, 2]
        assert lines[-1]["status"] == "finished"
