"""Two API server processes of one vLLM engine (``--api-server-count 2``), one KV cache, one budget
through the Redis ledger (``GPU_ASGI_LEDGER_URL``): together they admit what the cache holds.

Each process alone would admit 7 requests of 2 blocks; if each kept its own ledger, the two would
admit 14 at once and vLLM would preempt. Outcomes only: no preemption, every request completed,
the bytes all back, and both processes did admit."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import pytest

from tests import _redis
from tests._redis import RedisServer, requires_redis_server

from . import _server
from ._server import VLLMProcess, burst, metrics, preemptions

pytestmark = requires_redis_server
redis_server = _redis.redis_server  # a fixture: one server for the module
NAMESPACE = "gpu_asgi:vllm-test"
RECEIVED = re.compile(r"^\(\w+ pid=(\d+)\).*Received request", re.MULTILINE)


@pytest.fixture(scope="module")
def shared(redis_server: RedisServer) -> Iterator[VLLMProcess]:
    env = {"GPU_ASGI_LEDGER_URL": redis_server.url, "GPU_ASGI_LEDGER_NAMESPACE": NAMESPACE, "GPU_ASGI_MAX_WAIT": "300",
           # Two API servers, the engine and the test's 40 clients share 2 CPUs: an event loop can
           # stall past the default 1 s, and admission would fail closed (503 ledger-unavailable).
           "GPU_ASGI_REDIS_TIMEOUT": "10"}
    server = _server.start("shared", middleware=True, env=env, args=["--api-server-count", "2", "--enable-log-requests"], cli=True)
    with _server.running(server):
        # /health answers as soon as one process is up: wait for both to have finished their
        # lifespan startup (gpu_asgi's among it); each accepts connections right after.
        deadline = time.monotonic() + _server.STARTUP_TIMEOUT
        while server.log.read_text(errors="replace").count("Application startup complete.") < 2:
            assert time.monotonic() < deadline, server.tail()
            time.sleep(0.5)
        time.sleep(2)  # from "startup complete" to accepting: the rest of uvicorn's startup
        yield server


def startup_lines(server: VLLMProcess) -> list[str]:
    return [line for line in server.log.read_text(errors="replace").splitlines() if "gpu_asgi admits" in line]


def test_two_processes_start_with_the_shared_ledger(shared: VLLMProcess) -> None:
    lines = startup_lines(shared)
    assert len(lines) == 2  # one per API server process
    assert all("ledger redis://" in line for line in lines)


async def test_two_processes_admit_against_one_budget(shared: VLLMProcess, redis_server: RedisServer) -> None:
    before = preemptions(shared.url)
    outcomes = await burst(shared.url, 40, max_tokens=180)
    assert [o.status for o in outcomes] == [200] * 40
    assert preemptions(shared.url) - before == 0
    # The Redis ledger sends a release from a background task, just after the response ends.
    deadline = time.monotonic() + 30
    while redis_server.ledger_state(NAMESPACE)["reserved"] != 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert redis_server.ledger_state(NAMESPACE)["reserved"] == 0
    assert metrics(shared.url).get("gpu_asgi_admitted_total", 0) >= 40
    # Which needs both processes to have admitted some: the API server pids that received requests
    # (``--enable-log-requests``: vLLM's line names the process it was written in).
    received = {match.group(1) for match in RECEIVED.finditer(shared.log.read_text(errors="replace"))}
    assert len(received) == 2, received

