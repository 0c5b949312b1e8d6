"""``/health`` statuses, the thermal clamp and the device guard, through real apps.

Device readings come from a probe written for the test (there is no GPU here): the sampler,
policies, middleware and router are the real code.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from fastapi import FastAPI
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Mount, Route

from gpu_asgi import (
    DeviceGuard,
    DeviceReading,
    DeviceSampler,
    GPUAdmissionMiddleware,
    Ledger,
    LinearEstimator,
    ThermalPolicy,
    gpu_bound,
    health_report,
    health_router,
)

from ._asgi import Words, client, wait_until

GIB = 1 << 30


class SettableProbe:
    """A probe whose readings the test sets; ``fail`` makes the next reads raise."""

    name = "test"

    def __init__(self, **readings: DeviceReading) -> None:
        self.readings = {reading.device: reading for reading in readings.values()}
        self.fail: str | None = None

    def set(self, device: str, **fields: Any) -> None:
        self.readings[device] = DeviceReading(device, **fields)

    def read(self) -> tuple[DeviceReading, ...]:
        if self.fail:
            raise RuntimeError(self.fail)
        return tuple(self.readings.values())

    def close(self) -> None:
        pass


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now



@gpu_bound(default_max_new_tokens=100, max_new_tokens_cap=1000)
async def generate(request: Request) -> JSONResponse:
    await request.body()  # admission happens at the first body read
    admission = request.state.gpu_admission
    body = await request.json()
    return JSONResponse(
        {
            "max_new_tokens": admission.max_new_tokens,
            "clamped_from": admission.clamped_from,
            "estimated_bytes": admission.estimated_bytes,
            "body_max_new_tokens": body.get("max_new_tokens"),
            "device": admission.device,
        }
    )


def app_with(ledger: Ledger, sampler: DeviceSampler, **options: Any) -> Starlette:
    router = health_router(
        ledger, sampler=sampler, thermal=options.get("thermal"), device_guard=options.get("device_guard")
    )
    app = Starlette(routes=[Route("/generate", generate, methods=["POST"]), Mount("/ops", app=router)])
    app.add_middleware(
        GPUAdmissionMiddleware,
        ledger=ledger,
        estimator=LinearEstimator(bytes_per_token=1),
        token_counter=Words(),
        sampler=sampler,
        **options,
    )
    return app



def sampler_for(probe: SettableProbe, clock: Clock | None = None) -> DeviceSampler:
    sampler = DeviceSampler(probe, interval=1.0, clock=clock or Clock())
    sampler.sample()
    sampler.ensure_started = lambda: None  # type: ignore[method-assign]  # the test drives sampling
    return sampler


async def test_health_ok_with_ledger_and_probe_readings() -> None:
    ledger = Ledger({"cuda:0": 1000, "cuda:1": 500})
    probe = SettableProbe(a=DeviceReading("cuda:0", 24 * GIB, 2 * GIB, 22 * GIB, 55.0, 0.5))
    sampler = sampler_for(probe)
    held = await ledger.reserve(300, devices=["cuda:0"])
    async with client(app_with(ledger, sampler, thermal=ThermalPolicy())) as http:
        response = await http.get("/ops/health")
    held.release()
    assert response.status_code == 200 and response.headers["cache-control"] == "no-store"
    body = response.json()
    assert body["status"] == "ok" and body["reasons"] == []
    assert body["waiting"] == 0 and body["in_flight"] == 1 and body["admitted_total"] == 1
    cuda0, cuda1 = body["devices"]
    assert cuda0 == {
        "name": "cuda:0",
        "capacity_bytes": 1000,
        "reserved_bytes": 300,
        "free_bytes": 700,
        "in_flight": 1,
        "probe": {
            "memory_total_bytes": 24 * GIB,
            "memory_used_bytes": 2 * GIB,
            "memory_free_bytes": 22 * GIB,
            "reclaimable_bytes": 0,
            "temperature_celsius": 55.0,
            "utilization_ratio": 0.5,
        },
    }
    assert cuda1["probe"] is None and cuda1["reserved_bytes"] == 0
    assert body["probe"] == {"kind": "test", "ok": True, "age_seconds": 0.0, "error": None}


async def test_health_without_a_sampler_and_on_fastapi() -> None:
    ledger = Ledger(1000)
    app = FastAPI()
    app.router.routes.extend(health_router(ledger).routes)  # top-level /health
    async with client(app) as http:
        response = await http.get("/health")
    assert response.status_code == 200
    assert response.json()["status"] == "ok" and response.json()["probe"] is None


async def test_health_degraded_when_hot_and_unavailable_when_too_hot() -> None:
    ledger = Ledger(1000)
    probe = SettableProbe(a=DeviceReading("cuda:0", temperature_celsius=80.0))
    sampler = sampler_for(probe)
    thermal = ThermalPolicy(degraded_above_celsius=75, unavailable_above_celsius=90)
    async with client(app_with(ledger, sampler, thermal=thermal)) as http:
        degraded = await http.get("/ops/health")
        probe.set("cuda:0", temperature_celsius=92.0)
        sampler.sample()
        unavailable = await http.get("/ops/health")
    assert degraded.status_code == 200 and degraded.json()["status"] == "degraded"
    assert degraded.json()["reasons"] == ["cuda:0 is at 80 °C, above 75"]
    assert unavailable.status_code == 503 and unavailable.json()["status"] == "unavailable"
    assert unavailable.json()["reasons"] == ["cuda:0 is at 92 °C, above 90"]


async def test_health_unavailable_when_the_queue_is_full() -> None:
    ledger = Ledger(100, max_queue=1)
    holder = await ledger.reserve(100)
    waiter = asyncio.ensure_future(ledger.reserve(10))
    await asyncio.sleep(0)
    body = health_report(ledger)
    waiter.cancel()
    holder.release()
    assert body["status"] == "unavailable" and body["waiting"] == 1 and "queue is full" in body["reasons"][0]


@pytest.mark.parametrize("closed", [False, True], ids=["fail-open", "fail-closed"])
async def test_probe_failure_degrades_or_makes_unavailable(closed: bool) -> None:
    ledger = Ledger(1000)
    probe = SettableProbe(a=DeviceReading("cuda:0", memory_free_bytes=GIB))
    clock = Clock()
    sampler = sampler_for(probe, clock)
    guard = DeviceGuard(margin_bytes=0, on_probe_failure="closed" if closed else "open", max_age=2.0)
    probe.fail = "NVMLError_GpuIsLost: GPU is lost"
    sampler.sample()
    async with client(app_with(ledger, sampler, device_guard=guard)) as http:
        health = await http.get("/ops/health")
        admitted = await http.post("/generate", json={"prompt": "a", "max_new_tokens": 5})
    expected = "unavailable" if closed else "degraded"
    assert health.json()["status"] == expected and health.status_code == (503 if closed else 200)
    assert "GPU is lost" in health.json()["reasons"][0] and health.json()["probe"]["ok"] is False
    if closed:
        assert admitted.status_code == 503
        assert admitted.headers["x-gpu-admission-reason"] == "device-probe-failed"
        assert "GPU is lost" in admitted.json()["detail"] and "retry-after" in admitted.headers
    else:
        assert admitted.status_code == 200
    assert ledger.statistics().reserved_bytes == 0


async def test_stale_readings_count_as_a_probe_failure() -> None:
    ledger = Ledger(1000)
    clock = Clock()
    sampler = sampler_for(SettableProbe(a=DeviceReading("cuda:0", memory_free_bytes=GIB)), clock)
    clock.now += 10  # the sampler thread stopped sampling (a hung NVML call, say)
    report = health_report(ledger, sampler=sampler, device_guard=DeviceGuard(on_probe_failure="closed", max_age=2.0))
    assert report["status"] == "unavailable" and "10.0 s old" in report["reasons"][0]


async def test_thermal_clamp_lowers_max_new_tokens_and_says_so() -> None:
    ledger = Ledger(10_000)
    probe = SettableProbe(a=DeviceReading("cuda:0", temperature_celsius=70.0))
    sampler = sampler_for(probe)
    thermal = ThermalPolicy(degraded_above_celsius=75, clamp_max_new_tokens=16)
    async with client(app_with(ledger, sampler, thermal=thermal)) as http:
        cool = await http.post("/generate", json={"prompt": "a b", "max_new_tokens": 500})
        probe.set("cuda:0", temperature_celsius=78.0)
        sampler.sample()
        hot = await http.post("/generate", json={"prompt": "a b", "max_new_tokens": 500})
        hot_default = await http.post("/generate", json={"prompt": "a b"})
        hot_small = await http.post("/generate", json={"prompt": "a b", "max_new_tokens": 8})
    assert cool.json() == {
        "max_new_tokens": 500,
        "clamped_from": None,
        "estimated_bytes": 502,
        "body_max_new_tokens": 500,
        "device": "cuda:0",
    }
    assert "x-gpu-admission-clamped-max-new-tokens" not in cool.headers
    # the endpoint sees the clamped value (the body keeps the client's), the estimate is for 16
    assert hot.json() == {
        "max_new_tokens": 16,
        "clamped_from": 500,
        "estimated_bytes": 18,
        "body_max_new_tokens": 500,
        "device": "cuda:0",
    }
    assert hot.headers["x-gpu-admission-clamped-max-new-tokens"] == "16"
    assert hot.headers["content-type"] == "application/json"  # the endpoint's own headers are kept
    assert hot_default.json()["max_new_tokens"] == 16 and hot_default.json()["clamped_from"] == 100
    assert (
        hot_small.json()["clamped_from"] is None and "x-gpu-admission-clamped-max-new-tokens" not in hot_small.headers
    )


async def test_device_guard_refuses_when_real_free_memory_is_low() -> None:
    ledger = Ledger(10_000)
    probe = SettableProbe(a=DeviceReading("cuda:0", memory_free_bytes=600, reclaimable_bytes=100))
    sampler = sampler_for(probe)
    guard = DeviceGuard(margin_bytes=200)
    async with client(app_with(ledger, sampler, device_guard=guard)) as http:
        fits = await http.post("/generate", json={"prompt": "a", "max_new_tokens": 499})  # 500 + 200 <= 700
        refused = await http.post("/generate", json={"prompt": "a", "max_new_tokens": 500})
    assert fits.status_code == 200
    assert refused.status_code == 503 and refused.headers["x-gpu-admission-reason"] == "device-memory-low"
    assert refused.headers["retry-after"].isdigit()
    problem = refused.json()
    assert problem["available_bytes"] == 700 and problem["required_bytes"] == 701 and problem["device"] == "cuda:0"
    stats = ledger.statistics()
    assert stats.reserved_bytes == 0 and stats.in_flight == 0
    assert stats.admitted_total == 1  # refused before the ledger was asked: nothing to give back


async def test_device_guard_passes_over_a_device_another_process_has_filled() -> None:
    # The ledger alone would pick cuda:0 (more budget free); its real memory says otherwise.
    ledger = Ledger({"cuda:0": 10_000, "cuda:1": 5_000})
    probe = SettableProbe(
        a=DeviceReading("cuda:0", memory_free_bytes=100),  # filled by someone else
        b=DeviceReading("cuda:1", memory_free_bytes=GIB),
    )
    sampler = sampler_for(probe)
    async with client(app_with(ledger, sampler, device_guard=DeviceGuard(margin_bytes=0))) as http:
        placed = await http.post("/generate", json={"prompt": "a", "max_new_tokens": 500})
        probe.set("cuda:1", memory_free_bytes=100)
        sampler.sample()
        refused = await http.post("/generate", json={"prompt": "a", "max_new_tokens": 500})
    assert placed.status_code == 200 and placed.json()["device"] == "cuda:1"
    assert refused.status_code == 503 and refused.headers["x-gpu-admission-reason"] == "device-memory-low"
    assert refused.json()["device"] == "cuda:0"  # the first refusal is the one reported
    assert ledger.statistics().admitted_total == 1


async def test_device_guard_checks_again_after_a_wait_in_the_queue() -> None:
    ledger = Ledger(1_000)
    probe = SettableProbe(a=DeviceReading("cuda:0", memory_free_bytes=GIB))
    sampler = sampler_for(probe)
    holder = await ledger.reserve(1_000)
    async with client(app_with(ledger, sampler, device_guard=DeviceGuard(margin_bytes=0))) as http:
        queued = asyncio.ensure_future(http.post("/generate", json={"prompt": "a", "max_new_tokens": 500}))
        await wait_until(lambda: ledger.statistics().waiting == 1)
        probe.set("cuda:0", memory_free_bytes=100)  # another process filled the device meanwhile
        sampler.sample()
        holder.release()
        refused = await queued
    assert refused.status_code == 503 and refused.headers["x-gpu-admission-reason"] == "device-memory-low"
    stats = ledger.statistics()
    assert stats.reserved_bytes == 0 and stats.in_flight == 0  # the granted bytes went back


def test_policies_need_a_sampler() -> None:
    with pytest.raises(ValueError, match="sampler"):
        GPUAdmissionMiddleware(
            Starlette(), ledger=Ledger(10), estimator=LinearEstimator(bytes_per_token=1), thermal=ThermalPolicy()
        )


@pytest.mark.parametrize("reading", [None, DeviceReading("cuda:0", temperature_celsius=40.0)], ids=["no-reading", "no-free-figure"])
async def test_health_unavailable_when_a_closed_guard_refuses_every_device(reading: DeviceReading | None) -> None:
    # The probe answers (a fresh snapshot), but not for the ledger's device, or without its free
    # memory: admission refuses every request, so /health must not say ok.
    ledger = Ledger(1000)
    probe = SettableProbe() if reading is None else SettableProbe(a=reading)
    sampler = sampler_for(probe)
    guard = DeviceGuard(margin_bytes=0, on_probe_failure="closed")
    async with client(app_with(ledger, sampler, device_guard=guard)) as http:
        refused = await http.post("/generate", json={"prompt": "a", "max_new_tokens": 5})
        health = await http.get("/ops/health")
    assert refused.status_code == 503 and refused.headers["x-gpu-admission-reason"] == "device-probe-failed"
    assert health.status_code == 503 and health.json()["status"] == "unavailable"
    assert health.json()["reasons"] == [f"the device guard cannot check cuda:0: {refused.json()['detail'].split(': ', 1)[1][:-1]}"]


async def test_health_degraded_when_a_closed_guard_can_check_only_some_devices() -> None:
    ledger = Ledger({"cuda:0": 1000, "cuda:1": 1000})
    sampler = sampler_for(SettableProbe(a=DeviceReading("cuda:1", memory_free_bytes=GIB)))
    report = health_report(ledger, sampler=sampler, device_guard=DeviceGuard(on_probe_failure="closed"))
    assert report["status"] == "degraded"
    assert report["reasons"] == ["the device guard cannot check cuda:0: the probe has no reading for cuda:0"]


@pytest.mark.parametrize(("availability", "expected"), [("unavailable", "unavailable"), ("local", "degraded")])
def test_health_follows_an_unreachable_shared_ledger(availability: str, expected: str) -> None:
    # RedisLedger's `availability` while Redis is away, on an in-process ledger: fail-closed
    # refuses every request (503 ledger-unavailable), so /health must say so too.
    class Unreachable(Ledger):
        pass

    Unreachable.availability = availability  # type: ignore[assignment]

    report = health_report(Unreachable(1000))
    assert report["status"] == expected and "shared ledger is unreachable" in report["reasons"][0]
    assert health_report(Ledger(1000))["status"] == "ok"
