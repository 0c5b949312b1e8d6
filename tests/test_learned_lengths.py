"""Learned output lengths (``OutputLengths``) and what admission does with them: reserve the
learnt quantile, not ``max_tokens``; grow a reservation whose answer runs past it; learn each
answer's length from what goes out (OpenAI ``usage``, a stream's events) or from the endpoint."""

from __future__ import annotations

import json
import math
import random
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from gpu_asgi import Admission, GPUAdmissionMiddleware, Ledger, LinearEstimator, OutputLengths, gpu_bound

from ._asgi import Words, client

PER_TOKEN = LinearEstimator(bytes_per_token=10)
ROUTE = "POST /v1/completions"
LIMIT = 400


# -- the model ------------------------------------------------------------------------------


def test_cold_start_reserves_the_declared_limit() -> None:
    lengths = OutputLengths(min_samples=4)
    for _ in range(3):
        lengths.observe(10, ROUTE, limit=LIMIT)
    assert lengths.predict(LIMIT, ROUTE) == 400  # 3 answers seen: not enough
    lengths.observe(10, ROUTE, limit=LIMIT)
    assert lengths.predict(LIMIT, ROUTE) == 10


def test_it_converges_on_the_quantile_of_a_known_length_distribution() -> None:
    """Geometric lengths with mean 68 (answers that stop at EOS): the 0.9 quantile is
    ln(10) / -ln(1 - p), about 156 tokens."""
    rng = random.Random(7)
    p = 1 / 68
    lengths = OutputLengths(0.9, window=2000, min_samples=16)
    for _ in range(2000):
        lengths.observe(math.ceil(math.log(1 - rng.random()) / math.log(1 - p)), ROUTE, limit=4096)
    expected = math.log(10) / -math.log(1 - p)
    assert abs(lengths.predict(4096, ROUTE) - expected) / expected < 0.1
    assert lengths.predict(2100, ROUTE) == lengths.predict(4096, ROUTE)  # one band of limits: 2,049 to 4,096


def test_a_prediction_is_learnt_among_answers_with_a_limit_in_the_same_band() -> None:
    lengths = OutputLengths(0.9, min_samples=4)
    for _ in range(8):
        lengths.observe(300, ROUTE, limit=500)
    assert lengths.predict(400, ROUTE) == 300  # 257 to 512: the same band
    assert lengths.predict(280, ROUTE) == 280  # never above the request's own limit
    assert lengths.predict(256, ROUTE) == 256  # another band: nothing known, the limit
    assert lengths.predict(1000, ROUTE) == 1000
    assert lengths.survival(0, 100, 180, ROUTE) == 1.0  # nothing known in its band: it goes on
    for _ in range(8):
        lengths.observe(180, ROUTE, limit=180, truncated=True)  # runs to its limit (ignore_eos)
    assert lengths.predict(180, ROUTE) == 180
    assert lengths.predict(400, ROUTE) == 300  # the other band is as it was
    assert {(r.limits, r.samples, r.predicted_tokens) for r in lengths.statistics()} == {
        ((257, 512), 8, 300), ((129, 256), 8, None)
    }


def test_the_chance_an_answer_goes_on_is_counted_among_those_that_got_as_far() -> None:
    lengths = OutputLengths(min_samples=4)
    assert lengths.survival(0, 100, LIMIT, ROUTE) == 1.0  # nothing seen: it goes on
    for length in (80, 10, 70, 20, 60, 30, 50, 40):  # not rising: within what the first four predict
        lengths.observe(length, ROUTE, limit=LIMIT)
    # Counted as if one more answer had got as far and gone on to its limit:
    assert lengths.survival(0, 40, LIMIT, ROUTE) == 5 / 9  # 4 of 8 were longer than 40
    assert lengths.survival(20, 40, LIMIT, ROUTE) == 5 / 7  # of the 6 longer than 20, 4 went past 40
    assert lengths.survival(40, 30, LIMIT, ROUTE) == 1.0  # it is already past 30
    assert lengths.survival(50, 60, LIMIT, ROUTE) == 3 / 4  # 2 of the 3 past 50 went past 60
    assert lengths.survival(70, 90, LIMIT, ROUTE) == 1 / 2  # 1 got past 70: it says little
    assert lengths.survival(80, 90, LIMIT, ROUTE) == 1.0  # none got past 80: nothing known
    assert lengths.survival(0, 80, LIMIT, ROUTE) == 1 / 9  # none of 8 went past 80
    lengths.observe(30, ROUTE, truncated=True, limit=LIMIT)  # cut by its limit: it would have gone on past any
    assert lengths.survival(0, 300, LIMIT, ROUTE) == 2 / 10
    assert lengths.survival(0, LIMIT, LIMIT, ROUTE) == 0.0  # nothing goes on past its own limit


def test_answers_cut_by_their_limit_count_as_at_least_that_limit() -> None:
    lengths = OutputLengths(0.5, min_samples=4)
    for _ in range(3):
        lengths.observe(50, ROUTE, truncated=True, limit=LIMIT)  # would have gone on
    lengths.observe(10, ROUTE, limit=LIMIT)
    assert lengths.predict(LIMIT, ROUTE) == 400  # the median is censored: the limit, whatever it is
    for _ in range(4):
        lengths.observe(10, ROUTE, limit=LIMIT)
    assert lengths.predict(LIMIT, ROUTE) == 10


def test_a_tenant_with_enough_answers_of_its_own_is_predicted_from_them() -> None:
    lengths = OutputLengths(0.9, min_samples=4)
    for _ in range(8):
        lengths.observe(300, ROUTE, "long", limit=LIMIT)
    for _ in range(40):
        lengths.observe(20, ROUTE, "short", limit=LIMIT)
    assert lengths.predict(LIMIT, ROUTE, "long") == 300
    assert lengths.predict(LIMIT, ROUTE, "short") == 20
    assert lengths.predict(LIMIT, ROUTE, "new") == 300  # the route's: 8 of its 48 answers are 300
    assert lengths.predict(LIMIT, "POST /other", "short") == LIMIT  # nothing known of that route


def test_its_memory_is_bounded_and_follows_changing_traffic() -> None:
    lengths = OutputLengths(0.5, window=10, min_samples=5, max_keys=3)
    for _ in range(10):
        lengths.observe(300, ROUTE, limit=LIMIT)
    for _ in range(10):
        lengths.observe(20, ROUTE, limit=LIMIT)  # the traffic changed: the old answers left the window
    assert lengths.predict(LIMIT, ROUTE) == 20
    for tenant in ("a", "b", "c", "d"):
        lengths.observe(5, ROUTE, tenant, limit=LIMIT)
    rows = lengths.statistics()
    # max_keys: the least recently seen keys went first (the route's own is seen with every answer)
    assert {(r.route, r.tenant) for r in rows} == {(ROUTE, None), (ROUTE, "c"), (ROUTE, "d")}
    assert all(r.samples <= 10 for r in rows)


def test_survival_is_not_trusted_while_answers_run_past_what_was_learnt() -> None:
    """Short answers learnt, then the traffic changes to long ones: while more of the last answers
    ran past the prediction than the quantile allows, an answer is said to go on (pooled growth
    then holds all of it); once the window has followed the change, survival is counted again."""
    lengths = OutputLengths(0.9, window=64, min_samples=8)
    rng = random.Random(3)
    learnt = [rng.randint(10, 50) for _ in range(64)]
    for length in learnt:
        lengths.observe(length, ROUTE, limit=LIMIT)
    past_20 = sum(length > 20 for length in learnt)
    assert lengths.survival(20, 100, LIMIT, ROUTE) == 1 / (past_20 + 1)  # none of those past 20 went past 100
    assert not lengths.statistics()[0].drifting
    long_ones = 0
    while not lengths.statistics()[0].drifting and long_ones < 64:
        lengths.observe(300, ROUTE, limit=LIMIT)  # past the 0.9 quantile (about 50) every time
        long_ones += 1
    assert long_ones <= 8  # noticed within a few answers: of the last 16, 1.6 are past it by chance
    assert lengths.predict(LIMIT, ROUTE) < 300  # the window has not followed yet
    assert lengths.survival(20, 100, LIMIT, ROUTE) == 1.0
    for _ in range(64):
        lengths.observe(300, ROUTE, limit=LIMIT)
    assert not lengths.statistics()[0].drifting  # settled on the new lengths
    assert lengths.survival(20, 350, LIMIT, ROUTE) == 1 / 65  # none of 64 went past 350


def test_answers_that_end_within_the_quantile_by_chance_are_not_drifting() -> None:
    lengths = OutputLengths(0.9, window=256, min_samples=16)
    rng = random.Random(11)
    drifted = 0
    for _ in range(5000):
        lengths.observe(math.ceil(math.log(1 - rng.random()) / math.log(1 - 1 / 68)), ROUTE, limit=LIMIT)
        drifted += lengths.statistics()[0].drifting
    assert drifted < 5000 * 0.01  # three standard deviations: rarely by chance


@pytest.mark.parametrize("options", [{"quantile": 0}, {"quantile": 1.5}, {"window": 0}, {"min_samples": 0},
                                     {"window": 4, "min_samples": 5}, {"max_keys": 0}])
def test_bad_settings_are_refused(options: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        OutputLengths(**options)


# -- admission with learned lengths -----------------------------------------------------------


def app_with(ledger: Ledger, lengths: OutputLengths | None, endpoint: Any) -> Starlette:
    app = Starlette(routes=[Route("/v1/completions", endpoint, methods=["POST"])])
    app.add_middleware(
        GPUAdmissionMiddleware, ledger=ledger, estimator=PER_TOKEN, token_counter=Words(), output_lengths=lengths
    )
    return app


def body(max_tokens: int = 400) -> dict[str, Any]:
    return {"prompt": "one two three four", "max_tokens": max_tokens}


async def reserved_per_request(lengths: OutputLengths | None, count: int) -> list[int]:
    """What each of ``count`` requests held, each answered with 30 tokens of OpenAI ``usage``."""
    ledger = Ledger(10**6)
    held: list[int] = []

    @gpu_bound()
    async def completions(request: Request) -> Response:
        await request.body()
        held.append(ledger.statistics().reserved_bytes)
        return JSONResponse({"choices": [{"text": "x", "finish_reason": "stop"}], "usage": {"completion_tokens": 30}})

    async with client(app_with(ledger, lengths, completions)) as http:
        for _ in range(count):
            assert (await http.post("/v1/completions", json=body())).status_code == 200
    assert ledger.statistics().reserved_bytes == 0
    return held


async def test_a_warm_route_reserves_the_prediction_and_learns_from_usage() -> None:
    lengths = OutputLengths(0.9, min_samples=4)
    held = await reserved_per_request(lengths, 5)
    assert held[:4] == [(4 + 400) * 10] * 4  # cold: prompt + max_tokens
    assert held[4] == (4 + 30) * 10  # warm: prompt + the learnt 30
    assert lengths.statistics()[0].samples == 5


@pytest.mark.parametrize("learned", [True, False])
async def test_an_admission_tells_the_chance_its_answer_goes_on(learned: bool) -> None:
    """``Admission.survival``: from the route's answers when learning (30 tokens each here), else
    certain until the limit (strict: nothing is known)."""
    lengths = OutputLengths(0.9, min_samples=4) if learned else None
    chances: list[tuple[float, float, float]] = []

    @gpu_bound()
    async def completions(request: Request) -> Response:
        await request.body()
        admission: Admission = request.state.gpu_admission
        chances.append((admission.survival(0, 20), admission.survival(0, 30), admission.survival(0, 400)))
        return JSONResponse({"choices": [{"text": "x", "finish_reason": "stop"}], "usage": {"completion_tokens": 30}})

    async with client(app_with(Ledger(10**6), lengths, completions)) as http:
        for _ in range(5):
            assert (await http.post("/v1/completions", json=body())).status_code == 200
    assert chances[0] == (1.0, 1.0, 0.0)  # nothing seen yet; its limit ends it at 400
    assert chances[4] == ((1.0, 1 / 5, 0.0) if learned else (1.0, 1.0, 0.0))  # 4 answers of 30 seen


async def test_strict_is_the_default_and_reserves_the_limit() -> None:
    assert set(await reserved_per_request(None, 20)) == {(4 + 400) * 10}


def sse(events: list[dict[str, Any]]) -> list[bytes]:
    return [f"data: {json.dumps(event)}\n\n".encode() for event in events] + [b"data: [DONE]\n\n"]


async def test_a_stream_past_its_prediction_grows_its_reservation_and_is_learnt() -> None:
    ledger = Ledger(10**6)
    lengths = OutputLengths(0.9, min_samples=4)
    for _ in range(4):
        lengths.observe(20, ROUTE, limit=LIMIT)
    seen: list[int] = []

    @gpu_bound()
    async def completions(request: Request) -> Response:
        await request.body()

        async def tokens() -> Any:
            for i in range(100):
                seen.append(ledger.statistics().reserved_bytes)
                finish = "stop" if i == 99 else None
                # two events split across chunks: the meter reassembles them
                (chunk,) = sse([{"choices": [{"index": 0, "text": "t", "finish_reason": finish}]}])[:1]
                yield chunk[:7]
                yield chunk[7:]
            yield b"data: [DONE]\n\n"

        return StreamingResponse(tokens(), media_type="text/event-stream")

    async with client(app_with(ledger, lengths, completions)) as http:
        response = await http.post("/v1/completions", json=body())
    assert response.status_code == 200
    assert seen[0] == (4 + 20) * 10  # the prediction
    assert max(seen) >= (4 + 99) * 10  # grew as the stream ran past it
    assert max(seen) <= (4 + 400) * 10  # never past the declared limit
    assert len(set(seen)) < 10  # in a few steps, not at every token
    assert ledger.statistics().reserved_bytes == 0  # and every byte came back
    assert lengths.predict(400, ROUTE) == 100  # 1 of 5 answers is 100 tokens: the 0.9 quantile


async def test_a_stream_cut_by_its_limit_is_learnt_as_censored() -> None:
    ledger = Ledger(10**6)
    lengths = OutputLengths(0.5, min_samples=1)

    @gpu_bound()
    async def completions(request: Request) -> Response:
        await request.body()
        events = [{"choices": [{"index": 0, "text": "t", "finish_reason": None}]}] * 9
        events.append({"choices": [{"index": 0, "text": "t", "finish_reason": "length"}]})
        return StreamingResponse(iter(sse(events)), media_type="text/event-stream")

    async with client(app_with(ledger, lengths, completions)) as http:
        assert (await http.post("/v1/completions", json=body(10))).status_code == 200
    assert lengths.statistics()[0].censored == 1
    assert lengths.predict(400, ROUTE) == 400


async def test_an_endpoint_of_another_shape_reports_its_tokens_and_grows_before_it_allocates() -> None:
    ledger = Ledger(10**6)
    lengths = OutputLengths(0.9, min_samples=1)
    lengths.observe(10, ROUTE, limit=LIMIT)
    grown: list[int] = []

    @gpu_bound()
    async def completions(request: Request) -> Response:
        await request.body()
        admission: Admission = request.state.gpu_admission
        assert admission.reserved_tokens == 10 and admission.max_new_tokens == 400
        for step in range(1, 61):
            grown.append(admission.report_tokens(step))  # before decoding token `step`
        admission.report_tokens(60, done=True)
        return Response(b"plain text, no usage")

    async with client(app_with(ledger, lengths, completions)) as http:
        assert (await http.post("/v1/completions", json=body())).status_code == 200
    # at 11 tokens to cover 27 (a step of 16 ahead), at 28 to 44, at 45 to 61
    assert sum(grown) == (4 + 61) * 10 - (4 + 10) * 10
    assert grown[9] == 0 and grown[10] > 0  # nothing until it passed the 10 reserved
    assert sorted(r.samples for r in lengths.statistics()) == [2]
    assert ledger.statistics().reserved_bytes == 0


async def test_an_error_answer_teaches_nothing() -> None:
    ledger = Ledger(10**6)
    lengths = OutputLengths(0.9, min_samples=1)

    @gpu_bound()
    async def completions(request: Request) -> Response:
        await request.body()
        return JSONResponse({"error": "boom", "usage": {"completion_tokens": 3}}, status_code=500)

    async with client(app_with(ledger, lengths, completions)) as http:
        assert (await http.post("/v1/completions", json=body())).status_code == 500
    assert lengths.statistics() == ()


def test_learning_needs_a_ledger_that_can_grow() -> None:
    class NoGrow(Ledger):
        grow = None  # type: ignore[assignment]

    with pytest.raises(ValueError, match="grow"):
        GPUAdmissionMiddleware(Starlette(), ledger=NoGrow(10), estimator=PER_TOKEN, output_lengths=OutputLengths())


async def test_what_was_learnt_shows_in_health_and_metrics() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from gpu_asgi import GPUMetrics, health_report

    ledger = Ledger(10**6)
    lengths = OutputLengths(0.9, min_samples=2)
    metrics = GPUMetrics(ledger, registry=CollectorRegistry())

    @gpu_bound()
    async def completions(request: Request) -> Response:
        await request.body()
        events = [{"choices": [{"index": 0, "text": "t", "finish_reason": None}]}] * 60
        return StreamingResponse(iter(sse(events)), media_type="text/event-stream")

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])
    app.add_middleware(
        GPUAdmissionMiddleware, ledger=ledger, estimator=PER_TOKEN, token_counter=Words(), output_lengths=lengths,
        metrics=metrics,
    )
    lengths.observe(10, ROUTE, limit=LIMIT)
    lengths.observe(10, ROUTE, limit=LIMIT)
    async with client(app) as http:
        assert (await http.post("/v1/completions", json=body())).status_code == 200
    (row,) = health_report(ledger, output_lengths=lengths)["output_lengths"]
    assert row == {"route": ROUTE, "tenant": None, "limits": (257, 512), "samples": 3, "censored": 0,
                   "predicted_tokens": 60, "drifting": False}
    text = generate_latest(metrics.registry).decode()
    assert "gpu_asgi_reservation_grown_bytes_total" in text
    grown = next(line for line in text.splitlines() if line.startswith("gpu_asgi_reservation_grown_bytes_total"))
    assert float(grown.split()[-1]) > 0
    share = next(line for line in text.splitlines() if line.startswith("gpu_asgi_reserved_output_share_sum"))
    assert float(share.split()[-1]) == pytest.approx(10 / 400)


@pytest.mark.parametrize(
    ("answer", "media_type", "tokens", "censored"),
    [
        # chat, streamed with include_usage: the last event's usage counts, not the events
        ([{"choices": [{"index": 0, "delta": {"role": "assistant"}}]}]
         + [{"choices": [{"index": 0, "delta": {"content": "t"}, "finish_reason": None}]}] * 5
         + [{"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 7, "total_tokens": 11}}],
         "text/event-stream", 7, 0),
        # responses, streamed: its deltas, then response.completed with usage.output_tokens
        ([{"type": "response.created", "response": {"usage": None}}]
         + [{"type": "response.output_text.delta", "delta": "t"}] * 3
         + [{"type": "response.completed", "response": {"status": "completed", "usage": {"output_tokens": 9}}}],
         "text/event-stream", 9, 0),
        # responses, one JSON body cut by its limit
        ({"status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"}, "usage": {"output_tokens": 12}},
         "application/json", 12, 1),
        # chat, one JSON body with two choices (n=2 is asked below): tokens per sequence
        ({"choices": [{"finish_reason": "stop"}, {"finish_reason": "stop"}], "usage": {"completion_tokens": 20}},
         "application/json", 10, 0),
    ],
)
async def test_openai_shapes_are_metered(answer: Any, media_type: str, tokens: int, censored: int) -> None:
    ledger = Ledger(10**6)
    lengths = OutputLengths(0.5, min_samples=1)

    @gpu_bound()
    async def completions(request: Request) -> Response:
        await request.body()
        if media_type == "application/json":
            return JSONResponse(answer)
        return StreamingResponse(iter([f"data: {json.dumps(e)}\n\n".encode() for e in answer]), media_type=media_type)

    n = 2 if isinstance(answer, dict) and len(answer.get("choices", ())) == 2 else 1
    async with client(app_with(ledger, lengths, completions)) as http:
        assert (await http.post("/v1/completions", json={**body(), "n": n})).status_code == 200
    (row,) = lengths.statistics()
    assert (row.samples, row.censored) == (1, censored)
    assert row.predicted_tokens == (None if censored else tokens)
