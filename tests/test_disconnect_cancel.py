"""An admitted endpoint whose client disconnects before the response starts is cancelled
(``gpu_asgi._asgi.cancel``); its bytes come back once its work has stopped."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, StreamingResponse
from starlette.routing import Route

from gpu_asgi import DeviceExecutor, GPUAdmissionMiddleware, Ledger, LinearEstimator, gpu_bound, stop_requested

from ._asgi import RawClient, Words, http_scope, wait_until
from .test_uvicorn import post, serve

BODY = json.dumps({"prompt": "go", "max_new_tokens": 9}).encode()  # 10 bytes with Words()


def wrap(app: Any, ledger: Ledger, **options: Any) -> GPUAdmissionMiddleware:
    return GPUAdmissionMiddleware(
        app, ledger=ledger, estimator=LinearEstimator(bytes_per_token=1), token_counter=Words(), **options
    )


def sleeper(events: list[str], *, seconds: float = 3.0, **tag: Any) -> Starlette:
    @gpu_bound(**tag)
    async def generate(request: Request) -> PlainTextResponse:
        await request.body()
        events.append("started")
        try:
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            events.append("cancelled")
            raise
        events.append("finished")
        return PlainTextResponse("generated")

    return Starlette(routes=[Route("/generate", generate, methods=["POST"])])


async def test_async_endpoint_is_cancelled_and_its_bytes_come_back_at_once() -> None:
    ledger, events = Ledger(100), []
    app = wrap(sleeper(events), ledger)
    raw = RawClient(app, http_scope(app=app), [BODY]).start()
    await wait_until(lambda: events == ["started"])
    assert ledger.statistics().reserved_bytes == 10
    started = time.perf_counter()
    raw.disconnect()
    await wait_until(lambda: ledger.statistics().reserved_bytes == 0)
    back_after = time.perf_counter() - started
    await raw.finish(5)  # the request's task ends normally: the cancellation was absorbed
    assert events == ["started", "cancelled"]
    assert raw.status == 499  # for access logs; nobody reads it
    assert ledger.statistics().in_flight == 0
    assert back_after < 0.5, back_after  # measured ~1 ms; loose for a loaded CI machine


async def test_route_that_must_finish_is_not_cancelled() -> None:
    ledger, events = Ledger(100), []
    app = wrap(sleeper(events, seconds=0.2, cancel_on_disconnect=False), ledger)
    raw = RawClient(app, http_scope(app=app), [BODY]).start()
    await wait_until(lambda: events == ["started"])
    raw.disconnect()
    await raw.finish(5)
    assert events == ["started", "finished"]
    assert ledger.statistics().reserved_bytes == 0


async def test_middleware_option_turns_it_off_and_a_route_turns_it_back_on() -> None:
    for route_says, expected in ((None, ["started", "finished"]), (True, ["started", "cancelled"])):
        ledger, events = Ledger(100), []
        app = wrap(sleeper(events, seconds=0.2, cancel_on_disconnect=route_says), ledger, cancel_on_disconnect=False)
        raw = RawClient(app, http_scope(app=app), [BODY]).start()
        await wait_until(lambda: events == ["started"])  # noqa: B023
        raw.disconnect()
        await raw.finish(5)
        assert events == expected


async def test_device_executor_call_stops_at_its_next_step_and_bytes_wait_for_it() -> None:
    ledger, steps, stopped_at = Ledger(100), [0], []
    executor = DeviceExecutor("cpu", inference_mode=False)
    step_seconds = 0.02

    def generate() -> str:
        while not stop_requested():
            time.sleep(step_seconds)  # one decode step
            steps[0] += 1
        stopped_at.append(time.perf_counter())
        assert ledger.statistics().reserved_bytes == 10  # still held while the thread runs
        return "stopped"

    @gpu_bound()
    async def endpoint(request: Request) -> PlainTextResponse:
        await request.body()
        return PlainTextResponse(await executor.run(generate))

    app = wrap(Starlette(routes=[Route("/generate", endpoint, methods=["POST"])]), ledger)
    raw = RawClient(app, http_scope(app=app), [BODY]).start()
    await wait_until(lambda: steps[0] >= 3)
    left = time.perf_counter()
    raw.disconnect()
    await wait_until(lambda: ledger.statistics().reserved_bytes == 0)
    back = time.perf_counter()
    await raw.finish(5)
    executor.shutdown()
    assert stopped_at and stopped_at[0] <= back  # the bytes came back after the thread returned
    assert raw.status == 499
    assert back - left < 0.5, back - left  # one step is 20 ms; loose for a loaded CI machine


async def test_sync_endpoint_is_not_cancelled_and_keeps_its_bytes_until_it_returns() -> None:
    # A `def` endpoint runs on a worker thread nothing can stop: cancelling its task would only
    # release the bytes while the thread still runs.
    ledger, release, done = Ledger(100), threading.Event(), threading.Event()
    app = FastAPI()

    @app.post("/generate")
    @gpu_bound()
    def generate(body: dict[str, Any]) -> dict[str, str]:
        release.wait(5)
        done.set()
        return {"done": "yes"}

    wrapped = wrap(app, ledger)  # type: ignore[arg-type]
    raw = RawClient(wrapped, http_scope(app=wrapped), [BODY]).start()
    await wait_until(lambda: ledger.statistics().reserved_bytes == 10)
    raw.disconnect()
    await asyncio.sleep(0.1)
    assert ledger.statistics().reserved_bytes == 10  # the thread still runs: held
    release.set()
    await raw.finish(5)
    assert done.is_set() and raw.status == 200 and ledger.statistics().reserved_bytes == 0


async def test_a_started_stream_is_not_cancelled_by_gpu_asgi() -> None:
    # Once the response has started, ending it is the server's and Starlette's (a send that
    # raises, or the stream's disconnect listener): this raw client's send never raises.
    ledger, events = Ledger(100), []

    @gpu_bound()
    async def stream(request: Request) -> StreamingResponse:
        await request.body()

        async def chunks() -> AsyncIterator[bytes]:
            yield b"first "
            try:
                await asyncio.sleep(0.2)
            except asyncio.CancelledError:
                events.append("stream cancelled")
                raise
            yield b"last"

        return StreamingResponse(chunks())

    app = wrap(Starlette(routes=[Route("/generate", stream, methods=["POST"])]), ledger)
    raw = RawClient(app, http_scope(app=app), [BODY]).start()
    await wait_until(lambda: raw.body == b"first ")
    raw.disconnect()
    await raw.finish(5)
    assert (raw.status, raw.body, events) == (200, b"first last", [])
    assert ledger.statistics().reserved_bytes == 0


async def test_a_cancellation_from_elsewhere_is_not_swallowed() -> None:
    # The server cancelling the request (its graceful timeout) must still see CancelledError.
    ledger, events = Ledger(100), []
    app = wrap(sleeper(events), ledger)
    raw = RawClient(app, http_scope(app=app), [BODY]).start()
    await wait_until(lambda: events == ["started"])
    assert raw.task is not None
    raw.task.cancel()
    await asyncio.gather(raw.task, return_exceptions=True)
    assert raw.task.cancelled()
    assert ledger.statistics().reserved_bytes == 0


async def test_under_uvicorn_a_client_leaving_mid_call_cancels_the_endpoint() -> None:
    ledger, events = Ledger(100), []
    app = sleeper(events)
    app.add_middleware(
        GPUAdmissionMiddleware, ledger=ledger, estimator=LinearEstimator(bytes_per_token=1), token_counter=Words()
    )
    async with serve(app) as port:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(post(port, json.loads(BODY)))
        await writer.drain()
        await wait_until(lambda: events == ["started"])
        left = time.perf_counter()
        writer.close()
        await wait_until(lambda: ledger.statistics().reserved_bytes == 0)
        back_after = time.perf_counter() - left
        await wait_until(lambda: ledger.statistics().in_flight == 0)
    assert events == ["started", "cancelled"]
    assert back_after < 0.5, back_after  # a 3 s call; measured a few ms


async def test_stop_on_cancel_ends_hugging_face_generate_at_the_next_step() -> None:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, StoppingCriteriaList

    from gpu_asgi import StopOnCancel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=4096)).eval()
    steps: list[float] = []

    def count_step(input_ids: Any, scores: Any, **kwargs: Any) -> Any:
        steps.append(time.perf_counter())
        time.sleep(0.005)  # a decode step long enough to cancel between
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    def generate() -> int:
        ids = torch.tensor([[1, 2, 3]])
        criteria = StoppingCriteriaList([count_step, StopOnCancel()])  # type: ignore[list-item]
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=3000, min_new_tokens=3000, do_sample=False,
            stopping_criteria=criteria, pad_token_id=0,
        )
        return int(out.shape[1])

    executor = DeviceExecutor("cpu")
    task = asyncio.ensure_future(executor.run(generate))
    await wait_until(lambda: len(steps) >= 5)
    cancelled_at = time.perf_counter()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    executor.shutdown()
    assert task.cancelled()
    assert len([t for t in steps if t > cancelled_at]) <= 2  # the step in progress, then it stopped
    assert len(steps) < 1000
