"""The app's own checks come before admission in every endpoint shape, with no gpu_asgi dependency.

Each shape checks an API key the way its framework does it (a FastAPI dependency, a router's
``dependencies=``, a check in a Starlette handler before it reads the body). A flood of keyless
requests against a full budget, while keyed clients keep sending, gets the app's 401: none of them
ever asks the ledger for a byte or waits in its queue, and the keyed ones are still served.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

import pytest
from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request
from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.endpoints import HTTPEndpoint
from starlette.responses import JSONResponse
from starlette.routing import Route

from gpu_asgi import GPUAdmissionMiddleware, Ledger, LinearEstimator, Reservation, TenantKey, gpu_bound

from ._asgi import Words, client
from ._backends import SpyLedger

BUDGET = 10_000
SMALL = {"prompt": "hello world", "max_new_tokens": 8}
KEY = "good-key"
KEYLESS = 200


class GenerateIn(BaseModel):
    prompt: str
    max_new_tokens: int = 16
    temperature: float = 1.0


def require_key(request: Request) -> str:
    key = request.headers.get("x-api-key")
    if key != KEY:
        raise HTTPException(401, "a valid x-api-key is required")
    return key


def held(request: Request) -> int:
    reservation: Reservation = request.state.gpu_reservation
    return reservation.nbytes




# -- the shapes: each adds POST /gen to the app it is given -----------------------------------------


def body_model(app: FastAPI) -> None:
    @app.post("/gen")
    @gpu_bound()
    async def gen(body: GenerateIn, key: Annotated[str, Depends(require_key)], request: Request) -> dict[str, int]:
        await asyncio.sleep(0.005)
        return {"held": held(request)}


def body_model_sync(app: FastAPI) -> None:
    @app.post("/gen")
    @gpu_bound()
    def gen(body: GenerateIn, key: Annotated[str, Depends(require_key)], request: Request) -> dict[str, int]:
        return {"held": held(request)}


def router_dependency(app: FastAPI) -> None:
    router = APIRouter(dependencies=[Depends(require_key)])

    @router.post("/gen")
    @gpu_bound()
    async def gen(body: GenerateIn, request: Request) -> dict[str, int]:
        return {"held": held(request)}

    app.include_router(router)


def route_dependency_sync(app: FastAPI) -> None:
    @app.post("/gen", dependencies=[Depends(require_key)])
    @gpu_bound()
    def gen(body: GenerateIn, request: Request) -> dict[str, int]:
        return {"held": held(request)}


def request_only(app: FastAPI) -> None:
    @app.post("/gen")
    @gpu_bound()
    async def gen(request: Request, key: Annotated[str, Depends(require_key)]) -> dict[str, Any]:
        data = await request.json()
        return {"held": held(request), "prompt": data["prompt"]}


def class_instance(app: FastAPI) -> None:
    class Generate:
        @gpu_bound()
        async def __call__(self, body: GenerateIn, request: Request,
                           key: Annotated[str, Depends(require_key)]) -> dict[str, int]:
            return {"held": held(request)}

    app.post("/gen")(Generate())


def generator(app: FastAPI) -> None:
    """FastAPI streams what the endpoint yields (JSON lines)."""

    @app.post("/gen")
    @gpu_bound()
    async def gen(body: GenerateIn, request: Request, key: Annotated[str, Depends(require_key)]) -> AsyncIterator[dict[str, int]]:
        yield {"held": held(request)}


def starlette_endpoint(app: Starlette) -> None:
    """Starlette admits at the body read: the handler checks the key before it reads."""

    @gpu_bound()
    async def gen(request: Request) -> JSONResponse:
        if request.headers.get("x-api-key") != KEY:
            return JSONResponse({"detail": "a valid x-api-key is required"}, status_code=401)
        await request.json()
        return JSONResponse({"held": held(request)})

    app.router.routes.append(Route("/gen", gen, methods=["POST"]))


def http_endpoint(app: Starlette) -> None:
    class Generate(HTTPEndpoint):
        @gpu_bound()
        async def post(self, request: Request) -> JSONResponse:
            if request.headers.get("x-api-key") != KEY:
                return JSONResponse({"detail": "a valid x-api-key is required"}, status_code=401)
            await request.json()
            return JSONResponse({"held": held(request)})

    app.router.routes.append(Route("/gen", Generate, methods=["POST"]))


FASTAPI_SHAPES: dict[str, Callable[[FastAPI], None]] = {
    "body model, auth dependency": body_model,
    "body model, auth dependency, def": body_model_sync,
    "included router's dependencies=": router_dependency,
    "route's dependencies=, def": route_dependency_sync,
    "Request only, auth dependency": request_only,
    "callable class instance": class_instance,
    "generator (streamed lines)": generator,
}
STARLETTE_SHAPES: dict[str, Callable[[Starlette], None]] = {
    "Starlette function": starlette_endpoint,
    "HTTPEndpoint class": http_endpoint,
}
SHAPES = [*FASTAPI_SHAPES, *STARLETTE_SHAPES]


def build(shape: str, ledger: Ledger) -> Any:
    app: Any
    if shape in FASTAPI_SHAPES:
        app = FastAPI()
        FASTAPI_SHAPES[shape](app)
    else:
        app = Starlette()
        STARLETTE_SHAPES[shape](app)
    app.add_middleware(GPUAdmissionMiddleware, ledger=ledger, estimator=LinearEstimator(bytes_per_token=10),
                       token_counter=Words(), tenant_key=TenantKey.api_key())
    return app


@pytest.mark.parametrize("shape", SHAPES)
async def test_a_flood_of_keyless_requests_never_asks_for_a_byte(shape: str) -> None:
    ledger = SpyLedger(BUDGET, max_queue=64, max_wait=2.0)
    app = build(shape, ledger)
    hold = ledger.try_reserve(BUDGET, tenant="someone else")  # the budget is full
    assert hold is not None
    ledger.asked.clear()
    keyless: list[int] = []
    keyed: list[tuple[int, str]] = []
    waiting_peak = 0

    async with client(app) as http:
        async def flood(index: int) -> None:
            headers = {"x-api-key": "wrong"} if index % 2 else {}
            keyless.append((await http.post("/gen", json=SMALL, headers=headers)).status_code)

        async def keyed_client() -> None:
            for _ in range(4):
                answer = await http.post("/gen", json=SMALL, headers={"x-api-key": KEY})
                keyed.append((answer.status_code, answer.text))

        async def watch() -> None:
            nonlocal waiting_peak
            while len(keyless) < KEYLESS:
                waiting_peak = max(waiting_peak, ledger.statistics().waiting)
                await asyncio.sleep(0.002)

        async def free_later() -> None:
            await asyncio.sleep(0.2)
            hold.release()

        await asyncio.wait_for(asyncio.gather(
            *(flood(i) for i in range(KEYLESS)), *(keyed_client() for _ in range(3)), watch(), free_later()
        ), 60)

    assert keyless == [401] * KEYLESS
    served = [text for status, text in keyed if status == 200]
    assert {status for status, _ in keyed} <= {200, 503} and served, keyed
    assert all('"held":100' in text for text in served), served  # (2 + 8) tokens x 10 bytes, held inside
    assert len(set(ledger.asked)) == 1  # only the one good key's tenant ever asked for bytes
    assert waiting_peak <= 3  # at most the keyed clients queued
    assert ledger.statistics().reserved_bytes == 0


MODEL_SHAPES = [shape for shape in FASTAPI_SHAPES if shape != "Request only, auth dependency"]


@pytest.mark.parametrize("shape", MODEL_SHAPES)
async def test_a_body_its_model_refuses_is_answered_before_admission(shape: str) -> None:
    """FastAPI validates a body parameter before it calls the endpoint: a body gpu_asgi reads (its
    fields are fine) but the model refuses gets FastAPI's 422 at once with the budget full, and asks
    for no byte. A generator endpoint is admitted with its dependencies, before that validation:
    it queues, and here, with the budget held, is refused for load."""
    ledger = SpyLedger(BUDGET, max_wait=0.3)
    app = build(shape, ledger)
    hold = ledger.try_reserve(BUDGET, tenant="someone else")
    assert hold is not None
    ledger.asked.clear()
    async with client(app) as http:
        answer = await http.post("/gen", json={"prompt": "hello world", "max_new_tokens": 8, "temperature": "hot"},
                                 headers={"x-api-key": KEY})
    if shape == "generator (streamed lines)":
        assert answer.status_code == 503 and ledger.asked, answer.text
    else:
        assert answer.status_code == 422 and "temperature" in answer.text and ledger.asked == [], answer.text
    hold.release()
    assert ledger.statistics().reserved_bytes == 0


async def test_without_the_middleware_a_tagged_endpoint_runs_as_it_is() -> None:
    app = FastAPI()

    @app.post("/gen")
    @gpu_bound()
    async def gen(body: GenerateIn, key: Annotated[str, Depends(require_key)]) -> dict[str, str]:
        return {"prompt": body.prompt}

    async with client(app) as http:
        assert (await http.post("/gen", json=SMALL, headers={"x-api-key": KEY})).json() == {"prompt": "hello world"}
        assert (await http.post("/gen", json=SMALL)).status_code == 401
    assert "gpu_asgi_request__" not in str(app.openapi())  # the wrapper's parameter is not in the API


async def test_gpu_bound_above_the_route_decorator_is_named_at_startup(caplog: pytest.LogCaptureFixture) -> None:
    """FastAPI registered the bare function: that route is admitted at its body read, and the log says so."""
    ledger = SpyLedger(BUDGET)
    app = FastAPI()

    @gpu_bound()
    @app.post("/early")
    async def early(body: GenerateIn, key: Annotated[str, Depends(require_key)], request: Request) -> dict[str, int]:
        return {"held": held(request)}

    body_model(app)
    app.add_middleware(GPUAdmissionMiddleware, ledger=ledger, estimator=LinearEstimator(bytes_per_token=10),
                       token_counter=Words())
    with caplog.at_level("WARNING", logger="gpu_asgi"):
        async with client(app) as http:
            assert (await http.post("/early", json=SMALL, headers={"x-api-key": KEY})).json() == {"held": 100}
    warned = [record.getMessage() for record in caplog.records if "above the route decorator" in record.getMessage()]
    assert len(warned) == 1 and "/early" in warned[0] and "/gen" not in warned[0]
