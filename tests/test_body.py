"""Body reading under a deadline, headers and JSON as FastAPI reads them."""

from __future__ import annotations

import asyncio
import json

import pytest

from gpu_asgi import BodyTimeout, BodyTooLarge, InvalidField, InvalidJSON, RouteSpec
from gpu_asgi._admission.body import check_headers, parse_request, read_body
from gpu_asgi._timers import DelayedCalls

from ._asgi import http_scope, in_threads


async def never() -> dict[str, object]:
    await asyncio.Event().wait()
    raise AssertionError


async def test_a_read_past_its_deadline_times_out_and_the_task_goes_on() -> None:
    with pytest.raises(BodyTimeout):
        await read_body(never, 100, DelayedCalls(0.03))
    await asyncio.sleep(0.01)  # the timer's cancellation was its own: the task keeps running normally
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


async def test_an_outside_cancellation_is_not_turned_into_a_timeout() -> None:
    started = asyncio.Event()

    async def receive() -> dict[str, object]:
        started.set()
        return await never()

    task = asyncio.ensure_future(read_body(receive, 100, DelayedCalls(10.0)))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_read_in_time_leaves_no_deadline_behind() -> None:
    """The timer goes with the read: the task is not cancelled after its deadline has passed."""

    async def receive() -> dict[str, object]:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    assert await read_body(receive, 100, DelayedCalls(0.02)) == b"{}"
    await asyncio.sleep(0.05)
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


async def test_a_body_in_several_chunks_is_joined() -> None:
    messages = iter([{"type": "http.request", "body": b"ab", "more_body": True},
                     {"type": "http.request", "body": b"cd", "more_body": False}])

    async def receive() -> dict[str, object]:
        return next(messages)

    assert await read_body(receive, 100, DelayedCalls(0.01)) == b"abcd"


async def test_oversized_chunked_body_is_refused_while_reading() -> None:
    chunks = iter([{"type": "http.request", "body": b"x" * 60, "more_body": True}] * 2)

    async def receive() -> dict[str, object]:
        return next(chunks)

    with pytest.raises(BodyTooLarge):
        await read_body(receive, 100, DelayedCalls(1.0))


def test_deadlines_hold_on_every_event_loop_at_once() -> None:
    """Two threads, two loops, reading at the same time: each read times out on its own loop."""
    outcomes: list[str] = []

    def run() -> None:
        async def main() -> None:
            try:
                await read_body(never, 100, DelayedCalls(0.05))
            except BodyTimeout:
                outcomes.append("timeout")

        asyncio.run(asyncio.wait_for(main(), 5))

    in_threads(run, 2, 10)
    assert outcomes == ["timeout", "timeout"]


async def test_reads_sharing_one_timer_each_expire_at_their_own_deadline() -> None:
    """One timer for all of a gate's reads: a read that ends in time takes its deadline with it,
    and those left expire in turn, each about ``timeout`` after it started, not at the first's."""
    deadlines = DelayedCalls(0.4)
    loop = asyncio.get_running_loop()
    ended: dict[str, float] = {}
    gate_open = asyncio.Event()

    async def slow_then_done() -> dict[str, object]:
        await gate_open.wait()
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def read(name: str, receive: object) -> str:
        started = loop.time()
        try:
            await read_body(receive, 100, deadlines)  # type: ignore[arg-type]
            return "read"
        except BodyTimeout:
            return "timeout"
        finally:
            ended[name] = loop.time() - started

    first = asyncio.ensure_future(read("first", slow_then_done))
    await asyncio.sleep(0.1)
    second = asyncio.ensure_future(read("second", never))
    await asyncio.sleep(0.05)
    gate_open.set()  # the first ends in time, before its deadline; the second must still expire
    assert await first == "read"
    assert await second == "timeout"
    assert 0.39 <= ended["second"] < 1.5, ended  # its own 0.4 s, not the first's deadline
    assert ended["first"] < 0.4


async def test_many_reads_at_once_time_out_together_and_leave_nothing_armed() -> None:
    deadlines = DelayedCalls(0.05)
    outcomes = await asyncio.gather(*(read_body(never, 100, deadlines) for _ in range(20)), return_exceptions=True)
    assert all(isinstance(outcome, BodyTimeout) for outcome in outcomes)
    assert deadlines.pending() == 0
    assert deadlines._loops[asyncio.get_running_loop()].timer is None  # nothing left to wait for


@pytest.mark.parametrize("value", [b"+21", b"1_0", b"-4912", b" 12", b"", b"0x10", "١٢".encode()])
def test_content_length_is_digits_only(value: bytes) -> None:
    """RFC 9110: Content-Length = 1*DIGIT. ``int()`` would have taken the first four."""
    with pytest.raises(InvalidJSON, match="digits only"):
        check_headers(http_scope(headers=[(b"content-length", value)]), 1000)


def test_content_length_digits_pass() -> None:
    check_headers(http_scope(headers=[(b"content-length", b"0100")]), 1000)


@pytest.mark.parametrize(
    "body",
    [
        b'\xef\xbb\xbf{"prompt": "bom"}',  # a UTF-8 BOM
        b'{"prompt": "p", "note": "lone \\udc80 surrogate"}',  # in a field that is not counted (tests/test_middleware.py)
        b'{"prompt": "nan", "temperature": NaN}',
        '{"prompt": "utf-16"}'.encode("utf-16"),
    ],
)
def test_what_fastapi_parses_is_parsed(body: bytes) -> None:
    """Starlette's ``Request.json()`` (FastAPI's parser) is ``json.loads`` on the bytes."""
    import json

    expected = json.loads(body)
    request = parse_request(body, RouteSpec(), lambda: "POST /x")
    assert [p.text for p in request.prompts] == [expected["prompt"]]
    assert repr(request.data) == repr(expected)  # repr: NaN is not equal to itself


@pytest.mark.parametrize(
    ("body", "spec", "field"),
    [
        (b'{"messages": [{"role": "us\\udc00er", "content": "hi"}]}', RouteSpec(), "messages[0].role"),
        (b'{"input": {"text": "caf\\ud800"}}', RouteSpec(prompt=lambda body: body["input"]["text"]), "prompt"),
    ],
)
def test_every_text_that_is_counted_must_be_valid_unicode(body: bytes, spec: RouteSpec, field: str) -> None:
    """Roles are counted too, and so is what a route's prompt callable returns (named 'prompt', as
    its other errors are); tests/test_middleware.py has the prompt fields and the counters."""
    with pytest.raises(InvalidField, match="is not valid Unicode: a lone surrogate") as refused:
        parse_request(body, spec, lambda: "POST /x")
    assert refused.value.extensions == {"field": field}


@pytest.mark.parametrize(("field", "value", "expected"), [("max_tokens", 16.0, 16), ("max_completion_tokens", 3.0, 3)])
def test_integer_valued_floats_count_as_integers(field: str, value: float, expected: int) -> None:
    """As a pydantic ``int`` field takes them."""
    parsed = parse_request(f'{{"prompt": "a", "{field}": {value}, "n": 2.0}}'.encode(), RouteSpec(), lambda: "POST /x")
    assert (parsed.max_new_tokens, parsed.n) == (expected, 2)


def test_openai_precedence_for_the_token_fields() -> None:
    """``max_new_tokens`` first, then OpenAI's ``max_completion_tokens`` before the deprecated ``max_tokens``."""
    both = b'{"prompt": "a", "max_tokens": 9, "max_completion_tokens": 5}'
    assert parse_request(both, RouteSpec(), lambda: "POST /x").max_new_tokens == 5
    three = b'{"prompt": "a", "max_tokens": 9, "max_completion_tokens": 5, "max_new_tokens": 7}'
    assert parse_request(three, RouteSpec(), lambda: "POST /x").max_new_tokens == 7


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, None),
        ({"do_sample": False}, False),
        ({"do_sample": True, "temperature": 0}, True),  # do_sample decides, as in generate()
        ({"temperature": 0}, False),
        ({"temperature": 0.0}, False),
        ({"temperature": 0.7}, True),
        ({"temperature": -1}, None),  # ill-typed or out of range: the endpoint's own validation answers
        ({"temperature": "0"}, None),
        ({"temperature": True}, None),
        ({"do_sample": "no"}, None),
    ],
)
def test_greedy_or_sampling_is_read_from_the_body(fields: dict[str, object], expected: bool | None) -> None:
    body = json.dumps({"prompt": "hello", **fields}).encode()
    assert parse_request(body, RouteSpec()).sampling is expected
