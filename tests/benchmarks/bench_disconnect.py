"""What a client that leaves costs: time from its disconnect to its bytes back, and the latency
the others see when 30% of clients leave early, with gpu_asgi's cancel on disconnect and without
(``cancel_on_disconnect=False``: the behaviour before it).

    python -m tests.benchmarks.bench_disconnect [--requests 40] [--clients 8] [--steps 20] [--step-ms 10]

A real uvicorn on 127.0.0.1 in this process; clients on raw sockets (so they decide when to leave).
The "GPU" is one ``DeviceExecutor`` thread: a generation is ``--steps`` decode steps of
``--step-ms`` each (``time.sleep``, which frees the GIL as a kernel would), and reads
``stop_requested()`` between steps. ``/generate`` answers once (non-streaming); ``/stream``
sends a chunk per step. The ledger admits all ``--clients`` at once, so the device thread is the
bottleneck: work done for a departed client delays everyone else's.

1. Disconnect to bytes back: one request at a time, the client closes its socket after 5 steps
   (non-streaming) or after its first chunk (streaming); the ledger is polled every 0.5 ms.
2. Load: ``--requests`` requests from ``--clients`` concurrent clients; a random 30% (seeded)
   close their socket after 5 steps' time. Latency of the ones that stay, the device steps run
   for clients that had gone, and the wall time until the device is idle.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, StreamingResponse
from starlette.routing import Route

from gpu_asgi import DeviceExecutor, GPUAdmissionMiddleware, Ledger, LinearEstimator, gpu_bound, stop_requested

from .._asgi import Words
from ._report import table, write_report

LEAVING = 0.30
BODY = json.dumps({"prompt": "go", "max_new_tokens": 9}).encode()  # 10 bytes with Words()


def build(ledger: Ledger, executor: DeviceExecutor, steps: int, step: float, cancel: bool, spent: list[int]) -> Starlette:
    """``spent[0]`` counts the decode steps the device ran."""

    def decode(count: int) -> int:
        done = 0
        while done < count and not stop_requested():
            time.sleep(step)
            done += 1
        spent[0] += done
        return done

    @gpu_bound()
    async def generate(request: Request) -> PlainTextResponse:
        await request.body()
        return PlainTextResponse(f"{await executor.run(decode, steps)} steps")

    @gpu_bound()
    async def stream(request: Request) -> StreamingResponse:
        await request.body()

        async def chunks() -> AsyncIterator[bytes]:
            for _ in range(steps):
                await executor.run(decode, 1)
                yield b"token "

        return StreamingResponse(chunks())

    app = Starlette(routes=[Route("/generate", generate, methods=["POST"]), Route("/stream", stream, methods=["POST"])])
    app.add_middleware(
        GPUAdmissionMiddleware, ledger=ledger, estimator=LinearEstimator(bytes_per_token=1), token_counter=Words(),
        cancel_on_disconnect=cancel,
    )
    return app


def request_bytes(path: str, port: int) -> bytes:
    head = (
        f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(BODY)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + BODY


async def until(predicate: Any, poll: float = 0.0005, timeout: float = 60) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(poll)


async def bytes_back(port: int, ledger: Ledger, path: str, leave_after: float) -> float:
    """Seconds from the client closing its socket to the ledger holding nothing."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request_bytes(path, port))
    await writer.drain()
    if path == "/stream":
        await reader.readuntil(b"token ")  # the response has started
    else:
        await until(lambda: ledger.statistics().reserved_bytes > 0)
        await asyncio.sleep(leave_after)
    left = time.perf_counter()
    writer.close()
    await until(lambda: ledger.statistics().reserved_bytes == 0)
    return time.perf_counter() - left


async def one_client(port: int, path: str, leave_after: float | None) -> float | None:
    """Latency of a request that stays (None for one that leaves)."""
    started = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request_bytes(path, port))
    await writer.drain()
    if leave_after is not None:
        await asyncio.sleep(leave_after)
        writer.close()
        return None
    answer = await reader.read()  # connection: close, so until the end
    writer.close()
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    return time.perf_counter() - started


async def load(
    port: int, ledger: Ledger, spent: list[int], path: str, requests: int, clients: int, steps: int, leave_after: float,
    seed: int,
) -> dict[str, float]:
    rng = random.Random(seed)
    plan = [leave_after if rng.random() < LEAVING else None for _ in range(requests)]
    queue: asyncio.Queue[float | None] = asyncio.Queue()
    for item in plan:
        queue.put_nowait(item)
    latencies: list[float] = []

    async def worker() -> None:
        while not queue.empty():
            latency = await one_client(port, path, queue.get_nowait())
            if latency is not None:
                latencies.append(latency)

    admitted, spent_before = ledger.statistics().admitted_total, spent[0]
    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    await until(lambda: ledger.statistics().in_flight == 0)  # the departed ones' work too
    wall = time.perf_counter() - started
    cuts = statistics.quantiles(latencies, n=20)
    return {
        "stayed": len(latencies), "left": plan.count(leave_after),
        "admitted": ledger.statistics().admitted_total - admitted,
        # Device steps run for clients that had gone (every staying client gets all its steps).
        "steps_for_departed": spent[0] - spent_before - len(latencies) * steps,
        "p50_s": statistics.median(latencies), "p95_s": cuts[18], "wall_s": wall,
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    step = args.step_ms / 1000
    results: dict[str, Any] = {"settings": vars(args), "bytes_back": {}, "load": {}}
    for cancel in (True, False):
        ledger = Ledger(10 * args.clients)
        executor = DeviceExecutor("cpu", inference_mode=False)
        spent = [0]
        app = build(ledger, executor, args.steps, step, cancel, spent)
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
        task = asyncio.ensure_future(server.serve())
        await until(lambda: server.started, poll=0.01)  # noqa: B023
        port = server.servers[0].sockets[0].getsockname()[1]
        mode = "cancel on" if cancel else "cancel off"
        try:
            for path in ("/generate", "/stream"):
                times = [await bytes_back(port, ledger, path, 5 * step) for _ in range(args.repeat)]
                results["bytes_back"][f"{path} {mode}"] = {
                    "median_ms": statistics.median(times) * 1000, "max_ms": max(times) * 1000,
                }
                results["load"][f"{path} {mode}"] = await load(
                    port, ledger, spent, path, args.requests, args.clients, args.steps, 5 * step, args.seed
                )
        finally:
            server.should_exit = True
            await task
            executor.shutdown()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--step-ms", type=float, default=10.0)
    parser.add_argument("--repeat", type=int, default=10, help="disconnects measured per case")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    results = asyncio.run(run(args))
    rows = [[case, r["median_ms"], r["max_ms"]] for case, r in results["bytes_back"].items()]
    print(table(rows, ["disconnect -> bytes back", "median ms", "max ms"]))
    print()
    rows = [
        [case, r["stayed"], r["left"], r["admitted"], r["steps_for_departed"], r["p50_s"], r["p95_s"], r["wall_s"]]
        for case, r in results["load"].items()
    ]
    header = ["30% leave early", "stayed", "left", "admitted", "steps for departed", "p50 s", "p95 s", "wall s"]
    print(table(rows, header))
    print(write_report("disconnect", results))


if __name__ == "__main__":
    main()
