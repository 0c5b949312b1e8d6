"""Refusal at arrival, the default (docs/admission.md, "Deadlines"): a request predicted to wait
longer than it may (its deadline, else the ledger's ``max_wait``) is refused at once with
``Retry-After`` = the prediction, in both ledgers, so the queue holds only what drains within
``max_wait``. The patient queue (``deadline=inf``, ``@gpu_bound(patient=True)``,
``GPU_ASGI_PATIENT=1``) keeps every request for ``max_wait``. A ``queue-timeout`` of a request
that queued on a prediction says so, and is counted as a misprediction."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from gpu_asgi import (
    AdmissionRejected,
    BudgetLedger,
    GPUAdmissionMiddleware,
    GPUMetrics,
    Ledger,
    QueueTimeout,
    Reservation,
    RouteSpec,
    gpu_bound,
)
from gpu_asgi._ledger.drain import MAX_RETRY_AFTER, MIN_RETRY_AFTER
from gpu_asgi._vllm.settings import VLLMSettings

from . import _redis
from ._asgi import client, wait_until
from ._backends import BACKENDS, Backend, Clock, open_backend, recording, start

redis_server, namespace = _redis.redis_server, _redis.namespace  # fixtures


@pytest.fixture(params=BACKENDS)
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    async with open_backend(request, clock=Clock()) as opened:
        yield opened


async def full_at_ten_bytes_a_second(backend: Backend, ledger: BudgetLedger) -> Reservation:
    """A drain rate of 5-10 bytes per busy second (Redis counts a release as it lands), and the
    whole budget (100) held. Its own requests are patient: in Redis a release lands after the
    next request has asked, which would otherwise be predicted a wait behind it."""
    for _ in range(5):
        reservation = await ledger.reserve(100, deadline=math.inf)
        backend.clock.advance(10)
        reservation.release()
    return await ledger.reserve(100, deadline=math.inf)


async def refusal(ledger: BudgetLedger, nbytes: int, **options: Any) -> AdmissionRejected:
    with pytest.raises(AdmissionRejected) as caught:
        await ledger.reserve(nbytes, **options)
    return caught.value


async def test_a_request_predicted_to_wait_past_max_wait_is_refused_at_once(backend: Backend) -> None:
    """No deadline given: 20 bytes behind a full budget of 100 and four patient waiters of 20 wait
    about (80 + 20) / 10 = 10 s (20 s at 5 B/s), more than max_wait (5 s): refused before
    joining the queue."""
    ledger = backend.make(100, max_wait=5)
    holder = await full_at_ten_bytes_a_second(backend, ledger)
    patient = [start(ledger, 20, deadline=math.inf) for _ in range(4)]
    await backend.queued(ledger, 4)

    refused = await refusal(ledger, 20)
    assert refused.reason == "deadline-unmeetable"
    assert 8 <= refused.retry_after <= 25  # type: ignore[operator]  # Retry-After is the prediction
    assert refused.extensions["predicted_wait_seconds"] == round(refused.retry_after, 3)  # type: ignore[arg-type]
    await backend.queued(ledger, 4)  # it never joined
    assert not any(task.done() for task in patient)
    for task in patient:
        task.cancel()
    holder.release()


async def test_the_patient_queue_keeps_the_request_whatever_the_prediction(backend: Backend) -> None:
    ledger = backend.make(100, max_wait=5)
    holder = await full_at_ten_bytes_a_second(backend, ledger)
    patient = [start(ledger, 20, deadline=math.inf) for _ in range(5)]
    await backend.queued(ledger, 5)  # the fifth too, predicted at 10 s
    holder.release()
    granted = await asyncio.wait_for(asyncio.gather(*patient), 10)
    assert sum(r.nbytes for r in granted) == 100
    for reservation in granted:
        reservation.release()


async def test_the_queue_is_bounded_by_the_time_it_takes_to_drain(backend: Backend) -> None:
    """max_queue (256) never binds: at 10 bytes a second and max_wait 5 s, 20-byte requests
    queue while the queue ahead of them drains within 5 s, and every later one is refused at
    once, each told the wait it was predicted."""
    ledger = backend.make(100, max_wait=5, max_queue=256)
    holder = await full_at_ten_bytes_a_second(backend, ledger)
    queued: list[asyncio.Task[Reservation]] = []
    refused: list[AdmissionRejected] = []
    for _ in range(12):
        task = start(ledger, 20)
        await backend.quiet()
        if task.done():
            error = task.exception()
            assert isinstance(error, AdmissionRejected)
            refused.append(error)
        else:
            queued.append(task)
            await backend.queued(ledger, len(queued))
    assert 1 <= len(queued) <= 3  # 5 s x 5-10 B/s / 20 B
    assert len(refused) == 12 - len(queued) and {error.reason for error in refused} == {"deadline-unmeetable"}
    assert all(5 < error.retry_after <= MAX_RETRY_AFTER for error in refused)  # type: ignore[operator]
    for task in queued:
        task.cancel()
    holder.release()


async def test_without_a_drain_rate_the_queue_takes_the_request() -> None:
    """Before any release there is no prediction: the request queues, as a cold server must."""
    ledger = Ledger(100, max_wait=5)
    holder = await ledger.reserve(100)
    waiter = start(ledger, 20)
    await wait_until(lambda: ledger.statistics().waiting == 1)
    holder.release()
    (await waiter).release()


# -- through the middleware: the answer, the patient route, the misprediction metric -----------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Fixed:
    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes

    def estimate(self, prompt_tokens: int, max_new_tokens: int, batch: int = 1, *, sampling: bool | None = None) -> int:
        return self.nbytes


async def full_ledger(max_wait: float) -> tuple[Ledger, Reservation]:
    """An in-process ledger that has seen 10,000 bytes per busy second, now full (100,000 held)."""
    clock = FakeClock()
    ledger = Ledger(100_000, clock=clock, max_wait=max_wait)
    for _ in range(10):
        reservation = await ledger.reserve(10_000)
        clock.now += 1
        reservation.release()
    return ledger, await ledger.reserve(100_000)


def app_for(ledger: BudgetLedger, nbytes: int, metrics: GPUMetrics | None = None, **route: Any) -> Starlette:
    @gpu_bound(**route)
    async def generate(request: Request) -> JSONResponse:
        await request.body()
        return JSONResponse({"ok": True})

    app = Starlette(routes=[Route("/generate", generate, methods=["POST"])])
    app.add_middleware(GPUAdmissionMiddleware, ledger=ledger, estimator=Fixed(nbytes), metrics=metrics)
    return app


async def post(app: Starlette) -> httpx.Response:
    async with client(app) as http:
        return await http.post("/generate", json={"prompt": "hi"})


async def test_the_middleware_answers_at_once_with_the_predicted_wait() -> None:
    ledger, holder = await full_ledger(max_wait=2)  # 50,000 bytes at 10,000 B/s: 5 s predicted
    started = asyncio.get_running_loop().time()
    response = await post(app_for(ledger, 50_000))
    assert asyncio.get_running_loop().time() - started < 1  # not after the 2 s wait
    assert response.status_code == 503 and response.json()["type"].endswith(":deadline-unmeetable")
    assert response.headers["retry-after"] == "5"
    assert ledger.statistics().waiting == 0
    holder.release()


async def test_a_timeout_after_a_prediction_is_counted_as_a_misprediction() -> None:
    """Predicted 1.5 s, within max_wait (2 s), so it queues; nothing comes back: queue-timeout,
    with the prediction in the answer and in gpu_asgi_wait_mispredicted_total. A patient route's
    timeout made no prediction and is not counted."""
    ledger, holder = await full_ledger(max_wait=2)
    registry = CollectorRegistry()
    metrics = GPUMetrics(ledger, registry=registry, multiprocess=False)
    response = await post(app_for(ledger, 15_000, metrics))
    assert response.status_code == 503
    problem = response.json()
    assert problem["type"].endswith(":queue-timeout") and problem["predicted_wait_seconds"] == pytest.approx(1.5, abs=0.1)
    assert registry.get_sample_value("gpu_asgi_wait_mispredicted_total") == 1

    patient = await post(app_for(ledger, 50_000, metrics, patient=True))  # predicted 5 s: queues all the same
    assert patient.status_code == 503
    assert patient.json()["type"].endswith(":queue-timeout") and "predicted_wait_seconds" not in patient.json()
    assert registry.get_sample_value("gpu_asgi_wait_mispredicted_total") == 1
    assert registry.get_sample_value("gpu_asgi_rejected_total", {"reason": "queue-timeout"}) == 2
    holder.release()


async def test_a_patient_route_asks_the_ledger_for_the_patient_queue() -> None:
    ledger, holder = await full_ledger(max_wait=30)
    deadlines = recording(ledger)
    request = asyncio.ensure_future(post(app_for(ledger, 50_000, patient=True)))
    await wait_until(lambda: ledger.statistics().waiting == 1)
    holder.release()
    assert (await request).status_code == 200
    assert deadlines == [math.inf]
    with pytest.raises(ValueError, match="patient"):
        RouteSpec(patient=True, deadline=5.0)


def test_queue_timeout_without_a_prediction_says_none() -> None:
    from gpu_asgi._ledger.forecast import queue_timeout

    assert "predicted_wait_seconds" not in queue_timeout(10, 2.0, 3.0, None).extensions
    error = queue_timeout(10, 2.0, 3.0, 1.25)
    assert isinstance(error, QueueTimeout) and error.extensions["predicted_wait_seconds"] == 1.25
    assert error.retry_after == 3.0 and MIN_RETRY_AFTER <= error.retry_after


def test_vllm_reads_the_patient_setting() -> None:
    assert VLLMSettings().patient is False
    assert VLLMSettings.from_env({"GPU_ASGI_PATIENT": "1"}).patient is True
    with pytest.raises(ValueError, match="GPU_ASGI_PATIENT"):
        VLLMSettings.from_env({"GPU_ASGI_PATIENT": "sometimes"})
