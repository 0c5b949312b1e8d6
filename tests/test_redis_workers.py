"""Real processes: ``uvicorn --workers 4`` on loopback against one Redis budget.

The app (tests/_redis_app.py) adds each admitted request's bytes to a counter in Redis for as
long as it works, so the maximum of that counter is the most ever reserved at once across
every worker.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from . import _redis
from ._redis import EMPTY, RedisServer, eventually, free_port, requires_redis_server

pytestmark = requires_redis_server
redis_server = _redis.redis_server  # fixture

ROOT = Path(__file__).resolve().parent.parent
WORKERS = 4
BUDGET = 1_000_000  # bytes; the app's estimator charges 1000 bytes per token
LEASE_TTL = 2.0
NAMESPACE = "workers"


@dataclass
class Cluster:
    url: str
    process: subprocess.Popen[bytes]
    redis: RedisServer

    def probe(self, run: str, key: str) -> str:
        return f"probe:{NAMESPACE}:{run}:{key}"


@pytest.fixture(scope="module")
def cluster(redis_server: RedisServer) -> Iterator[Cluster]:
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "GPUASGI_TEST_REDIS_URL": redis_server.url,
        "GPUASGI_TEST_NAMESPACE": NAMESPACE,
        "GPUASGI_TEST_BUDGET": str(BUDGET),
        "GPUASGI_TEST_LEASE_TTL": str(LEASE_TTL),
    }
    command = [sys.executable, "-m", "uvicorn", "tests._redis_app:app", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--workers", str(WORKERS), "--log-level", "warning"]
    process = subprocess.Popen(command, cwd=ROOT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/pid", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("uvicorn --workers did not start")
            time.sleep(0.1)
        yield Cluster(url, process, redis_server)
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def payload(run: str, nbytes: int, hold: float) -> dict[str, object]:
    """A request the app's estimator prices at ``nbytes`` ("x" counts as 2 prompt tokens)."""
    return {"prompt": "x", "max_new_tokens": nbytes // 1000 - 2, "hold": hold, "run": run}


async def test_four_workers_never_reserve_more_than_one_budget(cluster: Cluster) -> None:
    rng = random.Random(7)
    sizes = [rng.choice([50_000, 100_000, 200_000, 400_000, 700_000]) for _ in range(100)]
    limits = httpx.Limits(max_connections=len(sizes))
    async with httpx.AsyncClient(base_url=cluster.url, timeout=60, limits=limits) as client:
        requests = []
        for n in sizes:
            requests.append(asyncio.ensure_future(client.post("/work", json=payload("budget", n, rng.uniform(0.01, 0.05)))))
            # Staggered: a burst of connections at once can all be accepted by one worker (asyncio
            # accepts up to 100 per wake-up), and the test would not cross processes at all.
            await asyncio.sleep(0.003)
        responses = await asyncio.gather(*requests)
    assert [r.status_code for r in responses] == [200] * len(sizes)
    assert sorted(r.json()["bytes"] for r in responses) == sorted(sizes)
    redis = cluster.redis.client()
    peak = int(redis.get(cluster.probe("budget", "max")) or 0)
    assert 0 < peak <= BUDGET, f"{peak} bytes reserved at once across the workers"
    assert int(redis.get(cluster.probe("budget", "now")) or -1) == 0
    assert len(redis.smembers(cluster.probe("budget", "pids"))) >= 2  # several workers served
    await eventually(lambda: cluster.redis.ledger_state(NAMESPACE) == EMPTY)  # nothing held at the end
    assert int(redis.hget("{" + NAMESPACE + "}:counts", "admitted") or 0) >= len(sizes)


async def test_kill_9_of_a_worker_returns_its_bytes_within_the_lease_ttl(cluster: Cluster) -> None:
    redis = cluster.redis.client()
    holders = cluster.probe("kill", "holders")
    async with httpx.AsyncClient(base_url=cluster.url, timeout=60) as client:
        requests = [asyncio.ensure_future(client.post("/work", json=payload("kill", 200_000, 5.0))) for _ in range(3)]
        await eventually(lambda: redis.hlen(holders) == 3)
        held = [value.split() for value in redis.hvals(holders)]
        victim = int(held[0][0])
        surviving = sum(int(nbytes) for pid, nbytes in held if int(pid) != victim)
        assert cluster.redis.ledger_state(NAMESPACE)["reserved"] == 600_000
        os.kill(victim, signal.SIGKILL)
        took = await eventually(lambda: cluster.redis.ledger_state(NAMESPACE)["reserved"] == surviving, timeout=15)
        assert took <= LEASE_TTL + 2.0, f"the dead worker's bytes came back after {took:.1f} s"
        outcomes = await asyncio.gather(*requests, return_exceptions=True)
    survivors = [o for o in outcomes if isinstance(o, httpx.Response)]
    assert all(response.status_code == 200 for response in survivors)
    assert len(outcomes) - len(survivors) >= 1  # the victim's requests died with it
    await eventually(lambda: cluster.redis.ledger_state(NAMESPACE) == EMPTY)
