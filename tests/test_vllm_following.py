"""Reservations that follow vLLM's answers (gpu_asgi/_vllm/following.py), with vLLM's request
states played by plain objects and the in-process ledger: what each reservation and the
forecast's hold after a reading, and who is admitted on what they give back."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from prometheus_client import CollectorRegistry

from gpu_asgi import Ledger
from gpu_asgi._asgi.dependencies import ADMISSION_STATE_KEY
from gpu_asgi._vllm.following import FORECAST_TENANT, Following, vllm_key
from gpu_asgi._vllm.held import MAX_SHARE
from gpu_asgi._vllm.held import spacing_after as spacing
from gpu_asgi.vllm import VLLMAdmission

from .test_vllm_admission import vllm_state

BLOCK = 128
BLOCK_BYTES = 1000
PROMPT = 20
PREDICTED = 157  # a learned 0.9 quantile of answers that end early: prompt + it takes 2 blocks


class Engine:
    """vLLM's AsyncLLM as far as following reads it: ``output_processor.request_states``."""

    def __init__(self) -> None:
        self.output_processor = SimpleNamespace(request_states={})

    def run(self, external_id: str, tokens: int) -> None:
        detokenizer = SimpleNamespace(num_output_tokens=lambda: tokens)
        self.output_processor.request_states[external_id] = SimpleNamespace(
            request_id=f"{external_id}-internal", external_req_id=external_id, detokenizer=detokenizer
        )

    def finish(self, external_id: str) -> None:
        del self.output_processor.request_states[external_id]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def admitted(ledger: Ledger, following: Following, request_id: str | None, *, batch: int = 1) -> Any:
    """A request admitted as the middleware does, on its static learned reservation."""
    headers = [] if request_id is None else [(b"x-request-id", request_id.encode())]
    scope, followed = following.enter({"type": "http", "headers": headers})
    reservation = await ledger.reserve(2 * BLOCK_BYTES * batch)
    grown: list[bool] = []
    admission = SimpleNamespace(
        reservation=reservation, prompt_tokens=PROMPT, max_new_tokens=400, batch=batch,
        reserved_tokens=PREDICTED, endpoint_grows=lambda: grown.append(True), grown=grown,
    )
    followed.state[ADMISSION_STATE_KEY] = admission
    return scope, followed, admission


async def setup(blocks: int = 4) -> tuple[Ledger, Engine, Clock, Following]:
    ledger, engine, clock = Ledger(blocks * BLOCK_BYTES), Engine(), Clock()
    following = Following(ledger, engine, block_size=BLOCK, bytes_per_block=BLOCK_BYTES, interval=0.05, clock=clock)
    await following.tick()  # takes the forecast's reservation, empty
    return ledger, engine, clock, following


def test_vllm_names_requests_from_the_header() -> None:
    assert vllm_key("cmpl-gpuasgi-abc-0") == ("gpuasgi-abc", 0)
    assert vllm_key("cmpl-client-id-1-2") == ("client-id-1", 2)
    assert vllm_key("chatcmpl-client-id-1") == ("client-id-1", 0)
    assert vllm_key("resp_123") == ("resp_123", 0)


async def test_a_request_id_is_added_where_the_client_sent_none_and_kept_where_it_did() -> None:
    _, _, _, following = await setup()
    scope, followed = following.enter({"type": "http", "headers": [(b"host", b"x")]})
    assert followed.request_id.startswith("gpuasgi-") and len(followed.request_id) == 8 + 32
    assert (b"x-request-id", followed.request_id.encode()) in scope["headers"]
    assert scope["state"] is followed.state
    original = {"type": "http", "headers": [(b"X-Request-Id", b"mine")]}
    scope, followed = following.enter(original)
    assert scope is original and followed.request_id == "mine"
    following.leave(followed)
    assert "mine" not in following._followed


async def test_answers_at_different_points_share_the_blocks_their_futures_leave_free() -> None:
    ledger, engine, clock, following = await setup(blocks=4)
    _, first, a = await admitted(ledger, following, "a")
    _, second, b = await admitted(ledger, following, "b")
    assert ledger.statistics().reserved_bytes == 4 * BLOCK_BYTES  # full: each holds its 2 blocks
    waiting = asyncio.ensure_future(ledger.reserve(BLOCK_BYTES))
    await asyncio.sleep(0)
    # Both just started: each holds 1 block now, and both take their second at the same step.
    engine.run("cmpl-a-0", 0)
    engine.run("cmpl-b-0", 0)
    following.resize()
    assert (a.reservation.nbytes, b.reservation.nbytes, following.forecast.nbytes) == (1000, 1000, 2000)
    assert a.grown == [True] and b.grown == [True]  # their streams' meters no longer grow them
    assert not waiting.done()
    # One is 100 tokens in: it takes its second block within a few steps and ends 57 steps on,
    # long before the other needs its second. Together they never hold more than 3 blocks.
    clock.now = 1.0
    engine.run("cmpl-a-0", 100)
    following.resize()
    assert (a.reservation.nbytes, b.reservation.nbytes) == (1000, 1000)
    assert following.forecast.nbytes == 1000
    assert ledger.statistics().reserved_bytes == 3 * BLOCK_BYTES + BLOCK_BYTES  # the waiter came in
    granted = await asyncio.wait_for(waiting, 1)
    # vLLM finished the first: it holds nothing, and the second alone peaks at 2 blocks.
    engine.finish("cmpl-a-0")
    following.resize()
    assert (a.reservation.nbytes, b.reservation.nbytes, following.forecast.nbytes) == (0, 1000, 1000)
    for reservation in (a.reservation, b.reservation, granted):
        reservation.release()
    following.leave(first)
    following.leave(second)
    following.resize()
    assert ledger.statistics().reserved_bytes == 0


async def test_an_answer_past_its_prediction_is_forecast_a_step_further_and_may_overshoot() -> None:
    ledger, engine, _, following = await setup(blocks=2)
    _, _, a = await admitted(ledger, following, "a")
    engine.run("chatcmpl-a", 250)  # past 157 and into a third block: held at 3, past the budget
    following.resize()
    assert a.reservation.nbytes == 3 * BLOCK_BYTES
    assert ledger.statistics().reserved_bytes == 3 * BLOCK_BYTES  # overshoot: nobody new until under
    assert await ledger.reserve_if_free(1) is None


@pytest.mark.parametrize(("growth", "forecast_blocks"), [(None, 10), (0.99, 8), (0.9, 6)])
async def test_pooled_growth_holds_the_quantile_of_what_the_answers_may_take(
    growth: float | None, forecast_blocks: int
) -> None:
    """Ten fresh answers whose route's answers went past one block three times in five and never
    past two: all of their growth to their predictions is 10 blocks. Pooled
    (``GPU_ASGI_GROWTH``, to their limits), the set holds 2 blocks for each answer still running
    when they take their second, from the chance each answer reports (``Admission.survival``):
    the 0.99 quantile of Binomial(10, 0.6) is 9, so 18 blocks, 8 beyond the 10 they hold; 0.9: 8,
    so 6 beyond."""
    ledger, engine, _, following = await setup(blocks=20)
    following.growth_quantile = growth
    asked: list[tuple[int, int]] = []
    for name in "abcdefghij":
        _, _, admission = await admitted(ledger, following, name)
        admission.survival_curve = lambda tokens: lambda later, tokens=tokens: (  # type: ignore[misc]
            asked.append((tokens, later)) or (0.6 if later < 230 else 0.0)
        )
        engine.run(f"cmpl-{name}-0", 1)
    following.resize()
    assert following.forecast.nbytes == forecast_blocks * BLOCK_BYTES
    assert ledger.statistics().reserved_bytes == (10 + forecast_blocks) * BLOCK_BYTES
    # Asked from where each answer is, for the step before its second block starts (token 108):
    # counted at a step if it ran in the one before, as vLLM may free an ender's blocks a step late.
    assert (asked[0] if growth else None) == ((1, 107) if growth else None)


async def test_pooled_an_ending_answer_lends_its_blocks_and_hands_them_over_when_it_ends() -> None:
    """Pooled growth counts an answer's blocks only while it may still run: one about to end lends
    its 2 blocks to a fresh answer's second, so a waiter comes in on the block all of the growth
    would hold. When the ending answer's response ends, its bytes go to the forecast's
    reservation, not to the next waiter (admitted on them, it would take the block the fresh
    answer's growth was promised: a preemption); the next reading gives back what the set no
    longer needs."""
    ledger, engine, _, following = await setup(blocks=4)
    following.growth_quantile = 0.99
    _, ending_followed, ending = await admitted(ledger, following, "a")
    _, _, fresh = await admitted(ledger, following, "b")
    ending.survival_curve = lambda tokens: lambda later: 1.0 if later < 210 else 0.0
    fresh.survival_curve = lambda tokens: lambda later: 1.0 if later < 200 else 0.0
    engine.run("cmpl-a-0", 200)
    engine.run("cmpl-b-0", 1)
    first = asyncio.ensure_future(ledger.reserve(BLOCK_BYTES))
    await asyncio.sleep(0)
    following.resize()
    # Now 2 + 1 blocks; at the fresh one's second block the ending one has gone: 3 at most.
    assert (ending.reservation.nbytes, fresh.reservation.nbytes, following.forecast.nbytes) == (2000, 1000, 0)
    granted = await asyncio.wait_for(first, 1)  # all of the growth would have held the 4th block
    second = asyncio.ensure_future(ledger.reserve(2 * BLOCK_BYTES))
    engine.finish("cmpl-a-0")
    ending.reservation.release()  # its response ends before the next reading
    following.leave(ending_followed)
    assert following.forecast.nbytes == 2 * BLOCK_BYTES
    assert not await asyncio.wait_for(asyncio.shield(asyncio.sleep(0.01, result=second.done())), 1)
    following.resize()  # the fresh answer alone peaks at 2 blocks: 1 of the 2 handed over goes back
    assert following.forecast.nbytes == BLOCK_BYTES
    assert ledger.statistics().reserved_bytes == 3 * BLOCK_BYTES and not second.done()
    second.cancel()
    for reservation in (fresh.reservation, granted):
        reservation.release()
    assert following.forecast.nbytes == 2 * BLOCK_BYTES  # handed over again, until the next reading
    engine.finish("cmpl-b-0")
    following.resize()
    assert ledger.statistics().reserved_bytes == 0


async def test_pooled_growth_looks_past_the_prediction_to_the_limit() -> None:
    """An answer within its prediction (157 tokens: 2 blocks with its prompt) whose route's answers
    went on half the time may still run to its limit of 400 (4 blocks): pooled growth holds the
    blocks it may take until then, not only until its prediction, as all of the growth does."""
    ledger, engine, _, following = await setup(blocks=20)
    following.growth_quantile = 0.99
    _, _, admission = await admitted(ledger, following, "a")
    admission.survival_curve = lambda tokens: lambda later: 0.5
    engine.run("cmpl-a-0", 1)
    following.resize()
    assert (admission.reservation.nbytes, following.forecast.nbytes) == (BLOCK_BYTES, 3 * BLOCK_BYTES)
    following.growth_quantile = None  # all of the growth, to the prediction
    following.resize()
    assert following.forecast.nbytes == BLOCK_BYTES


class Growth:
    """The metrics as far as following writes them: bytes forecast past an admitted peak."""

    def __init__(self) -> None:
        self.grown: list[int] = []

    def record_growth(self, nbytes: int) -> None:
        self.grown.append(nbytes)


async def test_what_an_answer_is_forecast_past_its_admitted_peak_is_counted_as_growth_once() -> None:
    ledger, engine, clock = Ledger(8 * BLOCK_BYTES), Engine(), Clock()
    metrics = Growth()
    following = Following(
        ledger, engine, block_size=BLOCK, bytes_per_block=BLOCK_BYTES, clock=clock, metrics=metrics  # type: ignore[arg-type]
    )
    await following.tick()
    _, _, a = await admitted(ledger, following, "a")  # admitted on 2 blocks
    engine.run("chatcmpl-a", 100)  # within its prediction: nothing past it
    following.resize()
    assert metrics.grown == []
    engine.run("chatcmpl-a", 250)  # past 157: forecast to 250 + a quarter, 3 blocks with its prompt
    following.resize()
    assert metrics.grown == [BLOCK_BYTES]
    following.resize()  # the same reading again: counted once
    assert metrics.grown == [BLOCK_BYTES]
    engine.run("chatcmpl-a", 390)  # now forecast to its limit of 400: 4 blocks
    following.resize()
    assert metrics.grown == [BLOCK_BYTES, BLOCK_BYTES]
    assert a.reservation.nbytes == 4 * BLOCK_BYTES


@pytest.mark.parametrize("case", ["not started", "two with one id", "several prompts", "some sequences"])
async def test_what_cannot_be_followed_keeps_what_admission_gave_it(case: str) -> None:
    ledger, engine, _, following = await setup(blocks=6)
    _, _, a = await admitted(ledger, following, "a", batch=2 if case == "some sequences" else 1)
    if case == "two with one id":
        await admitted(ledger, following, "a")
        engine.run("cmpl-a-0", 10)
    elif case == "several prompts":
        engine.run("cmpl-a-0", 10)
        engine.run("cmpl-a-1", 10)
    elif case == "some sequences":
        engine.run("cmpl-a-0", 10)  # one of its two sequences is there so far
    held = a.reservation.nbytes
    following.resize()
    assert a.reservation.nbytes == held and following.forecast.nbytes == 0 and a.grown == []


def test_readings_that_take_long_are_spaced_out_to_a_tenth_of_the_time() -> None:
    """A reading of hundreds of answers must not take the API server's event loop from vLLM."""
    assert spacing(0.05, 0.001) == 0.05
    assert spacing(0.05, 0.02) == pytest.approx(0.2)
    assert spacing(0.05, 0.02) * MAX_SHARE == pytest.approx(0.02)


async def test_the_loop_takes_the_forecast_reservation_and_gives_it_back() -> None:
    ledger, engine = Ledger(4 * BLOCK_BYTES), Engine()
    following = Following(ledger, engine, block_size=BLOCK, bytes_per_block=BLOCK_BYTES, interval=0.01)
    assert Following.available(engine) and not Following.available(SimpleNamespace())
    following.start()
    _, _, a = await admitted(ledger, following, "a")
    engine.run("cmpl-a-0", 0)
    for _ in range(100):
        await asyncio.sleep(0.01)
        if a.reservation.nbytes == BLOCK_BYTES:
            break
    assert following.forecast is not None and following.forecast.tenant == FORECAST_TENANT
    assert (a.reservation.nbytes, following.forecast.nbytes) == (BLOCK_BYTES, BLOCK_BYTES)
    await following.stop()
    a.reservation.release()
    assert ledger.statistics().reserved_bytes == 0


# -- through a vLLM-shaped app ----------------------------------------------------------


def vllm_app(environ: dict[str, str]) -> Any:
    state = vllm_state()
    state.engine_client.output_processor = SimpleNamespace(request_states={})
    app = FastAPI()
    for name, value in vars(state).items():
        setattr(app.state, name, value)

    async def seen(request: Request) -> dict[str, Any]:
        await request.body()
        return {"request_id": request.headers.get("x-request-id"), "admitted": hasattr(request.state, "gpu_admission")}

    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings"):
        app.add_api_route(path, seen, methods=["POST"])
    app.add_middleware(VLLMAdmission, environ=environ, registry=CollectorRegistry())
    return app


@pytest.mark.parametrize(("environ", "follows"), [({}, True), ({"GPU_ASGI_FOLLOW": "0"}, False),
                                                  ({"GPU_ASGI_RESERVE": "strict"}, False)])
async def test_vllm_is_told_a_request_id_on_the_routes_followed(environ: dict[str, str], follows: bool) -> None:
    app = vllm_app(environ)
    async with app.router.lifespan_context(app), httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://vllm"
    ) as client:
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 8}
        response = await client.post("/v1/completions", json=body)
        answer = response.json()
        assert response.status_code == 200, answer
        assert answer["admitted"]
        assert (answer["request_id"] or "").startswith("gpuasgi-") is follows
        mine = await client.post("/v1/completions", json=body, headers={"x-request-id": "mine-1"})
        assert mine.json()["request_id"] == "mine-1"
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        assert ((await client.post("/v1/chat/completions", json=chat)).json()["request_id"] or "").startswith(
            "gpuasgi-") is follows
        for path in ("/v1/responses", "/v1/embeddings"):
            assert (await client.post(path, json={"model": "tiny", "input": "hi"})).json()["request_id"] is None
