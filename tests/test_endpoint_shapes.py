"""Every endpoint shape FastAPI and Starlette users write is admitted, or refused by gpu_asgi itself.

Each shape comes as a tagged and an untagged route. A tagged one holds its estimate inside the
endpoint (read from the ledger there), gets gpu_asgi's 413 for a body whose estimate is larger than
the budget, and gives every byte back; an untagged one holds nothing and is never refused. Then
the order of admission and the app's own checks: a flood of keyless requests against a full budget
never queues, and behind ``routes=`` the app's own 401/404/405 answer at once.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Annotated, Any

import pytest
from fastapi import Depends, FastAPI, HTTPException, Security
from fastapi.security import APIKeyHeader
from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.endpoints import HTTPEndpoint
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from gpu_asgi import (
    DEFAULT_TENANT,
    Admission,
    GPUAdmissionMiddleware,
    Ledger,
    LinearEstimator,
    Reservation,
    RouteSpec,
    TenantKey,
    gpu_admission,
    gpu_bound,
    gpu_reservation,
)

from ._asgi import RawClient, Words, client, http_scope, wait_until
from ._backends import SpyLedger

BUDGET = 10_000
BYTES_PER_TOKEN = 10
#: "hello world" is 2 words: (2 + 8) tokens x 10 bytes.
SMALL = {"prompt": "hello world", "max_new_tokens": 8}
SMALL_BYTES = 100
#: (2 + 2000) tokens x 10 bytes: more than the whole budget.
HUGE = {"prompt": "hello world", "max_new_tokens": 2000}
KEY = "good-key"


class GenerateIn(BaseModel):
    prompt: str
    max_new_tokens: int = 16


def check_key(x_api_key: str | None = Security(APIKeyHeader(name="x-api-key", auto_error=False))) -> str:
    if x_api_key != KEY:
        raise HTTPException(401, "a valid x-api-key is required")
    return x_api_key


def tag(tagged: bool) -> Callable[[Any], Any]:
    return gpu_bound() if tagged else (lambda endpoint: endpoint)


def held(ledger: Ledger) -> int:
    return ledger.statistics().reserved_bytes


# -- the shapes: each builds an app with the endpoint at POST /gen --------------------------------


def fastapi_app(ledger: Ledger) -> FastAPI:
    app = FastAPI()
    app.add_middleware(GPUAdmissionMiddleware, ledger=ledger, estimator=LinearEstimator(bytes_per_token=BYTES_PER_TOKEN),
                       token_counter=Words())
    return app


def starlette_app(ledger: Ledger, endpoint: Any) -> Starlette:
    app = Starlette(routes=[Route("/gen", endpoint, methods=["POST"])])
    app.add_middleware(GPUAdmissionMiddleware, ledger=ledger, estimator=LinearEstimator(bytes_per_token=BYTES_PER_TOKEN),
                       token_counter=Words())
    return app


def body_parameter(ledger: Ledger, tagged: bool, sync: bool) -> Any:
    app = fastapi_app(ledger)
    if sync:
        @app.post("/gen")
        @tag(tagged)
        def gen_sync(body: GenerateIn) -> dict[str, Any]:
            return {"held": held(ledger), "prompt": body.prompt}
    else:
        @app.post("/gen")
        @tag(tagged)
        async def gen(body: GenerateIn) -> dict[str, Any]:
            return {"held": held(ledger), "prompt": body.prompt}
    return app


def request_only(ledger: Ledger, tagged: bool, sync: bool) -> Any:
    app = fastapi_app(ledger)

    @app.post("/gen")
    @tag(tagged)
    async def gen(request: Request) -> dict[str, Any]:
        data = await request.json()
        return {"held": held(ledger), "prompt": data["prompt"]}
    return app


def depends(dependency: Any, with_body: bool) -> Callable[[Ledger, bool, bool], Any]:
    """``Depends(gpu_admission)``/``Depends(gpu_reservation)`` (untagged: the same endpoint without it)."""

    def build(ledger: Ledger, tagged: bool, sync: bool) -> Any:
        app = fastapi_app(ledger)
        # The untagged twin declares no gpu dependency: it has nothing to admit.
        gpu: Any = Depends(dependency) if tagged else Depends(lambda: None)

        def report(got: Admission | Reservation | None, prompt: str | None) -> dict[str, Any]:
            if got is not None:
                reservation = got.reservation if isinstance(got, Admission) else got
                assert reservation.nbytes == held(ledger)
            return {"held": held(ledger), "prompt": prompt}

        if with_body and sync:
            @app.post("/gen")
            @tag(tagged)
            def a(body: GenerateIn, got: Any = gpu) -> dict[str, Any]:
                return report(got, body.prompt)
        elif with_body:
            @app.post("/gen")
            @tag(tagged)
            async def b(body: GenerateIn, got: Any = gpu) -> dict[str, Any]:
                return report(got, body.prompt)
        elif sync:
            @app.post("/gen")
            @tag(tagged)
            def c(request: Request, got: Any = gpu) -> dict[str, Any]:
                return report(got, None)  # a def endpoint cannot await the body: the dependency read it
        else:
            @app.post("/gen")
            @tag(tagged)
            async def d(request: Request, got: Any = gpu) -> dict[str, Any]:
                return report(got, (await request.json())["prompt"])
        return app

    return build


def security_auth(ledger: Ledger, tagged: bool, sync: bool) -> Any:
    """``Security(APIKeyHeader)`` declared before ``Depends(gpu_reservation)``."""
    app = fastapi_app(ledger)
    gpu: Any = Depends(gpu_reservation) if tagged else Depends(lambda: None)

    @app.post("/gen")
    @tag(tagged)
    async def gen(body: GenerateIn, key: Annotated[str, Depends(check_key)], reservation: Any = gpu) -> dict[str, Any]:
        return {"held": held(ledger), "prompt": body.prompt}
    return app


def depends_auth(ledger: Ledger, tagged: bool, sync: bool) -> Any:
    """A ``Depends`` auth check and a body parameter, no gpu dependency: admitted at the body read."""
    app = fastapi_app(ledger)

    def require_key(request: Request) -> None:
        if request.headers.get("x-api-key") != KEY:
            raise HTTPException(401)

    if sync:
        @app.post("/gen", dependencies=[Depends(require_key)])
        @tag(tagged)
        def gen_sync(body: GenerateIn) -> dict[str, Any]:
            return {"held": held(ledger), "prompt": body.prompt}
    else:
        @app.post("/gen", dependencies=[Depends(require_key)])
        @tag(tagged)
        async def gen(body: GenerateIn) -> dict[str, Any]:
            return {"held": held(ledger), "prompt": body.prompt}
    return app


def class_endpoint(ledger: Ledger, tagged: bool, sync: bool) -> Any:
    class Gen(HTTPEndpoint):
        @tag(tagged)
        async def post(self, request: Request) -> JSONResponse:
            data = await request.json()
            return JSONResponse({"held": held(ledger), "prompt": data["prompt"]})
    return starlette_app(ledger, Gen)


def starlette_function(ledger: Ledger, tagged: bool, sync: bool) -> Any:
    @tag(tagged)
    async def gen(request: Request) -> JSONResponse:
        data = await request.json()
        return JSONResponse({"held": held(ledger), "prompt": data["prompt"]})
    return starlette_app(ledger, gen)


SHAPES: dict[str, Callable[[Ledger, bool, bool], Any]] = {
    "body parameter": body_parameter,
    "request.json() only": request_only,
    "Depends(gpu_admission) with a body parameter": depends(gpu_admission, True),
    "Depends(gpu_admission) without a body parameter": depends(gpu_admission, False),
    "Depends(gpu_reservation) with a body parameter": depends(gpu_reservation, True),
    "Depends(gpu_reservation) without a body parameter": depends(gpu_reservation, False),
    "Security(APIKeyHeader) then Depends(gpu_reservation)": security_auth,
    "Depends auth, body parameter": depends_auth,
    "HTTPEndpoint class": class_endpoint,
    "Starlette endpoint": starlette_function,
}
#: Shapes that can be written as a sync ``def`` endpoint (the others await the body themselves).
SYNC = {"body parameter", "Depends(gpu_admission) with a body parameter", "Depends(gpu_admission) without a body parameter",
        "Depends(gpu_reservation) with a body parameter", "Depends(gpu_reservation) without a body parameter",
        "Depends auth, body parameter"}
CASES = [(shape, sync) for shape in SHAPES for sync in (False, True) if not sync or shape in SYNC]


@pytest.mark.parametrize(("shape", "sync"), CASES, ids=[f"{s}-{'def' if sync else 'async'}" for s, sync in CASES])
async def test_a_tagged_endpoint_holds_its_bytes_is_refused_by_gpu_asgi_and_gives_them_back(shape: str, sync: bool) -> None:
    ledger = Ledger(BUDGET)
    app = SHAPES[shape](ledger, True, sync)
    async with client(app) as http:
        served = await http.post("/gen", json=SMALL, headers={"x-api-key": KEY})
        refused = await http.post("/gen", json=HUGE, headers={"x-api-key": KEY})
    assert served.status_code == 200, served.text
    assert served.json()["held"] == SMALL_BYTES  # held inside the endpoint
    assert served.json()["prompt"] in ("hello world", None)
    assert refused.status_code == 413, refused.text
    assert refused.headers["content-type"] == "application/problem+json"
    assert refused.headers["x-gpu-admission-reason"] == "exceeds-budget"
    assert held(ledger) == 0 and ledger.statistics().admitted_total == 1


@pytest.mark.parametrize(("shape", "sync"), CASES, ids=[f"{s}-{'def' if sync else 'async'}" for s, sync in CASES])
async def test_an_untagged_endpoint_of_the_same_shape_is_left_alone(shape: str, sync: bool) -> None:
    ledger = Ledger(BUDGET)
    app = SHAPES[shape](ledger, False, sync)
    async with client(app) as http:
        served = await http.post("/gen", json=SMALL, headers={"x-api-key": KEY})
        large = await http.post("/gen", json=HUGE, headers={"x-api-key": KEY})
    assert served.status_code == 200 and served.json()["held"] == 0, served.text
    assert large.status_code == 200, large.text  # not ours to refuse
    assert held(ledger) == 0 and ledger.statistics().admitted_total == 0


async def test_a_refusal_in_the_dependency_is_gpu_asgis_answer_with_retry_after() -> None:
    """Queue full while the dependency admits: 503 problem+json with Retry-After, not a 500."""
    ledger = Ledger(BUDGET, max_queue=0)
    hold = ledger.try_reserve(BUDGET)
    app = depends(gpu_reservation, False)(ledger, True, False)
    async with client(app) as http:
        response = await http.post("/gen", json=SMALL)
    assert response.status_code == 503, response.text
    assert response.headers["content-type"] == "application/problem+json" and int(response.headers["retry-after"]) >= 1
    assert hold is not None
    hold.release()
    assert held(ledger) == 0


async def test_with_the_dependency_the_body_read_still_gets_gpu_asgis_limits_and_nothing_is_reserved() -> None:
    """Admission waits for the dependency, but FastAPI's body read is still checked as it arrives:
    the size limit (the app never buffers more) and the JSON, which FastAPI checks before any
    dependency too. gpu_asgi answers those, and nothing is asked of the ledger."""
    ledger = SpyLedger(BUDGET)
    app = FastAPI()
    app.add_middleware(GPUAdmissionMiddleware, ledger=ledger, estimator=LinearEstimator(bytes_per_token=BYTES_PER_TOKEN),
                       token_counter=Words(), max_body_bytes=100)

    @app.post("/gen")
    @gpu_bound()
    async def gen(body: GenerateIn, key: Annotated[str, Depends(check_key)],
                  reservation: Annotated[Reservation, Depends(gpu_reservation)]) -> dict[str, int]:
        return {"held": reservation.nbytes}

    async with client(app) as http:
        bad_json = await http.post("/gen", content=b"{not json", headers={"content-type": "application/json"})
        too_large = await http.post("/gen", json={"prompt": "a " * 100}, headers={"x-api-key": KEY})
        no_key = await http.post("/gen", json=SMALL)
    assert bad_json.status_code == 400 and bad_json.headers["x-gpu-admission-reason"] == "invalid-json"
    assert too_large.status_code == 413 and too_large.headers["x-gpu-admission-reason"] == "body-too-large"
    assert no_key.status_code == 401
    assert ledger.asked == []




async def test_a_flood_of_keyless_requests_never_queues_for_gpu_bytes() -> None:
    """500 keyless requests against a full budget and max_queue=64 while keyed clients keep
    sending: every keyless one gets 401 without entering the queue (no byte is ever asked for a
    request without a key: tenants are API-key hashes, so a keyless one would be "default"); the
    keyed ones are served or refused for load as before."""
    ledger = SpyLedger(BUDGET, max_queue=64, max_wait=2.0)
    app = FastAPI()
    app.add_middleware(GPUAdmissionMiddleware, ledger=ledger, estimator=LinearEstimator(bytes_per_token=BYTES_PER_TOKEN),
                       token_counter=Words(), tenant_key=TenantKey.api_key())

    @app.post("/gen")
    @gpu_bound()
    async def gen(body: GenerateIn, key: Annotated[str, Depends(check_key)],
                  reservation: Annotated[Reservation, Depends(gpu_reservation)]) -> dict[str, int]:
        await asyncio.sleep(0.01)
        return {"held": reservation.nbytes}

    hold = ledger.try_reserve(BUDGET, tenant="someone else")  # the budget is full
    ledger.asked.clear()
    keyless: list[int] = []
    keyed: list[int] = []
    waiting_peak = 0

    async with client(app) as http:
        async def flood(index: int) -> None:
            headers = {"x-api-key": "wrong"} if index % 2 else {}
            keyless.append((await http.post("/gen", json=SMALL, headers=headers)).status_code)

        async def keyed_client() -> None:
            for _ in range(8):
                keyed.append((await http.post("/gen", json=SMALL, headers={"x-api-key": KEY})).status_code)

        async def watch() -> None:
            nonlocal waiting_peak
            while len(keyless) < 500:
                waiting_peak = max(waiting_peak, ledger.statistics().waiting)
                await asyncio.sleep(0.005)

        async def free_later() -> None:
            await asyncio.sleep(0.3)
            assert hold is not None
            hold.release()

        await asyncio.wait_for(asyncio.gather(
            *(flood(i) for i in range(500)), *(keyed_client() for _ in range(4)), watch(), free_later()
        ), 60)

    assert keyless == [401] * 500
    assert set(keyed) <= {200, 503} and keyed.count(200) >= 1, keyed
    assert ledger.asked and DEFAULT_TENANT not in ledger.asked  # only keyed requests ever asked for bytes
    assert waiting_peak <= 4  # at most the keyed clients queued
    assert held(ledger) == 0


def routes_app(ledger: Ledger, reads: list[str]) -> GPUAdmissionMiddleware:
    """An app gpu_asgi cannot see into (as vLLM's server is to it), named by ``routes=``: it checks
    the API key, serves POST /v1/completions, has no /v1/embeddings, and answers 405 to PUT."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        headers = dict(scope["headers"])
        if headers.get(b"x-api-key") != KEY.encode():
            status = 401
        elif scope["path"] != "/v1/completions":
            status = 404
        elif scope["method"] != "POST":
            status = 405
        else:
            reads.append((await receive())["body"].decode())
            status = 200
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": str(held(ledger)).encode()})

    spec = RouteSpec(methods={"POST", "PUT"})
    return GPUAdmissionMiddleware(app, ledger=ledger, estimator=LinearEstimator(bytes_per_token=BYTES_PER_TOKEN),
                                  token_counter=Words(), routes={"/v1/completions": spec, "/v1/embeddings": spec})


async def test_behind_routes_the_apps_own_refusals_answer_at_once_with_the_budget_full() -> None:
    ledger = SpyLedger(BUDGET, max_wait=5.0)
    reads: list[str] = []
    app = routes_app(ledger, reads)
    hold = ledger.try_reserve(BUDGET)
    assert hold is not None
    ledger.asked.clear()
    async with client(app) as http:
        started = time.monotonic()
        wrong_key = await http.post("/v1/completions", json=SMALL, headers={"x-api-key": "wrong"})
        not_found = await http.post("/v1/embeddings", json=SMALL, headers={"x-api-key": KEY})
        not_allowed = await http.put("/v1/completions", json=SMALL, headers={"x-api-key": KEY})
        elapsed = time.monotonic() - started
        assert [wrong_key.status_code, not_found.status_code, not_allowed.status_code] == [401, 404, 405]
        assert elapsed < 2.0 and ledger.asked == [] and reads == []  # none queued, none read
        queued = asyncio.ensure_future(http.post("/v1/completions", json=SMALL, headers={"x-api-key": KEY}))
        await asyncio.sleep(0.1)
        assert not queued.done() and ledger.statistics().waiting == 1  # the good one waits for bytes
        hold.release()
        served = await queued
    assert served.status_code == 200 and served.text == str(SMALL_BYTES) and len(reads) == 1
    assert held(ledger) == 0


async def test_behind_routes_a_body_too_large_for_the_budget_is_refused_at_the_first_read() -> None:
    ledger = Ledger(BUDGET)
    reads: list[str] = []
    async with client(routes_app(ledger, reads)) as http:
        refused = await http.post("/v1/completions", json=HUGE, headers={"x-api-key": KEY})
    assert refused.status_code == 413 and refused.headers["x-gpu-admission-reason"] == "exceeds-budget"
    assert reads == [] and held(ledger) == 0


async def test_an_overridden_gpu_dependency_leaves_admission_at_the_body_read() -> None:
    """``app.dependency_overrides[gpu_reservation] = fake`` (as tests of an app do): the endpoint
    with a body parameter is still admitted, at FastAPI's body read."""
    ledger = Ledger(BUDGET)
    app = depends(gpu_reservation, True)(ledger, True, False)
    app.dependency_overrides[gpu_reservation] = lambda: None
    async with client(app) as http:
        served = await http.post("/gen", json=SMALL)
    assert served.status_code == 200 and served.json()["held"] == SMALL_BYTES, served.text
    assert held(ledger) == 0


async def test_a_client_that_leaves_while_its_dependency_queues_is_never_admitted() -> None:
    ledger = Ledger(BUDGET)
    hold = ledger.try_reserve(BUDGET)
    called: list[bool] = []
    app = fastapi_app(ledger)

    @app.post("/gen")
    @gpu_bound()
    async def gen(request: Request, reservation: Annotated[Reservation, Depends(gpu_reservation)]) -> dict[str, int]:
        called.append(True)
        return {"held": reservation.nbytes}

    raw = RawClient(app, http_scope("/gen"), [json.dumps(SMALL).encode()]).start()
    await wait_until(lambda: ledger.statistics().waiting == 1)
    raw.disconnect()
    await raw.finish()
    assert raw.status == 499 and not called
    assert ledger.statistics().waiting == 0
    assert hold is not None
    hold.release()
    assert held(ledger) == 0 and ledger.statistics().admitted_total == 1  # only the holder


async def test_a_stream_admitted_by_its_dependency_holds_the_bytes_to_the_last_chunk() -> None:
    ledger = Ledger(BUDGET)
    app = fastapi_app(ledger)
    seen: list[int] = []

    @app.post("/gen")
    @gpu_bound()
    async def gen(request: Request, reservation: Annotated[Reservation, Depends(gpu_reservation)]) -> StreamingResponse:
        prompt = (await request.json())["prompt"]

        async def chunks() -> Any:
            for word in prompt.split():
                seen.append(held(ledger))
                yield word.encode()

        return StreamingResponse(chunks())

    raw = RawClient(app, http_scope("/gen"), [json.dumps(SMALL).encode()]).start()
    await raw.finish()
    assert raw.status == 200 and raw.body == b"helloworld"
    assert seen == [SMALL_BYTES, SMALL_BYTES] and held(ledger) == 0
