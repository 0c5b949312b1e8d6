"""Prometheus metrics, read back the way Prometheus reads them: by parsing the exposition text."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Mount, Route

from gpu_asgi import (
    DeviceReading,
    DeviceSampler,
    GPUAdmissionMiddleware,
    GPUMetrics,
    Ledger,
    LinearEstimator,
    TenantPolicy,
    ThermalPolicy,
    gpu_bound,
    health_router,
)

from ._asgi import Words

GIB = 1 << 30
ROOT = Path(__file__).resolve().parent.parent


class OneGPU:
    name = "test"

    def read(self) -> tuple[DeviceReading, ...]:
        return (DeviceReading("cuda:0", 24 * GIB, 6 * GIB, 18 * GIB, 81.0, 0.75),)

    def close(self) -> None:
        pass



@gpu_bound()
async def generate(request: Request) -> JSONResponse:
    await request.body()  # admission happens at the first body read
    admission = request.state.gpu_admission
    admission.report_peak_bytes(admission.estimated_bytes // 2)  # measured half of the estimate
    return JSONResponse({"ok": True})


def build(ledger: Ledger, metrics: GPUMetrics, sampler: DeviceSampler, **options: Any) -> Starlette:
    router = health_router(ledger, sampler=sampler, metrics=metrics)
    app = Starlette(routes=[Route("/generate", generate, methods=["POST"]), Mount("/ops", app=router)])
    app.add_middleware(
        GPUAdmissionMiddleware,
        ledger=ledger,
        estimator=LinearEstimator(bytes_per_token=1),
        token_counter=Words(),
        metrics=metrics,
        sampler=sampler,
        **options,
    )
    return app


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    parsed = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            parsed[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return parsed


def value(parsed: dict[Any, float], name: str, **labels: str) -> float:
    return parsed[(name, frozenset(labels.items()))]


async def test_metrics_endpoint_exposes_every_metric() -> None:
    ledger = Ledger(1000, max_queue=0)
    sampler = DeviceSampler(OneGPU())
    sampler.sample()
    metrics = GPUMetrics(ledger, sampler=sampler, registry=CollectorRegistry(), multiprocess=False)
    thermal = ThermalPolicy(degraded_above_celsius=75, clamp_max_new_tokens=50)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=build(ledger, metrics, sampler, thermal=thermal)), base_url="http://t"
    ) as http:
        for _ in range(2):
            assert (await http.post("/generate", json={"prompt": "a b c", "max_new_tokens": 97})).status_code == 200
        held = await ledger.reserve(990)
        full = await http.post("/generate", json={"prompt": "a", "max_new_tokens": 10})
        bad = await http.post("/generate", content=b"[", headers={"content-type": "application/json"})
        response = await http.get("/ops/metrics")
        held.release()
        after = samples((await http.get("/ops/metrics")).text)
    assert (full.status_code, bad.status_code) == (503, 400)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain; version=0.0.4")
    parsed = samples(response.text)
    assert value(parsed, "gpu_asgi_admitted_total", device="cuda:0") == 2
    assert value(parsed, "gpu_asgi_rejected_total", reason="queue-full") == 1
    assert value(parsed, "gpu_asgi_rejected_total", reason="invalid-json") == 1
    assert value(parsed, "gpu_asgi_max_new_tokens_clamped_total") == 2  # 81 °C: 97 -> 50, twice
    assert value(parsed, "gpu_asgi_queue_wait_seconds_count", outcome="admitted") == 2
    assert value(parsed, "gpu_asgi_queue_wait_seconds_bucket", outcome="admitted", le="0.001") == 2
    assert value(parsed, "gpu_asgi_queue_wait_seconds_count", outcome="rejected") == 1
    assert value(parsed, "gpu_asgi_peak_estimate_ratio_count", device="cuda:0") == 2
    assert value(parsed, "gpu_asgi_peak_estimate_ratio_sum", device="cuda:0") == pytest.approx(2 * 26 / 53)
    # state gauges, read at scrape time
    assert value(parsed, "gpu_asgi_reserved_bytes", device="cuda:0") == 990
    assert value(parsed, "gpu_asgi_capacity_bytes", device="cuda:0") == 1000
    assert value(parsed, "gpu_asgi_in_flight_requests", device="cuda:0") == 1
    assert value(parsed, "gpu_asgi_queue_depth") == 0 and value(parsed, "gpu_asgi_queue_bytes") == 0
    assert value(after, "gpu_asgi_reserved_bytes", device="cuda:0") == 0
    assert value(after, "gpu_asgi_in_flight_requests", device="cuda:0") == 0
    assert value(parsed, "gpu_asgi_device_memory_used_bytes", device="cuda:0") == 6 * GIB
    assert value(parsed, "gpu_asgi_device_memory_total_bytes", device="cuda:0") == 24 * GIB
    assert value(parsed, "gpu_asgi_device_temperature_celsius", device="cuda:0") == 81.0
    assert value(parsed, "gpu_asgi_device_utilization_ratio", device="cuda:0") == 0.75
    assert value(parsed, "gpu_asgi_device_probe_up") == 1


def test_metric_names_follow_prometheus_conventions() -> None:
    sampler = DeviceSampler(OneGPU())
    sampler.sample()
    metrics = GPUMetrics(Ledger(10), sampler=sampler, registry=CollectorRegistry(), multiprocess=False)
    metrics.record_decision("admitted", device="cuda:0", reason=None, wait_seconds=0.0, tenant="default")
    metrics.record_decision("rejected", device=None, reason="queue-full", wait_seconds=0.0, tenant="other")
    metrics.record_rejection("queue-full")
    metrics.record_clamp()
    metrics.record_peak("cuda:0", 10, 9)
    body, _ = metrics.render()
    families = {
        family.name: family.type
        for family in text_string_to_metric_families(body.decode())
        if not family.name.endswith("_created")  # prometheus-client's creation timestamps
    }
    assert families == {
        "gpu_asgi_admitted": "counter",
        "gpu_asgi_rejected": "counter",
        "gpu_asgi_wait_mispredicted": "counter",
        "gpu_asgi_max_new_tokens_clamped": "counter",
        "gpu_asgi_queue_wait_seconds": "histogram",
        "gpu_asgi_peak_estimate_ratio": "histogram",
        "gpu_asgi_reserved_output_share": "histogram",
        "gpu_asgi_reservation_grown_bytes": "counter",
        "gpu_asgi_tenant_admitted": "counter",
        "gpu_asgi_tenant_rejected": "counter",
        "gpu_asgi_tenant_queue_wait_seconds": "histogram",
        "gpu_asgi_queue_depth": "gauge",
        "gpu_asgi_queue_bytes": "gauge",
        "gpu_asgi_in_flight_requests": "gauge",
        "gpu_asgi_reserved_bytes": "gauge",
        "gpu_asgi_capacity_bytes": "gauge",
        "gpu_asgi_ledger_failovers": "gauge",
        "gpu_asgi_device_memory_used_bytes": "gauge",
        "gpu_asgi_device_memory_total_bytes": "gauge",
        "gpu_asgi_device_temperature_celsius": "gauge",
        "gpu_asgi_device_utilization_ratio": "gauge",
        "gpu_asgi_device_probe_up": "gauge",
    }
    text = body.decode()
    assert "gpu_asgi_admitted_total{" in text and "gpu_asgi_rejected_total{" in text  # counters end in _total
    assert "# HELP gpu_asgi_reserved_bytes Bytes reserved" in text


def test_openmetrics_negotiation_and_probe_down() -> None:
    sampler = DeviceSampler(OneGPU())  # never sampled: the probe is not up
    metrics = GPUMetrics(sampler=sampler, registry=CollectorRegistry(), multiprocess=False)
    body, content_type = metrics.render("application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text") and body.endswith(b"# EOF\n")
    assert value(samples(metrics.render()[0].decode()), "gpu_asgi_device_probe_up") == 0


def test_no_prometheus_client_gives_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(RuntimeError, match=r"pip install 'gpu_asgi\[prometheus\]'"):
        GPUMetrics()


WORKER = textwrap.dedent(
    """
    import asyncio, json, sys
    from gpu_asgi import GPUMetrics, Ledger

    role = sys.argv[1]

    async def worker(reserve, admitted):
        ledger = Ledger(1000)
        metrics = GPUMetrics(ledger)  # PROMETHEUS_MULTIPROC_DIR is set: multiprocess mode by default
        assert metrics.multiprocess
        held = await ledger.reserve(reserve)
        for _ in range(admitted):
            metrics.record_decision("admitted", device="cuda:0", reason=None, wait_seconds=0.002)
        metrics.record_decision("timed_out", device=None, reason="queue-timeout", wait_seconds=0.5)
        metrics.ensure_refreshing()  # the refresh task copies the ledger into this worker's gauges at once,
        await asyncio.sleep(0)  # in its first step: one yield runs it, however busy the machine
        if role == "leaving":
            metrics.close()  # a clean shutdown takes this worker's live gauges away
        held.release()

    if role == "scrape":
        body, _ = GPUMetrics().render()
        print(json.dumps(body.decode()))
    else:
        asyncio.run(worker(int(sys.argv[2]), int(sys.argv[3])))
    """
)


def test_multiprocess_mode_aggregates_workers(tmp_path: Path) -> None:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}

    def run(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-c", WORKER, *args], env=env, check=False, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    run("staying", "300", "2")
    run("leaving", "200", "3")
    parsed = samples(json.loads(run("scrape")))
    assert value(parsed, "gpu_asgi_admitted_total", device="cuda:0") == 5  # counters add up across workers
    assert value(parsed, "gpu_asgi_rejected_total", reason="queue-timeout") == 2
    assert value(parsed, "gpu_asgi_queue_wait_seconds_count", outcome="admitted") == 5
    # livesum gauges: the worker that shut down cleanly is gone; the other one (its pid is not
    # alive either, but nobody marked it dead) still counts, as in any multiprocess setup
    assert value(parsed, "gpu_asgi_reserved_bytes", device="cuda:0") == 300
    assert value(parsed, "gpu_asgi_capacity_bytes", device="cuda:0") == 1000


def test_the_grafana_dashboard_queries_only_metrics_we_expose() -> None:
    import re

    dashboard = json.loads((ROOT / "docs" / "grafana-dashboard.json").read_text())
    sampler = DeviceSampler(OneGPU())
    sampler.sample()
    ledger = Ledger(10, tenants={"gold": TenantPolicy()})  # a configured tenant: the tenant gauges are there
    metrics = GPUMetrics(ledger, sampler=sampler, registry=CollectorRegistry(), multiprocess=False)
    for outcome, reason in (("admitted", None), ("rejected", "queue-full")):
        metrics.record_decision(outcome, device="cuda:0", reason=reason, wait_seconds=0.0, tenant="gold")
    metrics.record_clamp()
    metrics.record_peak("cuda:0", 10, 9)
    exposed = {name for name, _ in samples(metrics.render()[0].decode())}
    queried: set[str] = set()
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            queried.update(re.findall(r"gpu_asgi_[a-z_]+", target["expr"]))
    assert len(queried) >= 14
    assert queried <= exposed, queried - exposed
    variable = dashboard["templating"]["list"][1]["query"]["query"]
    assert re.findall(r"gpu_asgi_[a-z_]+", variable)[0] in exposed
