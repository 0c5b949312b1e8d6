"""Tenant keys in the middleware: where a request's tenant is read, what reaches the ledger, and
the bounded tenant label on metrics and spans."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import random
import string
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from gpu_asgi import (
    DEFAULT_TENANT,
    DeviceGuard,
    DeviceReading,
    DeviceSampler,
    DeviceStatistics,
    GPUAdmissionMiddleware,
    GPUMetrics,
    Ledger,
    LedgerStatistics,
    LinearEstimator,
    Reservation,
    TenantKey,
    TenantPolicy,
    TenantStatistics,
    api_key_tenant,
    gpu_bound,
)
from gpu_asgi._observe import tracing as otel

from ._asgi import RawClient, Words, client, http_scope, wait_until
from ._backends import Clock


@gpu_bound()
async def whose(request: Request) -> JSONResponse:
    await request.body()  # admission happens at this first read
    admission = request.state.gpu_admission
    return JSONResponse({"tenant": admission.tenant, "reserved_for": admission.reservation.tenant})


def make_app(ledger: Ledger, *, endpoint: Any = whose, **options: Any) -> Starlette:
    app = Starlette(routes=[Route("/generate", endpoint, methods=["POST"])])
    app.add_middleware(
        GPUAdmissionMiddleware, ledger=ledger, estimator=LinearEstimator(bytes_per_token=1), token_counter=Words(), **options
    )
    return app


async def tenant_of(app: Starlette, body: dict[str, Any] | None = None, headers: Mapping[str, str] | None = None) -> str:
    async with client(app) as http:
        response = await http.post("/generate", json=body or {"prompt": "a b"}, headers=dict(headers or {}))
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["tenant"] == data["reserved_for"]
    return str(data["tenant"])


# -- where the tenant is read ---------------------------------------------------------------------


async def test_the_tenant_from_a_header() -> None:
    app = make_app(Ledger(1000), tenant_key=TenantKey.header("X-Tenant-ID"))  # header names are case-insensitive
    assert await tenant_of(app, headers={"x-tenant-id": "acme"}) == "acme"
    assert await tenant_of(app) == DEFAULT_TENANT
    assert await tenant_of(app, headers={"x-tenant-id": ""}) == DEFAULT_TENANT  # empty names nobody


async def test_the_tenant_from_the_openai_user_field() -> None:
    app = make_app(Ledger(1000), tenant_key=TenantKey.body_field("user"))
    assert await tenant_of(app, {"prompt": "a b", "user": "user-42"}) == "user-42"
    assert await tenant_of(app, {"prompt": "a b", "user": None}) == DEFAULT_TENANT
    assert await tenant_of(app, {"prompt": "a b"}) == DEFAULT_TENANT


async def test_the_tenant_from_an_api_key_is_a_hash_never_the_key() -> None:
    app = make_app(Ledger(1000), tenant_key=TenantKey.api_key())
    key = "sk-live-0123456789abcdef"
    expected = "key-" + hashlib.sha256(key.encode()).hexdigest()[:16]
    assert api_key_tenant(key) == expected
    assert await tenant_of(app, headers={"authorization": f"Bearer {key}"}) == expected
    assert await tenant_of(app, headers={"x-api-key": key}) == expected
    assert await tenant_of(app, headers={"authorization": "Basic dXNlcjpwdw=="}) == DEFAULT_TENANT  # not a bearer key
    assert await tenant_of(app) == DEFAULT_TENANT

    salted = make_app(Ledger(1000), tenant_key=TenantKey.api_key(secret=b"pepper"))
    tenant = await tenant_of(salted, headers={"authorization": f"Bearer {key}"})
    assert tenant == "key-" + hmac.new(b"pepper", key.encode(), hashlib.sha256).hexdigest()[:16]
    assert tenant != expected and key not in tenant
    assert "pepper" not in repr(TenantKey.api_key(secret=b"pepper"))


async def test_the_tenant_from_a_callable_gets_the_scope_and_the_parsed_body() -> None:
    seen: list[tuple[str, Any]] = []

    def org(scope: Mapping[str, Any], body: Mapping[str, Any]) -> str | None:
        seen.append((scope["path"], body.get("metadata")))
        metadata = body.get("metadata") or {}
        return metadata.get("org")  # type: ignore[no-any-return]

    app = make_app(Ledger(1000), tenant_key=TenantKey.from_callable(org))
    assert await tenant_of(app, {"prompt": "a", "metadata": {"org": "umbrella"}}) == "umbrella"
    assert await tenant_of(app, {"prompt": "a"}) == DEFAULT_TENANT
    assert seen == [("/generate", {"org": "umbrella"}), ("/generate", None)]


async def test_keys_are_tried_in_order_and_a_route_can_choose_its_own() -> None:
    keys = [TenantKey.header("x-tenant-id"), TenantKey.body_field("user")]
    app = make_app(Ledger(1000), tenant_key=keys)
    assert await tenant_of(app, {"prompt": "a", "user": "u"}, {"x-tenant-id": "h"}) == "h"
    assert await tenant_of(app, {"prompt": "a", "user": "u"}) == "u"

    @gpu_bound(tenant_key=TenantKey.body_field("team"))
    async def by_team(request: Request) -> JSONResponse:
        return await whose(request)  # type: ignore[no-any-return]

    routed = make_app(Ledger(1000), endpoint=by_team, tenant_key=TenantKey.header("x-tenant-id"))
    assert await tenant_of(routed, {"prompt": "a", "team": "blue"}, {"x-tenant-id": "h"}) == "blue"


@pytest.mark.parametrize(
    ("key", "body", "headers", "names"),
    [
        (TenantKey.header("x-tenant-id"), {}, {"x-tenant-id": "a" * 129}, {"header": "x-tenant-id"}),
        (TenantKey.header("x-tenant-id"), {}, {"x-tenant-id": "acme\x7f"}, {"header": "x-tenant-id"}),
        (TenantKey.body_field("user"), {"user": "bad\nuser"}, {}, {"field": "user"}),
        (TenantKey.body_field("user"), {"user": 42}, {}, {"field": "user"}),
        (TenantKey.body_field("user"), {"user": "x" * 500}, {}, {"field": "user"}),
    ],
)
async def test_an_invalid_tenant_is_a_400_naming_where_it_came_from(
    key: TenantKey, body: dict[str, Any], headers: dict[str, str], names: dict[str, str]
) -> None:
    ledger = Ledger(1000)
    async with client(make_app(ledger, tenant_key=key)) as http:
        response = await http.post("/generate", json={"prompt": "a", **body}, headers=headers)
    assert response.status_code == 400
    assert response.headers["content-type"] == "application/problem+json"
    problem = response.json()
    assert problem["type"] == "urn:gpu-asgi:problem:invalid-tenant"
    assert {name: problem[name] for name in names} == names
    assert next(iter(names.values())) in problem["detail"]
    assert ledger.statistics().admitted_total == 0


async def tenant_sent_as(app: Starlette, headers: list[tuple[bytes, bytes]], body: dict[str, Any] | None = None) -> Any:
    """The response to a request with these raw header bytes: the tenant, or the problem."""
    async with client(app) as http:
        response = await http.post("/generate", json=body or {"prompt": "a b"}, headers=headers)
    return response.status_code, response.json()


@pytest.mark.parametrize("name", ["é-accent", "日本語", "😀emoji", "ā", "voilà"])
async def test_a_non_ascii_tenant_in_a_header_is_read_as_utf8_as_in_the_body(name: str) -> None:
    """A header's bytes are UTF-8, as clients send them: they used to be read as latin-1, so
    "é-accent" became "Ã©-accent" and "日本語" a 400 for the C1 controls its bytes decode to."""
    app = make_app(Ledger(1000), tenant_key=[TenantKey.header("x-tenant-id"), TenantKey.body_field("user")])
    status, data = await tenant_sent_as(app, [(b"x-tenant-id", name.encode("utf-8"))])
    assert (status, data["tenant"]) == (200, name)
    assert await tenant_of(app, {"prompt": "a b", "user": name}) == name  # the same tenant as the body's


@pytest.mark.parametrize(
    ("header", "value"),
    [
        (b"x-tenant-id", b"caf\xe9"),  # latin-1, not UTF-8
        (b"x-tenant-id", b"\xff\xfe"),
        (b"authorization", b"Bearer sk-\xe9t\xe9"),
        (b"x-api-key", b"sk-\xc3"),  # a truncated sequence
    ],
)
async def test_a_tenant_or_api_key_that_is_not_utf8_is_a_400_saying_so(header: bytes, value: bytes) -> None:
    ledger = Ledger(1000)
    app = make_app(ledger, tenant_key=[TenantKey.header("x-tenant-id"), TenantKey.api_key()])
    status, problem = await tenant_sent_as(app, [(header, value)])
    assert status == 400 and problem["type"] == "urn:gpu-asgi:problem:invalid-tenant"
    assert problem["header"] == header.decode() and "not valid UTF-8" in problem["detail"]
    assert ledger.statistics().admitted_total == 0


async def test_a_basic_authorization_that_is_not_utf8_is_no_api_key() -> None:
    """Only a bearer token is an API key: other schemes are not read, whatever their bytes."""
    app = make_app(Ledger(1000), tenant_key=TenantKey.api_key())
    assert await tenant_sent_as(app, [(b"authorization", b"Basic \xff\xfe")]) == (200, {"tenant": DEFAULT_TENANT, "reserved_for": DEFAULT_TENANT})


@pytest.mark.parametrize("key", ["sk-ключ", "sk-voilà", "sk-日本"])
@pytest.mark.parametrize("secret", [None, b"pepper"])
async def test_a_non_ascii_api_key_maps_to_the_tenant_api_key_tenant_computes(key: str, secret: bytes | None) -> None:
    """The hash is of the key's bytes as sent (UTF-8), so ``api_key_tenant(key)``, which a
    configuration names tenants with, is what a request with that key gets. Read as latin-1,
    "ключ" was a 400 (its bytes decode to C1 controls) and "voilà" lost its last byte (0xa0,
    latin-1's no-break space, stripped as whitespace)."""
    raw = key.encode("utf-8")
    digest = hmac.new(secret, raw, hashlib.sha256) if secret is not None else hashlib.sha256(raw)
    expected = "key-" + digest.hexdigest()[:16]
    assert api_key_tenant(key, secret=secret) == expected
    app = make_app(Ledger(1000), tenant_key=TenantKey.api_key(secret=secret))
    for headers in ([(b"authorization", b"Bearer " + raw)], [(b"x-api-key", raw)], [(b"x-api-key", b" " + raw + b"\t")]):
        status, data = await tenant_sent_as(app, headers)
        assert (status, data["tenant"]) == (200, expected)


def test_a_tenant_key_is_checked_when_it_is_declared() -> None:
    with pytest.raises(TypeError, match="TenantKey"):
        GPUAdmissionMiddleware(whose, ledger=Ledger(10), estimator=LinearEstimator(1), tenant_key=["x-tenant-id"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="TenantKey"):
        gpu_bound(tenant_key="x-tenant-id")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="name"):
        TenantKey.header("")


# -- what reaches the ledger ---------------------------------------------------------------------


class RecordingLedger(Ledger):
    """A real ledger that writes down the tenant of every call the middleware makes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[str, str]] = []

    def try_reserve(self, nbytes: int, *, devices: Sequence[str] | None = None, tenant: str = DEFAULT_TENANT) -> Reservation | None:
        self.calls.append(("try_reserve", tenant))
        return super().try_reserve(nbytes, devices=devices, tenant=tenant)

    async def reserve(self, nbytes: int, *, tenant: str = DEFAULT_TENANT, **options: Any) -> Reservation:
        self.calls.append(("reserve", tenant))
        return await super().reserve(nbytes, tenant=tenant, **options)

    def retry_after(self, nbytes: int = 0, *, priority: int = 0, tenant: str = DEFAULT_TENANT) -> float:
        self.calls.append(("retry_after", tenant))
        return super().retry_after(nbytes, priority=priority, tenant=tenant)


def test_no_tenant_may_be_named_other() -> None:
    """``other`` is the label of every unnamed tenant: a tenant of that name would mix its series with theirs."""
    with pytest.raises(ValueError, match="'other'"):
        GPUAdmissionMiddleware(whose, ledger=Ledger(10, tenants={"other": TenantPolicy()}), estimator=LinearEstimator(1))
    with pytest.raises(ValueError, match="'other'"):
        GPUMetrics(Ledger(10), registry=CollectorRegistry(), multiprocess=False, tenant_labels=["acme", "other"])


async def test_the_tenant_reaches_the_ledger_at_once_and_in_the_queue() -> None:
    ledger = RecordingLedger(1000)
    app = make_app(ledger, tenant_key=TenantKey.header("x-tenant-id"))
    assert await tenant_of(app, headers={"x-tenant-id": "acme"}) == "acme"
    assert ledger.calls == [("try_reserve", "acme")]

    ledger.calls.clear()
    held = ledger.try_reserve(1000)
    assert held is not None
    scope = http_scope(headers=[(b"content-type", b"application/json"), (b"x-tenant-id", b"umbrella")])
    queued = RawClient(app, scope, [b'{"prompt": "a b"}']).start()
    await wait_until(lambda: ledger.statistics().waiting == 1)
    held.release()
    await queued.finish()
    assert queued.status == 200 and queued.json()["tenant"] == "umbrella"
    assert ("try_reserve", "umbrella") in ledger.calls and ("reserve", "umbrella") in ledger.calls


class FullGPU:
    """A probe reading a device with no free memory: the device guard refuses."""

    name = "test"

    def read(self) -> tuple[DeviceReading, ...]:
        return (DeviceReading("cuda:0", 1 << 30, 1 << 30, 0, None, None),)

    def close(self) -> None:
        pass


async def test_a_guard_refusal_asks_retry_after_for_the_tenant() -> None:
    ledger = RecordingLedger(1000)
    sampler = DeviceSampler(FullGPU())
    sampler.sample()
    app = make_app(ledger, tenant_key=TenantKey.header("x-tenant-id"), sampler=sampler, device_guard=DeviceGuard())
    async with client(app) as http:
        response = await http.post("/generate", json={"prompt": "a"}, headers={"x-tenant-id": "acme"})
    assert response.status_code == 503 and "retry-after" in response.headers
    assert response.headers["x-gpu-admission-reason"] == "device-memory-low"
    assert ledger.calls == [("retry_after", "acme")]


# -- bounded labels: metrics and spans --------------------------------------------------------------


def scrape(metrics: GPUMetrics) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    body, _ = metrics.render()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(body.decode())
        for sample in family.samples
    }


async def test_random_tenant_keys_are_counted_as_other() -> None:
    ledger = Ledger(1000, tenants={"gold": TenantPolicy(weight=2.0)})
    metrics = GPUMetrics(ledger, registry=CollectorRegistry(), multiprocess=False)
    app = make_app(ledger, tenant_key=TenantKey.header("x-tenant-id"), metrics=metrics)
    rng = random.Random(11)
    async with client(app) as http:
        for _ in range(25):
            name = "".join(rng.choices(string.ascii_letters, k=12))
            assert (await http.post("/generate", json={"prompt": "a"}, headers={"x-tenant-id": name})).status_code == 200
        assert (await http.post("/generate", json={"prompt": "a"}, headers={"x-tenant-id": "gold"})).status_code == 200
        assert (await http.post("/generate", json={"prompt": "a"})).status_code == 200
    parsed = scrape(metrics)
    tenants = {dict(labels).get("tenant") for name, labels in parsed if name.startswith("gpu_asgi_tenant_")}
    assert tenants == {"gold", "other", "default"}
    admitted = {dict(labels)["tenant"]: v for (name, labels), v in parsed.items() if name == "gpu_asgi_tenant_admitted_total"}
    assert admitted == {"other": 25, "gold": 1, "default": 1}
    waits = parsed[("gpu_asgi_tenant_queue_wait_seconds_count", frozenset({("tenant", "other"), ("outcome", "admitted")}))]
    assert waits == 25
    assert parsed[("gpu_asgi_admitted_total", frozenset({("device", "cuda:0")}))] == 27  # the old series is unchanged


async def test_refusals_are_counted_per_tenant_and_an_explicit_label_set_wins() -> None:
    ledger = Ledger(1000, max_queue=0, tenants={"gold": TenantPolicy()})
    metrics = GPUMetrics(ledger, registry=CollectorRegistry(), multiprocess=False)
    app = make_app(ledger, tenant_key=TenantKey.header("x-tenant-id"), metrics=metrics, tenant_labels=["silver"])
    held = ledger.try_reserve(1000)
    async with client(app) as http:
        for name in ("silver", "gold"):
            assert (await http.post("/generate", json={"prompt": "a"}, headers={"x-tenant-id": name})).status_code == 503
    parsed = scrape(metrics)
    assert parsed[("gpu_asgi_tenant_rejected_total", frozenset({("tenant", "silver"), ("reason", "queue-full")}))] == 1
    assert parsed[("gpu_asgi_tenant_rejected_total", frozenset({("tenant", "other"), ("reason", "queue-full")}))] == 1
    assert held is not None


async def test_without_a_tenant_key_nothing_is_recorded_per_tenant() -> None:
    ledger = Ledger(1000, tenants={"gold": TenantPolicy()})
    metrics = GPUMetrics(ledger, registry=CollectorRegistry(), multiprocess=False)
    async with client(make_app(ledger, metrics=metrics)) as http:
        assert (await http.post("/generate", json={"prompt": "a"}, headers={"x-tenant-id": "gold"})).status_code == 200
    parsed = scrape(metrics)
    assert not [key for key in parsed if key[0].startswith(("gpu_asgi_tenant_admitted", "gpu_asgi_tenant_queue_wait"))]
    assert parsed[("gpu_asgi_admitted_total", frozenset({("device", "cuda:0")}))] == 1


class FixedStatistics:
    """A ledger whose snapshot is given: the gauges' arithmetic, independent of the fair-share rule."""

    def __init__(self, tenants: tuple[TenantStatistics, ...]) -> None:
        self.tenants = {"gold": TenantPolicy(weight=3.0)}
        self._tenants = tenants

    def statistics(self) -> LedgerStatistics:
        return LedgerStatistics((DeviceStatistics("cuda:0", 1000, 800, 4),), 3, 300, 10, tenants=self._tenants)


def test_the_fair_share_gauges_bound_their_labels_and_compare_shares_with_weights() -> None:
    stats = (
        TenantStatistics("gold", 3.0, None, 400, 2, 1, 100, 900.0),
        TenantStatistics("a1", 1.0, None, 300, 1, 1, 100, 500.0),
        TenantStatistics("b2", 1.0, None, 100, 1, 0, 0, 100.0),
        TenantStatistics("idle", 1.0, None, 0, 0, 0, 0, 50.0),  # neither holds nor waits: no part of the shares
        TenantStatistics(DEFAULT_TENANT, 1.0, None, 0, 0, 1, 100, 0.0),
    )
    metrics = GPUMetrics(FixedStatistics(stats), registry=CollectorRegistry(), multiprocess=False)  # type: ignore[arg-type]
    parsed = scrape(metrics)

    def gauge(name: str, tenant: str) -> float:
        return parsed[(f"gpu_asgi_tenant_{name}", frozenset({("tenant", tenant)}))]

    assert {dict(labels)["tenant"] for name, labels in parsed if name.startswith("gpu_asgi_tenant_")} == {"gold", "other", "default"}
    assert (gauge("reserved_bytes", "gold"), gauge("reserved_bytes", "other")) == (400, 400)
    assert (gauge("waiting_requests", "other"), gauge("served_byte_seconds", "other")) == (1, 650.0)
    assert gauge("reserved_share_ratio", "gold") == pytest.approx(0.5)
    # active weights: gold 3, other 1 + 1 (idle is not active), default 1 -> 6
    assert gauge("weight_share_ratio", "gold") == pytest.approx(3 / 6)
    assert gauge("weight_share_ratio", "other") == pytest.approx(2 / 6)
    assert gauge("weight_share_ratio", "default") == pytest.approx(1 / 6)
    assert gauge("reserved_share_ratio", "default") == 0.0


def tracing() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


async def test_the_queue_wait_span_carries_the_bounded_tenant() -> None:
    provider, exporter = tracing()
    ledger = Ledger(1000, tenants={"gold": TenantPolicy()})
    app = make_app(ledger, tenant_key=TenantKey.header("x-tenant-id"), tracer_provider=provider)
    for name in ("gold", "someone-new"):
        assert await tenant_of(app, headers={"x-tenant-id": name}) == name
    spans = [span for span in exporter.get_finished_spans() if span.name == otel.QUEUE_WAIT_SPAN]
    assert [span.attributes[otel.ADMISSION_TENANT] for span in spans] == ["gold", "other"]  # type: ignore[index]

    exporter.clear()
    await tenant_of(make_app(ledger, tracer_provider=provider), headers={"x-tenant-id": "gold"})  # tenants off
    (span,) = [span for span in exporter.get_finished_spans() if span.name == otel.QUEUE_WAIT_SPAN]
    assert otel.ADMISSION_TENANT not in (span.attributes or {})


async def test_a_tenant_cancelled_in_the_queue_leaves_nothing_held() -> None:
    ledger = Ledger(1000)
    app = make_app(ledger, tenant_key=TenantKey.header("x-tenant-id"))
    held = ledger.try_reserve(1000)
    assert held is not None
    scope = http_scope(headers=[(b"content-type", b"application/json"), (b"x-tenant-id", b"acme")])
    raw = RawClient(app, scope, [b'{"prompt": "a b"}']).start()
    await wait_until(lambda: ledger.statistics().waiting == 1)
    raw.disconnect()
    await raw.finish()
    held.release()
    await asyncio.sleep(0)
    assert ledger.statistics().reserved_bytes == 0 and ledger.statistics().waiting == 0


async def test_the_gauges_read_the_ledgers_own_tenant_statistics() -> None:
    ledger = Ledger(1000, tenants={"gold": TenantPolicy(weight=2.0)})
    metrics = GPUMetrics(ledger, registry=CollectorRegistry(), multiprocess=False)
    held = [ledger.try_reserve(300, tenant="gold"), ledger.try_reserve(100, tenant="x1"), ledger.try_reserve(100, tenant="x2")]
    parsed = scrape(metrics)

    def gauge(name: str, tenant: str) -> float:
        return parsed[(f"gpu_asgi_tenant_{name}", frozenset({("tenant", tenant)}))]

    assert (gauge("reserved_bytes", "gold"), gauge("reserved_bytes", "other")) == (300, 200)
    assert gauge("reserved_share_ratio", "gold") == pytest.approx(0.6)
    assert gauge("weight_share_ratio", "gold") == pytest.approx(2 / 4)  # gold 2, x1 1, x2 1
    assert gauge("reserved_bytes", "default") == 0  # every label, always (see below)
    assert {dict(labels)["tenant"] for name, labels in parsed if name.startswith("gpu_asgi_tenant_")} == {"gold", "other", "default"}
    for reservation in held:
        assert reservation is not None
        reservation.release()
    # Nobody holds under "other" now: its gauges read 0 rather than vanish (a multiprocess gauge
    # that is no longer set keeps its last value).
    parsed = scrape(metrics)
    assert (gauge("reserved_bytes", "other"), gauge("reserved_share_ratio", "other"), gauge("reserved_bytes", "gold")) == (0, 0, 0)


async def test_idle_header_tenants_are_forgotten_when_nobody_waits() -> None:
    """Through the middleware, where an uncongested server admits with ``try_reserve``: 300
    distinct tenant keys, then an hour later one request. Only its tenant is remembered (the ttl
    is 5 s), as the Redis ledger's expiry would leave it."""
    clock = Clock()
    ledger = Ledger(1000, tenant_idle_ttl=5.0, clock=clock)
    app = make_app(ledger, tenant_key=TenantKey.header("x-tenant-id"))
    async with client(app) as http:
        for i in range(300):
            response = await http.post("/generate", json={"prompt": "a b"}, headers={"x-tenant-id": f"t{i}"})
            assert response.status_code == 200
        assert len(ledger._fair.accounts) == 300  # idle for less than the ttl: remembered
        clock.advance(3600)
        assert (await http.post("/generate", json={"prompt": "a b"}, headers={"x-tenant-id": "steady"})).status_code == 200
    assert set(ledger._fair.accounts) == {"steady"}


async def test_without_a_tenant_key_no_tenant_is_looked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpu_asgi._admission import gate as _admission
    def never(*args: Any) -> str:
        raise AssertionError("tenants are off: nothing should be read")

    monkeypatch.setattr(_admission, "find_tenant", never)
    ledger = RecordingLedger(1000, tenants={"gold": TenantPolicy()})
    assert await tenant_of(make_app(ledger), headers={"x-tenant-id": "gold"}) == DEFAULT_TENANT
    assert ledger.calls == [("try_reserve", DEFAULT_TENANT)]
