"""End-to-end behaviour of GPUAdmissionMiddleware through real Starlette/FastAPI apps."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from fastapi import Depends, FastAPI
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.websockets import WebSocket

from gpu_asgi import (
    Admission,
    GPUAdmissionMiddleware,
    HeuristicTokenCounter,
    HFTokenCounter,
    Ledger,
    LinearEstimator,
    Reservation,
    RouteSpec,
    TokenCounter,
    gpu_admission,
    gpu_bound,
    gpu_reservation,
)
from gpu_asgi._admission import body as _body

from ._asgi import RawClient, client, http_scope, in_threads, local_hf_tokenizer, settle, wait_until

ONE_BYTE_PER_TOKEN = LinearEstimator(bytes_per_token=1)


class Counter:
    """Counts words: easy to reason about in assertions."""

    inline_limit = 1 << 30

    def count(self, text: str) -> int:
        return len(text.split())


def make_app(ledger: Ledger, endpoint: Any, *, path: str = "/generate", **options: Any) -> Starlette:
    app = Starlette(routes=[Route(path, endpoint, methods=["POST"])])
    options.setdefault("estimator", ONE_BYTE_PER_TOKEN)
    options.setdefault("token_counter", Counter())
    app.add_middleware(GPUAdmissionMiddleware, ledger=ledger, **options)
    return app



@gpu_bound()
async def echo(request: Request) -> JSONResponse:
    body = await request.body()  # admission happens at this first read
    admission: Admission = request.state.gpu_admission
    return JSONResponse(
        {
            "body": body.decode(),
            "prompt_tokens": admission.prompt_tokens,
            "max_new_tokens": admission.max_new_tokens,
            "batch": admission.batch,
            "estimated_bytes": admission.estimated_bytes,
            "held": admission.reservation.nbytes,
            "device": admission.device,
        }
    )


async def test_tagged_route_is_admitted_and_gets_the_exact_body() -> None:
    ledger = Ledger(1000)
    body = b'{"prompt": "one two three",   "max_new_tokens": 7, "extra": [1, 2.50]}'
    async with client(make_app(ledger, echo)) as http:
        response = await http.post("/generate", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 200
    data = response.json()
    assert data["body"] == body.decode()
    assert (data["prompt_tokens"], data["max_new_tokens"], data["batch"]) == (3, 7, 1)
    assert data["estimated_bytes"] == data["held"] == 10
    assert data["device"] == "cuda:0"
    stats = ledger.statistics()
    assert (stats.reserved_bytes, stats.in_flight, stats.admitted_total) == (0, 0, 1)


async def test_chunked_body_is_replayed_byte_for_byte() -> None:
    ledger = Ledger(1000)
    app = make_app(ledger, echo)
    chunks = [b'{"prompt": "a b', b' c", "max_tokens"', b": 2}"]
    raw = RawClient(app, http_scope(app=None), chunks).start()
    await raw.finish()
    assert raw.status == 200
    assert raw.json()["body"] == b"".join(chunks).decode()
    assert raw.json()["prompt_tokens"] == 3


async def test_fastapi_dependency_and_defaults() -> None:
    ledger = Ledger(10_000)
    app = FastAPI()
    app.add_middleware(GPUAdmissionMiddleware, ledger=ledger, estimator=ONE_BYTE_PER_TOKEN, token_counter=Counter())

    @app.post("/v1/chat/completions")
    @gpu_bound(default_max_new_tokens=16)
    async def chat(payload: dict[str, Any], reservation: Reservation = Depends(gpu_reservation),
                   admission: Admission = Depends(gpu_admission)) -> dict[str, Any]:
        return {"held": reservation.nbytes, "tokens": admission.prompt_tokens, "batch": admission.batch,
                "max_new": admission.max_new_tokens}

    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hello there"}, {"type": "image_url", "image_url": {}}]},
    ]
    async with client(app) as http:
        response = await http.post("/v1/chat/completions", json={"messages": messages, "n": 3})
    assert response.status_code == 200
    # words: system + "be brief" + user + "hello there" = 6, plus 5 template tokens per message,
    # plus 32 once for the template (a default system prompt, the generation prompt)
    assert response.json() == {"held": 3 * (48 + 16), "tokens": 48, "batch": 3, "max_new": 16}


async def test_list_prompts_and_token_ids_form_a_batch() -> None:
    ledger = Ledger(10_000)
    async with client(make_app(ledger, echo)) as http:
        listed = (await http.post("/generate", json={"prompt": ["a", "a b c d"], "max_tokens": 4})).json()
        ids = (await http.post("/generate", json={"prompt": [[1, 2, 3], [4]], "max_tokens": 4})).json()
    assert (listed["prompt_tokens"], listed["batch"], listed["held"]) == (4, 2, 16)
    assert (ids["prompt_tokens"], ids["batch"], ids["held"]) == (3, 2, 14)


async def test_route_estimator_and_prompt_getter_override_the_defaults() -> None:
    ledger = Ledger(10_000)

    @gpu_bound(prompt=lambda body: body["input"]["text"], estimator=LinearEstimator(bytes_per_token=10, fixed_bytes=5))
    async def custom(request: Request) -> JSONResponse:
        await request.body()
        return JSONResponse({"held": request.state.gpu_reservation.nbytes})

    async with client(make_app(ledger, custom)) as http:
        ok = await http.post("/generate", json={"input": {"text": "x y"}, "max_new_tokens": 3})
        bad = await http.post("/generate", json={"input": {}})
    assert ok.json() == {"held": 5 + 10 * 5}
    assert bad.status_code == 422 and "could not be read" in bad.json()["detail"]


async def test_untagged_routes_are_not_buffered() -> None:
    ledger = Ledger(100)
    seen: list[bytes] = []

    async def upload(request: Request) -> PlainTextResponse:
        async for chunk in request.stream():
            if chunk:
                seen.append(chunk)
        return PlainTextResponse("ok")

    app = make_app(ledger, upload)  # untagged: the endpoint streams the body itself
    raw = RawClient(app, http_scope(), [b"first", b"second", b"third"]).start()
    await raw.finish()
    assert raw.status == 200
    assert seen == [b"first", b"second", b"third"]
    assert ledger.statistics().admitted_total == 0


async def test_websocket_and_lifespan_pass_through() -> None:
    ledger = Ledger(100)
    started = []

    async def ws(websocket: WebSocket) -> None:
        await websocket.accept()
        await websocket.send_text("hi")
        await websocket.close()

    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app: Starlette):  # type: ignore[no-untyped-def]
        started.append(True)
        yield

    app = Starlette(routes=[WebSocketRoute("/generate", ws)], lifespan=lifespan)
    app.add_middleware(GPUAdmissionMiddleware, ledger=ledger, estimator=ONE_BYTE_PER_TOKEN,
                       routes={"/generate": RouteSpec()})
    sent: list[dict[str, Any]] = []
    inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    inbox.put_nowait({"type": "lifespan.startup"})
    lifespan_task = asyncio.ensure_future(app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, inbox.get, send))
    await wait_until(lambda: bool(sent))
    assert sent[-1]["type"] == "lifespan.startup.complete" and started
    inbox.put_nowait({"type": "lifespan.shutdown"})
    await asyncio.wait_for(lifespan_task, 5)

    sent.clear()
    inbox.put_nowait({"type": "websocket.connect"})
    scope = {**http_scope(), "type": "websocket", "scheme": "ws", "subprotocols": []}
    del scope["method"]
    await asyncio.wait_for(app(scope, inbox.get, send), 5)
    assert [m["type"] for m in sent] == ["websocket.accept", "websocket.send", "websocket.close"]


async def test_only_http_scopes_are_admitted_even_when_their_path_and_method_are_cached() -> None:
    seen: list[str] = []

    async def inner(scope: dict[str, Any], receive: Any, send: Any) -> None:
        seen.append(scope["type"])
        if scope["type"] == "http":
            await receive()  # a path named in routes= is admitted at this read
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b""})

    ledger = Ledger(1000)
    middleware = GPUAdmissionMiddleware(inner, ledger=ledger, estimator=ONE_BYTE_PER_TOKEN,
                                        routes={"/generate": RouteSpec()})
    raw = RawClient(middleware, http_scope(), [json.dumps({"prompt": "hi"}).encode()])
    await raw.start().finish()  # caches ("/generate", "POST") as tagged
    assert raw.status == 200 and ledger.statistics().admitted_total == 1
    # A server that (against the spec) puts a method in a websocket scope still gets a pass-through.
    websocket = {**http_scope(), "type": "websocket", "scheme": "ws", "subprotocols": []}
    await middleware(websocket, raw.receive, raw.send)
    assert seen == ["http", "websocket"] and ledger.statistics().admitted_total == 1


@pytest.mark.parametrize(
    ("body", "headers", "status", "reason", "detail"),
    [
        (b"{not json", {}, 400, "invalid-json", "not valid JSON"),
        (b'{"prompt": "\xff\xfe"}', {}, 400, "invalid-json", "not valid UTF-8"),
        (b"[" * 100_000 + b"]" * 100_000, {}, 400, "invalid-json", "nested too deeply"),
        # json.loads takes UTF-16/32 when the first bytes say so; its errors name that encoding
        (b'{\x00"\x00a', {}, 400, "invalid-json", "not valid UTF-16-LE (byte 4)"),
        (b"{\x00\x00\x00\x00\x00\x11\x00", {}, 400, "invalid-json", "not valid UTF-32-LE (byte 4)"),
        # more digits than CPython converts to an int (Starlette's Request.json() refuses it too)
        (b'{"prompt": "a", "seed": ' + b"1" * 5000 + b"}", {}, 400, "invalid-json", f"more than {sys.get_int_max_str_digits()} digits"),
        (b'["prompt"]', {}, 422, "invalid-field", "must be an object"),
        (b'{"text": "hi"}', {}, 422, "invalid-field", "no prompt"),
        (b'{"prompt": 42}', {}, 422, "invalid-field", "'prompt' must be"),
        (b'{"prompt": []}', {}, 422, "invalid-field", "'prompt' must be"),
        (b'{"prompt": ["a", 1]}', {}, 422, "invalid-field", "'prompt' must be"),
        (b'{"messages": "hi"}', {}, 422, "invalid-field", "non-empty list of messages"),
        (b'{"messages": [{"content": "hi"}]}', {}, 422, "invalid-field", "string 'role'"),
        (b'{"messages": [{"role": "user", "content": 5}]}', {}, 422, "invalid-field", "content must be"),
        (b'{"prompt": "hi", "max_new_tokens": -1}', {}, 422, "invalid-field", "at least 1"),
        (b'{"prompt": "hi", "max_new_tokens": 0}', {}, 422, "invalid-field", "at least 1"),
        (b'{"prompt": "hi", "max_tokens": 1000000}', {}, 422, "invalid-field", "at most 4096"),
        (b'{"prompt": "hi", "max_tokens": "many"}', {}, 422, "invalid-field", "must be an integer"),
        (b'{"prompt": "hi", "max_tokens": true}', {}, 422, "invalid-field", "must be an integer"),
        (b'{"prompt": "hi", "max_tokens": 1.5}', {}, 422, "invalid-field", "must be an integer"),
        (b'{"prompt": "hi", "n": 0}', {}, 422, "invalid-field", "'n' must be"),
        (b'{"prompt": "hi"}', {"content-type": "text/plain"}, 415, "unsupported-media-type", "application/json"),
        (b'{"prompt": "hi"}', {"content-length": "2000000"}, 413, "body-too-large", "announces 2000000 bytes"),
        (b'{"prompt": "' + b"x" * 2_000_000 + b'"}', {}, 413, "body-too-large", "larger than the limit"),
    ],
)
@pytest.mark.parametrize("loader", ["orjson", "stdlib"])
async def test_bad_input_gets_a_problem_and_never_reaches_the_endpoint(
    body: bytes, headers: dict[str, str], status: int, reason: str, detail: str, loader: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_body, "load_json", getattr(_body, f"_load_json_{loader}"))
    ledger = Ledger(1000)
    called = []

    @gpu_bound()
    async def endpoint(request: Request) -> PlainTextResponse:
        await request.body()  # admission happens here: a refusal ends the endpoint at this line
        called.append(True)
        return PlainTextResponse("should not run")

    header_list = [(b"content-type", b"application/json")]
    for name, value in headers.items():
        header_list = [h for h in header_list if h[0] != name.encode()] + [(name.encode(), value.encode())]
    raw = RawClient(make_app(ledger, endpoint), http_scope(headers=header_list), [body]).start()
    await raw.finish()
    assert raw.status == status
    assert raw.header(b"content-type") == b"application/problem+json"
    assert raw.header(b"x-gpu-admission-reason") == reason.encode()
    problem = raw.json()
    assert problem["type"] == f"urn:gpu-asgi:problem:{reason}"
    assert problem["status"] == status and problem["title"]
    assert detail in problem["detail"]
    assert not called
    stats = ledger.statistics()
    assert (stats.admitted_total, stats.reserved_bytes, stats.waiting) == (0, 0, 0)


async def test_slow_body_gets_408() -> None:
    ledger = Ledger(1000)
    app = make_app(ledger, echo, body_timeout=0.05)
    raw = RawClient(app, http_scope(), [])
    raw.incoming.put_nowait({"type": "http.request", "body": b'{"prompt":', "more_body": True})
    raw.start()
    await raw.finish()
    assert raw.status == 408
    assert raw.json()["type"].endswith("body-timeout")


async def test_request_that_can_never_fit_gets_413_with_the_numbers() -> None:
    ledger = Ledger(100)
    async with client(make_app(ledger, echo)) as http:
        response = await http.post("/generate", json={"prompt": "a b", "max_new_tokens": 200})
    assert response.status_code == 413
    assert response.headers["x-gpu-admission-reason"] == "exceeds-budget"
    assert response.json()["required_bytes"] == 202 and response.json()["budget_bytes"] == 100


@pytest.mark.parametrize("reject_status", [503, 429])
async def test_overload_is_rejected_with_retry_after(reject_status: int) -> None:
    ledger = Ledger(100, max_queue=1)
    holder = await ledger.reserve(100)
    queued = asyncio.ensure_future(ledger.reserve(10))
    await settle()
    async with client(make_app(ledger, echo, reject_status=reject_status)) as http:
        response = await http.post("/generate", json={"prompt": "a", "max_new_tokens": 10})
    assert response.status_code == reject_status
    assert response.headers["x-gpu-admission-reason"] == "queue-full"
    assert int(response.headers["retry-after"]) >= 1
    queued.cancel()
    holder.release()


async def test_queue_timeout_is_rejected_with_retry_after() -> None:
    ledger = Ledger(100, max_wait=0.02)
    holder = await ledger.reserve(95)
    async with client(make_app(ledger, echo)) as http:
        response = await http.post("/generate", json={"prompt": "a", "max_new_tokens": 10})
    assert response.status_code == 503
    assert response.headers["x-gpu-admission-reason"] == "queue-timeout"
    assert response.headers["retry-after"].isdigit()
    holder.release()
    assert ledger.statistics().waiting == 0


async def test_queued_request_is_admitted_when_bytes_come_back() -> None:
    ledger = Ledger(100)
    holder = await ledger.reserve(95)
    app = make_app(ledger, echo)
    raw = RawClient(app, http_scope(), [b'{"prompt": "a", "max_new_tokens": 10}']).start()
    await wait_until(lambda: ledger.statistics().waiting == 1)
    holder.release()
    await raw.finish()
    assert raw.status == 200 and raw.json()["held"] == 11
    assert ledger.statistics().reserved_bytes == 0


def streaming_endpoint(gate: asyncio.Event, chunks: int = 3) -> Any:
    @gpu_bound()
    async def stream(request: Request) -> StreamingResponse:
        await request.body()  # admission happens at the first body read
        async def tokens() -> Any:
            for index in range(chunks):
                await gate.wait()
                gate.clear()
                yield f"token{index} ".encode()

        return StreamingResponse(tokens(), media_type="text/plain")

    return stream


async def test_streamed_response_holds_the_reservation_until_the_last_chunk() -> None:
    ledger = Ledger(100)
    gate = asyncio.Event()
    app = make_app(ledger, streaming_endpoint(gate))
    raw = RawClient(app, http_scope(), [b'{"prompt": "a b", "max_new_tokens": 5}']).start()
    for _ in range(3):
        await wait_until(lambda: raw.status == 200)
        assert ledger.statistics().reserved_bytes == 7, "held while streaming"
        gate.set()
        await settle()
    await raw.finish()
    assert raw.body == b"token0 token1 token2 "
    assert ledger.statistics().reserved_bytes == 0


@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
async def test_client_disconnect_mid_stream_frees_the_reservation(spec_version: str) -> None:
    ledger = Ledger(100)
    gate = asyncio.Event()
    app = make_app(ledger, streaming_endpoint(gate, chunks=100))
    scope = http_scope()
    scope["asgi"]["spec_version"] = spec_version
    raw = RawClient(app, scope, [b'{"prompt": "a b", "max_new_tokens": 5}'])
    if spec_version == "2.4":  # servers on 2.4 raise from send() once the client is gone
        original_send = raw.send

        async def send(message: dict[str, Any]) -> None:
            if raw.disconnected:
                raise OSError("client disconnected")
            await original_send(message)

        raw.disconnected = False  # type: ignore[attr-defined]
        raw.send = send  # type: ignore[method-assign]
    raw.start()
    gate.set()
    await wait_until(lambda: len(raw.sent) >= 2)
    assert ledger.statistics().reserved_bytes == 7
    raw.disconnected = True  # type: ignore[attr-defined]
    raw.disconnect()
    gate.set()
    try:
        await raw.finish()
    except ClientDisconnect:
        pass  # Starlette turns the 2.4 server's OSError into this; what matters is the ledger
    assert ledger.statistics().reserved_bytes == 0
    assert ledger.statistics().in_flight == 0


async def test_endpoint_exception_releases_the_reservation() -> None:
    ledger = Ledger(1000)

    @gpu_bound()
    async def broken(request: Request) -> PlainTextResponse:
        await request.body()  # admission happens at the first body read
        assert ledger.statistics().reserved_bytes > 0
        raise RuntimeError("model exploded")

    app = make_app(ledger, broken)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False), base_url="http://t") as http:
        response = await http.post("/generate", json={"prompt": "a"})
    assert response.status_code == 500
    assert ledger.statistics().reserved_bytes == 0


async def test_cancelled_request_task_releases_and_leaves_the_queue() -> None:
    ledger = Ledger(100)
    gate = asyncio.Event()
    app = make_app(ledger, streaming_endpoint(gate))
    running = RawClient(app, http_scope(), [b'{"prompt": "a", "max_new_tokens": 60}']).start()
    await wait_until(lambda: running.status == 200)
    queued = RawClient(app, http_scope(), [b'{"prompt": "a", "max_new_tokens": 60}']).start()
    await wait_until(lambda: ledger.statistics().waiting == 1)
    assert queued.task is not None and running.task is not None
    queued.task.cancel()
    running.task.cancel()
    await asyncio.gather(queued.task, running.task, return_exceptions=True)
    stats = ledger.statistics()
    assert (stats.reserved_bytes, stats.waiting, stats.in_flight) == (0, 0, 0)


async def test_client_that_disconnects_while_queued_is_never_admitted() -> None:
    ledger = Ledger(100)
    holder = await ledger.reserve(100)
    called = []

    @gpu_bound()
    async def endpoint(request: Request) -> PlainTextResponse:
        await request.body()  # admission happens at the first body read
        called.append(True)
        return PlainTextResponse("no")

    raw = RawClient(make_app(ledger, endpoint), http_scope(), [b'{"prompt": "a", "max_tokens": 5}']).start()
    await wait_until(lambda: ledger.statistics().waiting == 1)
    raw.disconnect()
    await raw.finish()
    assert not called
    assert raw.status == 499 and raw.json()["type"] == "urn:gpu-asgi:problem:client-closed-request"
    assert ledger.statistics().waiting == 0
    holder.release()
    assert ledger.statistics().admitted_total == 1  # only the holder


async def test_endpoint_can_release_early_and_let_the_next_request_in() -> None:
    ledger = Ledger(100)
    gate = asyncio.Event()

    @gpu_bound()
    async def early(request: Request) -> StreamingResponse:
        await request.body()  # admission happens at the first body read
        reservation: Reservation = request.state.gpu_reservation
        reservation.shrink(10)  # outputs are on the host: keep only what streaming needs

        async def rest() -> Any:
            await gate.wait()
            yield b"done"

        return StreamingResponse(rest())

    app = make_app(ledger, early)
    first = RawClient(app, http_scope(), [b'{"prompt": "a", "max_new_tokens": 79}']).start()
    await wait_until(lambda: first.status == 200)
    assert ledger.statistics().reserved_bytes == 10
    second = RawClient(app, http_scope(), [b'{"prompt": "a", "max_new_tokens": 79}']).start()
    await wait_until(lambda: second.status == 200)  # admitted while the first still streams
    assert ledger.statistics().waiting == 0
    gate.set()
    await first.finish()
    await second.finish()
    assert ledger.statistics().reserved_bytes == 0


async def test_host_without_router_registers_paths_explicitly() -> None:
    ledger = Ledger(1000)
    seen: list[Any] = []

    async def bare(scope: dict[str, Any], receive: Any, send: Any) -> None:
        message = await receive()
        if "gpu_admission" in scope.get("state", {}):
            seen.append((json.loads(message["body"]), scope["state"]["gpu_admission"].estimated_bytes))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    app = GPUAdmissionMiddleware(bare, ledger=ledger, estimator=ONE_BYTE_PER_TOKEN, token_counter=Counter(),
                                 routes={"/gen": RouteSpec(default_max_new_tokens=4)})
    async with client(app) as http:
        tagged = await http.post("/gen", json={"prompt": "a b"})
        get = await http.get("/gen")
        other = await http.post("/other", content=b"not json")
    assert tagged.status_code == 200 and seen == [({"prompt": "a b"}, 6)]
    assert get.status_code == 200 and other.status_code == 200  # untagged: passed through untouched
    assert ledger.statistics().admitted_total == 1


async def test_mounted_routes_path_params_and_routers_are_resolved() -> None:
    ledger = Ledger(1000)
    inner = Starlette(routes=[Route("/models/{name}/generate", echo, methods=["POST"])])
    app = Starlette(routes=[Mount("/api", routes=[Mount("/v1", app=inner)])])
    app.add_middleware(GPUAdmissionMiddleware, ledger=ledger, estimator=ONE_BYTE_PER_TOKEN, token_counter=Counter())
    async with client(app) as http:
        response = await http.post("/api/v1/models/qwen/generate", json={"prompt": "a b c", "max_tokens": 1})
        wrong_method = await http.put("/api/v1/models/qwen/generate", json={"prompt": "a"})
    assert response.status_code == 200 and response.json()["held"] == 4
    assert wrong_method.status_code == 405


async def test_long_prompts_are_counted_off_the_event_loop() -> None:
    ledger = Ledger(10_000_000)
    threads: list[int] = []

    class SlowCounter:
        inline_limit = 100

        def count(self, text: str) -> int:
            threads.append(threading.get_ident())
            return len(text)

    async with client(make_app(ledger, echo, token_counter=SlowCounter())) as http:
        short = await http.post("/generate", json={"prompt": "x" * 10})
        long = await http.post("/generate", json={"prompt": "x" * 1000})
    assert short.status_code == long.status_code == 200
    assert threads[0] == threading.get_ident()
    assert threads[1] != threading.get_ident()


async def test_disconnect_keeps_the_bytes_until_the_model_thread_stops() -> None:
    """A disconnect ends the stream, but the device is busy until the executor's call returns."""
    from gpu_asgi import DeviceExecutor

    ledger = Ledger(100)
    executor = DeviceExecutor("cpu")
    in_thread, finish = threading.Event(), threading.Event()

    def generate() -> bytes:
        in_thread.set()
        finish.wait(5)
        return b"second"

    @gpu_bound()
    async def stream(request: Request) -> StreamingResponse:
        await request.body()  # admission happens at the first body read
        async def tokens() -> Any:
            yield b"first"
            yield await executor.run(generate)

        return StreamingResponse(tokens())

    scope = http_scope()
    scope["asgi"]["spec_version"] = "2.3"  # Starlette listens for the disconnect and cancels the stream
    raw = RawClient(make_app(ledger, stream), scope, [b'{"prompt": "a", "max_new_tokens": 9}']).start()
    await wait_until(in_thread.is_set)
    raw.disconnect()
    await asyncio.sleep(0.05)
    assert ledger.statistics().reserved_bytes == 10, "released while the model thread still runs"
    finish.set()
    await raw.finish()
    assert ledger.statistics().reserved_bytes == 0
    executor.shutdown()


async def test_429_is_for_overload_only_an_outage_stays_503() -> None:
    from gpu_asgi import LedgerUnavailable

    class DownLedger(Ledger):
        def try_reserve(self, nbytes: int, **options: Any) -> Reservation | None:
            return None

        async def reserve(self, nbytes: int, **options: Any) -> Reservation:
            raise LedgerUnavailable("Redis did not answer.", retry_after=2)

    async with client(make_app(DownLedger(1000), echo, reject_status=429)) as http:
        response = await http.post("/generate", json={"prompt": "a", "max_new_tokens": 5})
    assert response.status_code == 503
    assert response.headers["x-gpu-admission-reason"] == "ledger-unavailable"
    assert response.headers["retry-after"] == "2"


async def test_any_exception_from_a_prompt_callable_is_a_422_naming_the_route() -> None:
    ledger = Ledger(1000)

    @gpu_bound(prompt=lambda body: body.get("input", {}).get("text", ""))
    async def nested(request: Request) -> PlainTextResponse:
        await request.body()
        return PlainTextResponse("ran")

    app = Starlette(routes=[Route("/v1/{model}/generate", nested, methods=["POST"])])
    app.add_middleware(GPUAdmissionMiddleware, ledger=ledger, estimator=ONE_BYTE_PER_TOKEN, token_counter=Counter())
    async with client(app) as http:
        response = await http.post("/v1/qwen/generate", json={"input": None})  # None.get: AttributeError
    assert response.status_code == 422
    assert response.headers["content-type"] == "application/problem+json"
    detail = response.json()["detail"]
    assert "POST /v1/{model}/generate" in detail and "AttributeError" in detail
    assert ledger.statistics().admitted_total == 0


async def test_a_tagged_endpoint_that_answers_without_reading_its_body_is_an_error_not_a_silent_pass(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ledger = Ledger(1000)

    @gpu_bound()
    async def lazy(request: Request) -> PlainTextResponse:
        return PlainTextResponse("ran without reading")

    async with client(make_app(ledger, lazy)) as http:
        response = await http.post("/generate", json={"prompt": "a"})
    assert response.status_code == 500
    assert response.json()["type"] == "urn:gpu-asgi:problem:route-not-admitted"
    assert "without reading" in caplog.text
    assert ledger.statistics().admitted_total == 0


async def test_a_tagged_route_for_get_only_refuses_to_start() -> None:
    from contextlib import asynccontextmanager

    from fastapi import APIRouter

    started: list[bool] = []

    @asynccontextmanager
    async def lifespan(app: FastAPI):  # type: ignore[no-untyped-def]
        started.append(True)
        yield

    app = FastAPI(lifespan=lifespan)
    router = APIRouter(prefix="/v1")

    @router.get("/generate")
    @gpu_bound()
    async def by_query(prompt: str) -> dict[str, str]:
        return {"prompt": prompt}

    app.include_router(router)
    app.add_middleware(GPUAdmissionMiddleware, ledger=Ledger(100), estimator=ONE_BYTE_PER_TOKEN)
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "lifespan.startup"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    with pytest.raises(RuntimeError, match="GET /v1/generate"):  # after the message, as Starlette's own lifespan does
        await app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, receive, send)
    assert [m["type"] for m in sent] == ["lifespan.startup.failed"]
    assert "GET /v1/generate" in sent[0]["message"] and not started
    # Without a lifespan, the first request says the same instead of running the route unadmitted.
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False), base_url="http://t") as http:
        response = await http.get("/v1/generate", params={"prompt": "hi"})
    assert response.status_code == 500


def test_a_trio_host_fails_at_startup_with_a_clear_message() -> None:
    import trio

    async def ok(request: Request) -> PlainTextResponse:
        return PlainTextResponse("ok")

    app = make_app(Ledger(100), ok)
    sent: list[dict[str, Any]] = []

    async def main() -> None:
        async def receive() -> dict[str, Any]:
            return {"type": "lifespan.startup"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        with pytest.raises(RuntimeError, match="asyncio only"):
            await app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, receive, send)

    trio.run(main)
    assert [m["type"] for m in sent] == ["lifespan.startup.failed"]
    assert "asyncio only" in sent[0]["message"]


def test_a_refused_startup_fails_the_test_client_instead_of_hanging_it() -> None:
    """Starlette's TestClient waits for the lifespan to end after ``lifespan.startup.failed``;
    it must end with the error, not leave the client entered on an app that refused to start."""
    import threading
    import warnings

    from starlette.testclient import TestClient

    @gpu_bound()
    async def both(request: Request) -> PlainTextResponse:
        return PlainTextResponse("ran")

    app = Starlette(routes=[Route("/generate", both, methods=["GET", "POST"])])
    app.add_middleware(GPUAdmissionMiddleware, ledger=Ledger(100), estimator=ONE_BYTE_PER_TOKEN)
    outcome: list[BaseException | str] = []

    def enter() -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Starlette 1.x asks for httpx2 under its TestClient
            try:
                with TestClient(app):
                    outcome.append("entered")
            except BaseException as error:
                outcome.append(error)

    thread = threading.Thread(target=enter, daemon=True)  # a hang must fail the test, not stall the run
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive(), "the TestClient hung on an app that refused to start"
    assert len(outcome) == 1 and isinstance(outcome[0], RuntimeError), outcome
    assert "GET/HEAD/POST /generate" in str(outcome[0])


async def test_nested_middlewares_admit_once() -> None:
    ledger = Ledger(1000)
    inner = make_app(ledger, echo)
    app = GPUAdmissionMiddleware(inner, ledger=ledger, estimator=ONE_BYTE_PER_TOKEN, token_counter=Counter())
    async with client(app) as http:
        response = await http.post("/generate", json={"prompt": "a b", "max_new_tokens": 2})
    assert response.status_code == 200 and response.json()["held"] == 4
    assert ledger.statistics().admitted_total == 1


class CopyScope:
    """A middleware that hands the app below it a copy of the scope, as some do."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.app(dict(scope), receive, send)


async def test_nested_middlewares_with_a_scope_copy_between_them_admit_once() -> None:
    """The outer middleware cannot see the route the router chose in a copy of its scope, so the
    inner one, which can, must admit (and the outer must not step aside for it blindly)."""
    outer_ledger, inner_ledger = Ledger(1000), Ledger(1000)
    inner = make_app(inner_ledger, echo)
    app = GPUAdmissionMiddleware(CopyScope(inner), ledger=outer_ledger, estimator=ONE_BYTE_PER_TOKEN, token_counter=Counter())
    async with client(app) as http:
        response = await http.post("/generate", json={"prompt": "a b", "max_new_tokens": 2})
    assert response.status_code == 200 and response.json()["held"] == 4
    assert (inner_ledger.statistics().admitted_total, outer_ledger.statistics().admitted_total) == (1, 0)


async def test_nested_middlewares_the_one_nearest_the_route_admits_and_refuses() -> None:
    """Two nested middlewares with their own ledgers: the inner one (nearest the router, whose body
    read reaches it first) admits or refuses; the outer one steps aside, even when the inner one
    refuses before reading the body."""
    outer_ledger, inner_ledger = Ledger(1000), Ledger(1000)
    inner = make_app(inner_ledger, echo)
    app = GPUAdmissionMiddleware(inner, ledger=outer_ledger, estimator=ONE_BYTE_PER_TOKEN, token_counter=Counter())
    async with client(app) as http:
        admitted = await http.post("/generate", json={"prompt": "a b", "max_new_tokens": 2})
        refused = await http.post("/generate", content=b"x", headers={"content-type": "text/plain"})
    assert admitted.status_code == 200 and admitted.json()["held"] == 4
    assert (inner_ledger.statistics().admitted_total, outer_ledger.statistics().admitted_total) == (1, 0)
    assert refused.status_code == 415 and refused.headers["x-gpu-admission-reason"] == "unsupported-media-type", refused.text


async def test_nested_middlewares_answer_an_unread_tagged_endpoint_once(caplog: pytest.LogCaptureFixture) -> None:
    @gpu_bound()
    async def lazy(request: Request) -> PlainTextResponse:
        return PlainTextResponse("ran without reading")

    ledger = Ledger(1000)
    app = GPUAdmissionMiddleware(make_app(ledger, lazy), ledger=ledger, estimator=ONE_BYTE_PER_TOKEN, token_counter=Counter())
    async with client(app) as http:
        response = await http.post("/generate", json={"prompt": "a"})
    assert response.status_code == 500
    assert response.json()["type"] == "urn:gpu-asgi:problem:route-not-admitted"
    assert caplog.text.count("without reading") == 1, caplog.text  # one middleware answered, and said so


async def test_an_outer_middleware_with_explicit_routes_admits_and_the_inner_one_steps_aside() -> None:
    outer_ledger, inner_ledger = Ledger(1000), Ledger(1000)
    inner = make_app(inner_ledger, echo)
    app = GPUAdmissionMiddleware(
        inner, ledger=outer_ledger, estimator=ONE_BYTE_PER_TOKEN, token_counter=Counter(), routes={"/generate": RouteSpec()}
    )
    async with client(app) as http:
        response = await http.post("/generate", json={"prompt": "a b", "max_new_tokens": 2})
    assert response.status_code == 200 and response.json()["held"] == 4
    assert (inner_ledger.statistics().admitted_total, outer_ledger.statistics().admitted_total) == (0, 1)


def test_one_middleware_on_two_event_loops_times_out_slow_bodies_on_both() -> None:
    """Each request's body deadline is its own, whichever loop (thread) it runs on."""
    app = make_app(Ledger(1000), echo, body_timeout=0.1)
    statuses: list[int | None] = []
    both_reading = threading.Barrier(2)

    def serve_one() -> None:
        async def main() -> None:
            raw = RawClient(app, http_scope(), [])
            raw.incoming.put_nowait({"type": "http.request", "body": b'{"prompt":', "more_body": True})
            raw.start()
            await asyncio.to_thread(both_reading.wait, 5)  # the two reads overlap in time
            await raw.finish(timeout=5)
            statuses.append(raw.status)

        asyncio.run(main())

    in_threads(serve_one, 2, 15)
    assert statuses == [408, 408]


async def test_a_utf8_bom_body_is_admitted_as_fastapi_parses_it() -> None:
    ledger = Ledger(1000)
    app = FastAPI()
    app.add_middleware(GPUAdmissionMiddleware, ledger=ledger, estimator=ONE_BYTE_PER_TOKEN, token_counter=Counter())

    @app.post("/generate")
    @gpu_bound()
    async def generate(payload: dict[str, Any], reservation: Reservation = Depends(gpu_reservation)) -> dict[str, Any]:
        return {"prompt_chars": len(payload["prompt"]), "note": payload["note"] == "\udc80", "held": reservation.nbytes}

    # a lone surrogate escape is valid JSON: refused only in text to count (below), passed on elsewhere
    body = b'\xef\xbb\xbf{"prompt": "a \\u00e9", "note": "\\udc80", "max_tokens": 2.0}'
    async with client(app) as http:
        response = await http.post("/generate", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 200, response.text
    assert response.json() == {"prompt_chars": 3, "note": True, "held": 4}


async def test_an_integer_too_long_for_python_is_our_400_on_fastapi_too_and_the_service_keeps_serving() -> None:
    """json.loads raises a plain ValueError for it (CPython's limit on int digits), not a
    JSONDecodeError: FastAPI would answer its own bare 400, a Starlette endpoint a 500."""
    ledger = Ledger(1000)
    app = FastAPI()
    app.add_middleware(GPUAdmissionMiddleware, ledger=ledger, estimator=ONE_BYTE_PER_TOKEN, token_counter=Counter())

    @app.post("/generate")
    @gpu_bound()
    async def generate(payload: dict[str, Any], reservation: Reservation = Depends(gpu_reservation)) -> dict[str, Any]:
        return {"held": reservation.nbytes}

    digits = sys.get_int_max_str_digits() + 1
    body = b'{"prompt": "a b", "seed": ' + b"7" * digits + b"}"
    async with client(app) as http:
        refused = await http.post("/generate", content=body, headers={"content-type": "application/json"})
        served = await http.post("/generate", json={"prompt": "a b", "max_new_tokens": 2})
    assert refused.status_code == 400 and refused.headers["content-type"] == "application/problem+json"
    problem = refused.json()
    assert problem["type"] == "urn:gpu-asgi:problem:invalid-json"
    assert problem["detail"] == f"The JSON body has an integer with more than {digits - 1} digits."
    assert served.status_code == 200 and served.json() == {"held": 4}
    assert ledger.statistics().admitted_total == 1


@pytest.mark.parametrize("when", ["queued", "sending its body"])
async def test_a_client_that_leaves_before_admission_gets_an_answer_an_outer_base_http_middleware_can_pass_on(
    when: str,
) -> None:
    """A BaseHTTPMiddleware's call_next raises "No response returned." for a request that got no
    response; the 499 sent after the client left is what it passes on (to nobody), so nothing raises."""
    from starlette.middleware.base import BaseHTTPMiddleware, RequestResponseEndpoint
    from starlette.responses import Response

    statuses: list[int] = []

    class Logging(BaseHTTPMiddleware):
        async def dispatch(self, request: Request, call_next: RequestResponseEndpoint) -> Response:
            response = await call_next(request)
            statuses.append(response.status_code)
            return response

    ledger = Ledger(100)
    holder = await ledger.reserve(100) if when == "queued" else None
    app = make_app(ledger, echo)
    app.add_middleware(Logging)
    raw = RawClient(app, http_scope(), [b'{"prompt": "a", "max_tokens": 5}'] if when == "queued" else [])
    if when == "sending its body":  # the first half of the body, and then nothing
        raw.incoming.put_nowait({"type": "http.request", "body": b'{"prompt": ', "more_body": True})
    raw.start()
    if when == "queued":
        await wait_until(lambda: ledger.statistics().waiting == 1)
    else:
        await settle()
    raw.disconnect()
    await raw.finish()  # raises whatever escaped the app
    assert statuses == [499]
    assert ledger.statistics().admitted_total == (1 if holder else 0)  # the holder only
    stats = ledger.statistics()
    assert (stats.waiting, stats.reserved_bytes) == (0, 100 if holder else 0)


async def test_a_server_that_raises_on_a_closed_connection_does_not_turn_the_departure_into_an_error() -> None:
    """ASGI lets a server raise OSError from send() once the client has gone."""
    ledger = Ledger(100)
    holder = await ledger.reserve(100)
    raw = RawClient(make_app(ledger, echo), http_scope(), [b'{"prompt": "a", "max_tokens": 5}'])
    gone = False

    async def send(message: dict[str, Any]) -> None:
        if gone:
            raise ConnectionResetError("the client has gone")
        raw.sent.append(message)

    raw.send = send  # type: ignore[method-assign]
    raw.start()
    await wait_until(lambda: ledger.statistics().waiting == 1)
    gone = True
    raw.disconnect()
    await raw.finish()  # nothing escapes
    assert raw.sent == [] and ledger.statistics().waiting == 0
    holder.release()


async def test_an_error_answer_before_the_body_read_is_passed_through_not_called_unadmitted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A tagged route refused on its way to the endpoint (a dependency's 401, Starlette's per-route
    body limit on a Content-Length over it) did no GPU work: its answer goes out as it is, with
    nothing logged; a success without the body read is still the 500 route-not-admitted."""
    from fastapi import HTTPException

    def authorised(request: Request) -> None:
        if request.headers.get("authorization") != "Bearer ok":
            raise HTTPException(401, "no token")

    ledger = Ledger(1000)
    app = FastAPI()

    @app.post("/generate", dependencies=[Depends(authorised)])
    @gpu_bound()
    async def generate(request: Request) -> dict[str, int]:
        return {"bytes": len(await request.body())}

    @gpu_bound()
    async def limited(request: Request) -> PlainTextResponse:
        return PlainTextResponse(str(len(await request.body())))

    app.router.routes.append(Route("/limited", limited, methods=["POST"], max_body_size=8))
    app.add_middleware(GPUAdmissionMiddleware, ledger=ledger, estimator=ONE_BYTE_PER_TOKEN, token_counter=Counter())
    async with client(app) as http:
        unauthorised = await http.post("/generate", json={"prompt": "a"})
        authorised_ = await http.post("/generate", json={"prompt": "a"}, headers={"authorization": "Bearer ok"})
        too_large = await http.post("/limited", json={"prompt": "a b c d e f"})
    assert unauthorised.status_code == 401 and unauthorised.json() == {"detail": "no token"}
    assert authorised_.status_code == 200
    assert too_large.status_code == 413 and too_large.text == "Content Too Large"  # Starlette's own answer
    assert "unadmitted" not in caplog.text
    assert ledger.statistics().admitted_total == 1


@pytest.mark.parametrize("outer", ["gpu_asgi", "logging"])
async def test_a_refusal_through_a_base_http_middleware_is_our_answer_and_nothing_else(outer: str) -> None:
    """BaseHTTPMiddleware runs the app in a task group: the refusal signal comes out of it in a
    group, beside its own "No response returned"; the client gets the 422 and nothing raises."""
    from starlette.middleware.base import BaseHTTPMiddleware, RequestResponseEndpoint
    from starlette.responses import Response

    class Logging(BaseHTTPMiddleware):
        async def dispatch(self, request: Request, call_next: RequestResponseEndpoint) -> Response:
            return await call_next(request)

    ledger = Ledger(1000)
    app = Starlette(routes=[Route("/generate", echo, methods=["POST"])])
    middlewares: list[tuple[Any, dict[str, Any]]] = [
        (Logging, {}), (GPUAdmissionMiddleware, {"ledger": ledger, "estimator": ONE_BYTE_PER_TOKEN, "token_counter": Counter()}),
    ]
    for middleware, options in middlewares if outer == "gpu_asgi" else middlewares[::-1]:
        app.add_middleware(middleware, **options)
    async with client(app) as http:  # raises if anything escapes the app
        ok = await http.post("/generate", json={"prompt": "a b", "max_new_tokens": 2})
        refused = await http.post("/generate", json={"prompt": 5})
    assert ok.status_code == 200 and ok.json()["held"] == 4
    assert refused.status_code == 422 and refused.json()["type"] == "urn:gpu-asgi:problem:invalid-field"


async def test_a_body_read_before_routing_does_not_let_a_tagged_endpoint_run_silently() -> None:
    """Something inside the app reads the body before the router: the endpoint's own read never
    reaches gpu_asgi, so it is not admitted; that is a 500 route-not-admitted, not a quiet 200."""

    def read_early(app: Any) -> Any:
        async def middleware(scope: dict[str, Any], receive: Any, send: Any) -> None:
            body, more = b"", True
            while more:  # before routing: no endpoint in the scope yet
                message = await receive()
                body, more = body + message.get("body", b""), message.get("more_body", False)
            replayed = False

            async def replay() -> dict[str, Any]:
                nonlocal replayed
                if replayed:
                    return await receive()  # type: ignore[no-any-return]
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}

            await app(scope, replay, send)

        return middleware

    @gpu_bound()
    async def generate(request: Request) -> PlainTextResponse:
        return PlainTextResponse(f"generated from {len(await request.body())} bytes")  # would run unadmitted

    ledger = Ledger(1000)
    app = Starlette(routes=[Route("/generate", generate, methods=["POST"])])
    app.add_middleware(read_early)
    app.add_middleware(GPUAdmissionMiddleware, ledger=ledger, estimator=ONE_BYTE_PER_TOKEN, token_counter=Counter())
    async with client(app) as http:
        response = await http.post("/generate", json={"prompt": "a b"})
    assert response.status_code == 500
    assert response.json()["type"] == "urn:gpu-asgi:problem:route-not-admitted"
    assert ledger.statistics().admitted_total == 0


async def test_background_tasks_run_after_the_bytes_are_released() -> None:
    """Documented: Starlette runs background tasks after the last body chunk, and the bytes go
    back with that chunk, so a background task must not use the device."""
    from starlette.background import BackgroundTask

    ledger = Ledger(1000)
    seen: list[int] = []

    @gpu_bound()
    async def generate(request: Request) -> PlainTextResponse:
        await request.body()
        seen.append(ledger.statistics().reserved_bytes)
        return PlainTextResponse("done", background=BackgroundTask(lambda: seen.append(ledger.statistics().reserved_bytes)))

    async with client(make_app(ledger, generate)) as http:
        response = await http.post("/generate", json={"prompt": "a b", "max_new_tokens": 2})
    assert response.status_code == 200
    assert seen == [4, 0]


async def test_an_empty_prompt_string_is_accepted_and_the_message_says_so() -> None:
    ledger = Ledger(1000)
    async with client(make_app(ledger, echo)) as http:
        empty = await http.post("/generate", json={"prompt": "", "max_new_tokens": 2})
        empty_list = await http.post("/generate", json={"prompt": []})
    assert empty.status_code == 200 and empty.json()["prompt_tokens"] == 0
    assert empty_list.status_code == 422
    assert "'prompt' must be a string, a non-empty list of strings" in empty_list.json()["detail"]


class RecordingCounter:
    """A token counter that writes down the thread of every count, then asks ``counter``."""

    def __init__(self, counter: TokenCounter) -> None:
        self.counter = counter
        self.inline_limit = counter.inline_limit
        self.threads: list[int] = []

    def count(self, text: str) -> int:
        self.threads.append(threading.get_ident())
        return self.counter.count(text)


COUNTERS: dict[str, Callable[[], TokenCounter]] = {
    "heuristic": HeuristicTokenCounter,
    "hf-inline": lambda: HFTokenCounter(local_hf_tokenizer()),
    # every prompt here is longer than 4 characters: counted in a worker thread
    "hf-thread": lambda: HFTokenCounter(local_hf_tokenizer(), inline_limit=4),
}


def tagged_app(framework: str, ledger: Ledger, counter: TokenCounter) -> Starlette:
    """The same tagged route on Starlette (the endpoint reads its body) or FastAPI (a body parameter)."""
    if framework == "starlette":
        return make_app(ledger, echo, token_counter=counter)
    app = FastAPI()
    app.add_middleware(GPUAdmissionMiddleware, ledger=ledger, estimator=ONE_BYTE_PER_TOKEN, token_counter=counter)

    @app.post("/generate")
    @gpu_bound()
    async def generate(payload: dict[str, Any], admission: Admission = Depends(gpu_admission)) -> dict[str, Any]:
        return {"prompt_tokens": admission.prompt_tokens}

    return app


@pytest.mark.parametrize(
    ("body", "field", "at"),
    [
        (b'{"prompt": "hello \\ud800 world"}', "prompt", "U+D800) at character 6"),
        (b'{"prompt": "hi \xed\xa0\x80"}', "prompt", "U+D800) at character 3"),  # UTF-8 for one: json.loads lets it through
        (b'{"prompt": ["hello world", "the fox \\udc00"]}', "prompt[1]", "U+DC00) at character 8"),
        (b'{"messages": [{"role": "user", "content": "hello \\ud83d"}]}', "messages[0].content", "U+D83D) at character 6"),
        (
            b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}, '
            b'{"type": "text", "text": "\\ude00 fox"}]}]}',
            "messages[0].content[1].text", "U+DE00) at character 0",
        ),
    ],
)
@pytest.mark.parametrize("counter_kind", ["heuristic", "hf-inline", "hf-thread"])
@pytest.mark.parametrize("framework", ["starlette", "fastapi"])
async def test_prompt_text_that_is_not_valid_unicode_is_one_422_for_every_counter(
    body: bytes, field: str, at: str, counter_kind: str, framework: str
) -> None:
    """A lone surrogate escape is valid JSON (json.loads and FastAPI take it), but no tokenizer can
    read the text: Hugging Face's raises TypeError (a 500), the heuristic would count it. Refused
    before any counter runs, with the same answer whichever counter the middleware has."""
    ledger = Ledger(10_000)
    counter = RecordingCounter(COUNTERS[counter_kind]())
    async with client(tagged_app(framework, ledger, counter)) as http:
        response = await http.post("/generate", content=body, headers={"content-type": "application/json"})
        served = await http.post("/generate", json={"prompt": "hello 🚀 world 显存"})
    assert response.status_code == 422 and response.headers["content-type"] == "application/problem+json"
    problem = response.json()
    assert problem["type"] == "urn:gpu-asgi:problem:invalid-field" and problem["field"] == field
    assert problem["detail"].startswith(f"{field!r} is not valid Unicode: a lone surrogate (")
    assert at in problem["detail"]
    assert served.status_code == 200 and served.json()["prompt_tokens"] > 0  # real non-ASCII text is fine
    assert len(counter.threads) == 1  # only the second request was counted
    assert (counter.threads[0] == threading.get_ident()) == (counter_kind != "hf-thread")
    stats = ledger.statistics()
    assert (stats.admitted_total, stats.reserved_bytes) == (1, 0)


async def test_a_surrogate_pair_escape_is_one_character_and_admitted() -> None:
    """Only a *lone* surrogate is refused: a pair is how JSON escapes a character above U+FFFF."""
    ledger = Ledger(10_000)
    async with client(make_app(ledger, echo, token_counter=HFTokenCounter(local_hf_tokenizer()))) as http:
        response = await http.post(
            "/generate", content=b'{"prompt": "GPU \\ud83d\\ude80"}', headers={"content-type": "application/json"}
        )
    assert response.status_code == 200, response.text
    assert response.json()["prompt_tokens"] == len(local_hf_tokenizer().encode("GPU 🚀", add_special_tokens=False))


# -- a route's own body limit (Starlette >= 1.6, FastAPI: max_body_size=) ------------------------


class AskingLedger(Ledger):
    """A real ledger that writes down every request for bytes the middleware makes of it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.asked: list[int] = []

    def try_reserve(self, nbytes: int, **options: Any) -> Reservation | None:
        self.asked.append(nbytes)
        return super().try_reserve(nbytes, **options)

    async def reserve(self, nbytes: int, **options: Any) -> Reservation:
        self.asked.append(nbytes)
        return await super().reserve(nbytes, **options)


def route_with_body_limit(framework: str, ledger: Ledger, max_body_size: int) -> Any:
    """A tagged route with its own ``max_body_size``: Starlette's ``Route(...)`` or FastAPI's ``@app.post(...)``."""
    import inspect

    pytest.importorskip("starlette.middleware.body_limit", reason="per-route body limits are Starlette >= 1.6")
    if framework == "starlette":
        app: Any = Starlette(routes=[Route("/generate", echo, methods=["POST"], max_body_size=max_body_size)])
    else:
        if "max_body_size" not in inspect.signature(FastAPI.post).parameters:
            pytest.skip("this FastAPI has no per-route max_body_size")
        app = FastAPI()

        @app.post("/generate", max_body_size=max_body_size)
        @gpu_bound()
        async def generate(payload: dict[str, Any], reservation: Reservation = Depends(gpu_reservation)) -> dict[str, Any]:
            return {"held": reservation.nbytes}

    app.add_middleware(GPUAdmissionMiddleware, ledger=ledger, estimator=ONE_BYTE_PER_TOKEN, token_counter=Counter())
    return app


@pytest.mark.parametrize("framework", ["starlette", "fastapi"])
async def test_a_chunked_body_over_the_routes_own_limit_is_our_413_before_anything_is_reserved(framework: str) -> None:
    """Starlette's limiter sits inside gpu_asgi and publishes the route's limit in the scope; its own
    413 would come only after admission, which may have queued for the bytes meanwhile."""
    ledger = AskingLedger(10_000)
    app = route_with_body_limit(framework, ledger, 64)
    body = json.dumps({"prompt": "a " * 60, "max_new_tokens": 5}).encode()  # 140 bytes
    raw = RawClient(app, http_scope(), [body[:70], body[70:]]).start()  # chunked: no Content-Length
    await raw.finish()
    assert raw.status == 413 and raw.header(b"content-type") == b"application/problem+json"
    problem = raw.json()
    assert problem["type"] == "urn:gpu-asgi:problem:body-too-large" and problem["limit_bytes"] == 64
    assert problem["detail"] == "The body is larger than the limit of 64 bytes."
    assert ledger.asked == []  # not even asked: nothing was reserved or queued for, at any moment
    async with client(app) as http:
        small = await http.post("/generate", json={"prompt": "a b", "max_new_tokens": 5})
    assert small.status_code == 200 and small.json()["held"] == 7
    assert ledger.asked == [7] and ledger.statistics().reserved_bytes == 0


@pytest.mark.parametrize(("published", "max_body_bytes", "limit"), [(64, 1 << 20, 64), (1 << 20, 100, 100)])
async def test_the_smaller_of_the_two_limits_is_checked_on_the_content_length_before_a_byte_is_read(
    published: int, max_body_bytes: int, limit: int
) -> None:
    body_limit = pytest.importorskip("starlette.middleware.body_limit", reason="per-route body limits are Starlette >= 1.6")
    ledger = AskingLedger(10_000)
    scope = http_scope(headers=[(b"content-type", b"application/json"), (b"content-length", b"140")])
    scope[body_limit.MAX_BODY_SIZE_SCOPE_KEY] = published  # as Starlette's RequestBodyLimitMiddleware publishes it
    raw = RawClient(make_app(ledger, echo, max_body_bytes=max_body_bytes), scope, [b" " * 140]).start()
    await raw.finish()
    assert raw.status == 413 and raw.header(b"x-gpu-admission-reason") == b"body-too-large"
    assert raw.json()["detail"] == f"The body announces 140 bytes; the limit is {limit}."
    assert raw.incoming.qsize() == 1  # refused on the headers: the body was never read
    assert ledger.asked == []


async def test_a_router_hidden_from_the_startup_check_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    """A middleware that keeps its app out of sight (a closure, not ``.app``) hides the routes from
    the startup check: say so once, instead of passing a tagged GET route silently."""
    @gpu_bound()
    async def both(request: Request) -> PlainTextResponse:
        return PlainTextResponse("ran")

    inner = Starlette(routes=[Route("/generate", both, methods=["GET", "POST"])])

    def hiding(app: Any) -> Any:
        async def middleware(scope: Any, receive: Any, send: Any) -> None:
            await app(scope, receive, send)
        return middleware

    visible = GPUAdmissionMiddleware(inner, ledger=Ledger(100), estimator=ONE_BYTE_PER_TOKEN)
    hidden = GPUAdmissionMiddleware(hiding(inner), ledger=Ledger(100), estimator=ONE_BYTE_PER_TOKEN)
    with caplog.at_level("WARNING", logger="gpu_asgi"):
        async with client(visible) as http:
            with pytest.raises(RuntimeError, match="GET/HEAD/POST /generate"):  # refused: the check saw the route
                await http.get("/generate")
        assert "cannot check the routes" not in caplog.text
        async with client(hidden) as http:
            await http.get("/generate")
            await http.get("/generate")
    assert caplog.text.count("cannot check the routes at startup") == 1
