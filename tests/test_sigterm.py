"""SIGTERM to a real server process with 4 requests running and 10 queued (``tests._sigterm_app``):
the 4 finish with 200, the 10 get 503 ``shutting-down`` at once, readiness answers 503 while the
server still listens, nothing stays reserved in Redis, and the process exits in time."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from . import _redis
from ._redis import REDIS_SERVER, RedisServer
from .test_servers import free_port, start, stop

redis_server = _redis.redis_server  # fixture

APP = "tests._sigterm_app:app"
GRACEFUL = 15  # the server's graceful timeout, seconds
#: Between the drain and the server's own handler: readiness is 503 while it still listens.
DELAY = 1.0
HOLD = 2.0  # seconds each admitted request runs

LEDGERS = ["memory", pytest.param("redis", marks=pytest.mark.skipif(REDIS_SERVER is None, reason="no redis-server"))]

#: What was measured on a quiet 2-core machine is in the report; these bounds are loose for CI.
REFUSED_WITHIN = 1.0


SERVERS = {
    "uvicorn": lambda port: [
        sys.executable, "-m", "uvicorn", APP, "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
        "--timeout-graceful-shutdown", str(GRACEFUL),
    ],
    "hypercorn": lambda port: [
        sys.executable, "-m", "hypercorn", APP, "--bind", f"127.0.0.1:{port}", "--log-level", "warning",
        "--graceful-timeout", str(GRACEFUL), "--workers", "0",  # in this process: it gets the signal
    ],
    "granian": lambda port: [
        sys.executable, "-m", "granian", "--interface", "asgi", "--host", "127.0.0.1", "--port", str(port),
        "--log-level", "warning", APP,
    ],
}


@pytest.fixture
def server_env(request: pytest.FixtureRequest) -> Iterator[dict[str, str]]:
    env = {"SIGTERM_DELAY": str(DELAY)}
    if request.param == "redis":
        server: RedisServer = request.getfixturevalue("redis_server")
        env |= {"SIGTERM_LEDGER": server.url, "SIGTERM_NAMESPACE": f"sigterm-{uuid.uuid4().hex[:8]}"}
    yield env


async def wait_for(http: httpx.AsyncClient, in_flight: int, waiting: int) -> None:
    async with asyncio.timeout(30):
        while _counts((await http.get("/stats")).json()) != (in_flight, waiting):
            await asyncio.sleep(0.02)


def generate(http: httpx.AsyncClient, count: int, hold: float = 0.0) -> list[asyncio.Future[httpx.Response]]:
    """``count`` GPU-bound requests of 10 bytes each, sent at once; each holds its bytes ``hold`` s."""
    body = {"prompt": "go", "max_new_tokens": 9, "hold": hold}
    return [asyncio.ensure_future(http.post("/generate", json=body)) for _ in range(count)]


def _counts(stats: dict[str, int]) -> tuple[int, int]:
    return stats["in_flight"], stats["waiting"]


@pytest.mark.parametrize("server_name", sorted(SERVERS))
@pytest.mark.parametrize("server_env", LEDGERS, indirect=True)
async def test_sigterm_drains(
    server_name: str, server_env: dict[str, str], tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    port = free_port()
    process = start(SERVERS[server_name](port), port, tmp_path / "server.log", env=server_env)
    try:
        limits = httpx.Limits(max_connections=32, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", limits=limits, timeout=30) as http:
            assert (await http.get("/health/ready")).status_code == 200
            running = generate(http, 4, hold=HOLD)
            await wait_for(http, 4, 0)
            queued = generate(http, 10)
            await wait_for(http, 4, 10)

            signalled = time.perf_counter()
            process.send_signal(signal.SIGTERM)
            refused = await asyncio.gather(*queued)
            refused_after = time.perf_counter() - signalled
            if server_name == "uvicorn":  # uvicorn's handler runs after the drain's delay
                ready = await http.get("/health/ready")  # a new connection: the listener is still open
                ready_after = time.perf_counter() - signalled
                assert ready.status_code == 503 and ready.json()["draining"] is True
                assert ready_after < DELAY  # answered before the server's own handler closed the listener
            done = await asyncio.gather(*running)
        exited = await asyncio.to_thread(process.wait, GRACEFUL + 10)
        exit_after = time.perf_counter() - signalled
    finally:
        stop(process)
    log = (tmp_path / "server.log").read_text()
    for response in refused:
        assert response.status_code == 503, (response.text, log)
        assert response.headers["x-gpu-admission-reason"] == "shutting-down"
        assert response.headers["retry-after"] == "1" and response.headers["connection"] == "close"
    assert [(r.status_code, r.text) for r in done] == [(200, "generated")] * 4
    assert exited in (0, -signal.SIGTERM), log  # uvicorn re-raises the signal once it has shut down
    assert exit_after < GRACEFUL, exit_after
    assert refused_after < REFUSED_WITHIN, refused_after
    if "SIGTERM_LEDGER" in server_env:  # nothing left in Redis: no byte, no lease waiting for its TTL
        redis: RedisServer = request.getfixturevalue("redis_server")
        assert redis.ledger_state(server_env["SIGTERM_NAMESPACE"]) == _redis.EMPTY
    print(f"\n{server_name}: queued refused {refused_after * 1000:.0f} ms after SIGTERM; exit after {exit_after:.2f} s")


#: Two worker processes under a process manager, which passes SIGTERM on to each.
MANAGERS = {
    "uvicorn --workers 2": lambda port: [*SERVERS["uvicorn"](port), "--workers", "2"],
    "gunicorn -k uvicorn_worker.UvicornWorker -w 2": lambda port: [
        sys.executable, "-m", "gunicorn", APP, "--bind", f"127.0.0.1:{port}", "--log-level", "warning",
        "--worker-class", "uvicorn_worker.UvicornWorker", "--workers", "2", "--graceful-timeout", str(GRACEFUL),
    ],
}


@pytest.mark.skipif(REDIS_SERVER is None, reason="no redis-server")
@pytest.mark.parametrize("manager", sorted(MANAGERS))
async def test_sigterm_to_a_process_manager_drains_every_worker(
    manager: str, redis_server: RedisServer, tmp_path: Path
) -> None:
    """Two workers over one Redis budget: SIGTERM goes to the process manager, which passes it to
    each worker. Every queued request, whichever worker holds it, gets 503 ``shutting-down``
    (not admitted when the running ones give their bytes back), the running ones finish, nothing
    stays in Redis, and the manager exits in time."""
    namespace = f"sigterm-workers-{uuid.uuid4().hex[:8]}"
    port = free_port()
    env = {"SIGTERM_DELAY": str(DELAY), "SIGTERM_LEDGER": redis_server.url, "SIGTERM_NAMESPACE": namespace}
    process = start(MANAGERS[manager](port), port, tmp_path / "server.log", env=env)
    workers: set[int] = set()

    async def ledger_holds(reserved: int, queued: int) -> None:
        async with asyncio.timeout(30):
            while (state := redis_server.ledger_state(namespace))["reserved"] != reserved or state["queued"] != queued:
                await asyncio.sleep(0.02)

    try:
        limits = httpx.Limits(max_connections=32, max_keepalive_connections=0)  # a new connection each time
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", limits=limits, timeout=30) as http:
            async with asyncio.timeout(60):  # both workers accept: each connection goes to whichever takes it
                while len(workers) < 2:
                    workers.add((await http.get("/stats")).json()["pid"])
            running = generate(http, 4, hold=HOLD)
            await ledger_holds(reserved=40, queued=0)
            queued = generate(http, 10)
            await ledger_holds(reserved=40, queued=10)

            signalled = time.perf_counter()
            process.send_signal(signal.SIGTERM)
            refused = await asyncio.gather(*queued)
            refused_after = time.perf_counter() - signalled
            done = await asyncio.gather(*running)
        exited = await asyncio.to_thread(process.wait, GRACEFUL + 10)
        exit_after = time.perf_counter() - signalled
    finally:
        stop(process)
        for pid in workers:  # a worker the supervisor left behind, had it been killed
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    log = (tmp_path / "server.log").read_text()
    for response in refused:
        assert response.status_code == 503, (response.text, log)
        assert response.headers["x-gpu-admission-reason"] == "shutting-down"
    assert [(r.status_code, r.text) for r in done] == [(200, "generated")] * 4
    assert exited == 0, log
    assert exit_after < GRACEFUL, exit_after
    assert redis_server.ledger_state(namespace) == _redis.EMPTY
    print(f"\n{manager}: queued refused {refused_after * 1000:.0f} ms after SIGTERM; exit after {exit_after:.2f} s")
