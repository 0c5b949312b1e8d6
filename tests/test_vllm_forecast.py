"""The KV blocks the ledger holds for running requests (gpu_asgi/_vllm/forecast.py), against a
step-by-step count, and the bounds admission relies on."""

from __future__ import annotations

import math
import random
from unittest import mock

from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_asgi._estimate.paged import blocks_for as blocks
from gpu_asgi._vllm import forecast
from gpu_asgi._vllm.forecast import Running, peak_blocks


def held_at(request: Running, step: int, block_size: int) -> int:
    """Blocks ``request`` holds at ``step``, counted one step at a time (0 once it has ended)."""
    if step >= request.steps:
        return 0
    return blocks(min(request.held + step, request.end), block_size) * request.sequences


def counted(running: list[Running], block_size: int) -> tuple[int, int]:
    """What the cache holds now, and at most at any step, counted one step at a time; a request
    still holds its blocks in the step after its last (vLLM may free them a step late)."""
    longest = max((r.steps for r in running), default=0)
    totals = [
        sum(held_at(r, min(step, r.steps - 1), block_size) for r in running if step <= r.steps)
        for step in range(longest + 1)
    ]
    return (totals[0] if totals else 0), max(totals, default=0)


@st.composite
def requests(draw: st.DrawFn) -> Running:
    prompt = draw(st.integers(1, 300))
    end = prompt + draw(st.integers(1, 400))
    held = draw(st.integers(prompt, end))
    steps = draw(st.integers(1, 450))
    return Running(held, end, steps, draw(st.integers(1, 3)))


@settings(max_examples=300, deadline=None)
@given(st.lists(requests(), max_size=12), st.sampled_from([1, 16, 128]))
def test_the_peak_covers_what_the_cache_holds_at_every_step(running: list[Running], block_size: int) -> None:
    now, peak = peak_blocks(running, block_size)
    held_now, most = counted(running, block_size)
    assert now == held_now
    assert peak >= most


def growth_counted(running: list[Running], block_size: int) -> int:
    """The most blocks the requests still running at any step have taken beyond those they hold
    now, counted one step at a time (a request still counts in the step after its last)."""
    longest = max((r.steps for r in running), default=0)
    return max(
        (
            sum(held_at(r, min(step, r.steps - 1), block_size) - held_at(r, 0, block_size) for r in running if step <= r.steps)
            for step in range(longest + 1)
        ),
        default=0,
    )


@settings(max_examples=300, deadline=None)
@given(st.lists(requests(), max_size=40), st.sampled_from([1, 16, 128]))
def test_all_of_the_growth_is_exactly_the_most_taken_at_any_step(running: list[Running], block_size: int) -> None:
    """Counted at the requests' ends or step by step (whichever is less work), the same count."""
    now, peak = peak_blocks(running, block_size)
    assert peak == now + growth_counted(running, block_size)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(requests(), st.booleans()), max_size=12), st.sampled_from([1, 16, 128]))
def test_whichever_requests_end_first_those_left_fit_in_their_own_blocks_and_the_growth(
    running: list[tuple[Running, bool]], block_size: int
) -> None:
    """The bytes of a request that ends go back to the ledger (and on to whoever waits), so the
    requests that stay must fit, at every step, in the blocks they hold now and the growth
    (``peak - now``): whichever end early, and however early."""
    requests_ = [request for request, _ in running]
    now, peak = peak_blocks(requests_, block_size)
    staying = [request for request, stays in running if stays]
    for step in range(max((r.steps for r in staying), default=0)):
        alive = [r for r in staying if step < r.steps]
        own = sum(held_at(r, 0, block_size) for r in alive)
        assert sum(held_at(r, step, block_size) for r in alive) <= own + (peak - now)


@settings(max_examples=300, deadline=None)
@given(st.lists(requests(), max_size=10), requests(), st.sampled_from([16, 128]))
def test_a_new_request_raises_the_peak_by_at_most_its_own_blocks_at_its_end(
    running: list[Running], new: Running, block_size: int
) -> None:
    """Why admission may reserve a new request's own peak on top of the set's: the new set's
    peak never exceeds that sum."""
    _, before = peak_blocks(running, block_size)
    _, after = peak_blocks([*running, new], block_size)
    assert after <= before + blocks(new.end, block_size) * new.sequences


def test_the_growth_one_request_gave_back_serves_another_but_never_the_blocks_it_held() -> None:
    """Answers of 200 tokens after 20 of prompt, 128-token blocks. One halfway through takes its
    second block, then ends before a fresh one takes its own: one block of growth serves both."""
    fresh = Running(held=21, end=220, steps=200)
    halfway = Running(held=120, end=220, steps=100)
    assert peak_blocks([fresh, halfway], 128) == (2, 3)
    assert peak_blocks([fresh, fresh], 128) == (2, 4)
    assert peak_blocks([], 128) == (0, 0)
    # Six answers about to end on two blocks each, and a fresh one on its first: the fresh one's
    # second block is held as growth. The blocks of those ending were once lent to it, and new
    # requests admitted on them as they ended made vLLM preempt (16 blocks for a cache of 15).
    ending = Running(held=204, end=205, steps=1)
    assert peak_blocks([*[ending] * 6, fresh], 128) == (13, 14)


# -- pooled growth (GPU_ASGI_GROWTH) --------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.lists(requests(), max_size=10), st.sampled_from([16, 128]), st.floats(0.01, 0.999))
def test_pooled_answers_that_all_go_on_are_held_at_the_most_the_cache_holds_and_chancy_ones_at_less(
    running: list[Running], block_size: int, quantile: float
) -> None:
    """Pooled, answers that go on until their forecast end for certain are held at the most the
    cache holds at any step, counted one step at a time: never more than all of the growth (an
    answer's blocks serve another's growth once it has ended), never less than now."""
    with mock.patch.object(forecast, "MAX_POINTS", 10**9):  # every step counted apart
        now, pooled = peak_blocks(running, block_size, quantile)
        assert (now, pooled) == counted(running, block_size)
        assert pooled <= peak_blocks(running, block_size)[1]
        chancy = [Running(r.held, r.end, r.steps, r.sequences, lambda step: 0.5) for r in running]
        assert now <= peak_blocks(chancy, block_size, quantile)[1] <= pooled


@settings(max_examples=300, deadline=None)
@given(st.lists(requests(), max_size=10), st.sampled_from([1, 16, 128]), st.floats(0.01, 0.999))
def test_pooled_answers_certain_to_end_at_their_forecast_are_held_at_the_most_the_cache_holds(
    running: list[Running], block_size: int, quantile: float
) -> None:
    """What a window of fixed-length answers (``ignore_eos``) gives: each goes on until its end
    for certain and stops there. Pooled growth then holds exactly what the cache holds at its
    most, including at the step in which one ends while another takes a block (vLLM may free the
    ender's blocks a step late; counting the ender gone in that step preempted in the two-process
    vLLM test). Since the set's reservations keep the bytes of those that end until the next
    reading (``Reservation.hand_over``), whichever end first, those left fit."""
    certain = [
        Running(r.held, r.end, r.steps, r.sequences, lambda step, steps=r.steps: 1.0 if step < steps else 0.0)  # type: ignore[misc]
        for r in running
    ]
    with mock.patch.object(forecast, "MAX_POINTS", 10**9):
        assert peak_blocks(certain, block_size, quantile) == counted(running, block_size)


@settings(max_examples=300, deadline=None)
@given(st.lists(requests(), max_size=12), st.sampled_from([1, 16, 128]), st.floats(0.01, 0.999), st.integers(1, 8))
def test_pooled_steps_counted_together_hold_no_less_than_each_counted_apart_and_no_more_than_all_growth(
    running: list[Running], block_size: int, quantile: float, points: int
) -> None:
    """The work is bounded (``MAX_POINTS`` counts, however many steps take a block: 16-token blocks
    and limits of thousands of tokens take hundreds): steps counted together never hold less."""
    chancy = [
        Running(r.held, r.end, r.steps, r.sequences, lambda step, c=(r.held % 7) / 7: c) for r in running  # type: ignore[misc]
    ]
    for requests_ in (running, chancy):
        with mock.patch.object(forecast, "MAX_POINTS", 10**9):
            apart = peak_blocks(requests_, block_size, quantile)
        with mock.patch.object(forecast, "MAX_POINTS", points):
            together = peak_blocks(requests_, block_size, quantile)
        assert together[0] == apart[0]
        assert apart[1] <= together[1] <= peak_blocks(requests_, block_size)[1]


def test_pooled_growth_is_the_quantile_of_how_many_go_on() -> None:
    """Ten fresh answers (20 prompt tokens, 128-token blocks), each taking its second block at
    step 108 if it is still running then, with a chance of 0.6: the set then holds 2 blocks for
    each, 2 x the 0.99 quantile of Binomial(10, 0.6), 18 blocks, where all of the growth holds 20.
    With a chance of 0.2 the 10 blocks they hold now are already more than the 0.99 quantile then
    (2 x 5): nothing is held beyond them, where all of the growth holds 10 more."""
    fresh = [Running(21, 220, 200, 1, lambda step: 0.6)] * 10
    assert peak_blocks(fresh, 128) == (10, 20)
    spread = [math.comb(10, k) * 0.6**k * 0.4 ** (10 - k) for k in range(11)]
    expected = next(k for k in range(11) if sum(spread[: k + 1]) >= 0.99)
    assert expected == 9
    assert peak_blocks(fresh, 128, 0.99) == (10, 2 * expected)
    assert peak_blocks(fresh, 128, 0.5) == (10, 12)
    unlikely = [Running(21, 220, 200, 1, lambda step: 0.2)] * 10
    assert peak_blocks(unlikely, 128) == (10, 20)
    assert peak_blocks(unlikely, 128, 0.99) == (10, 10)


def test_pooled_growth_misses_about_as_often_as_its_quantile_says() -> None:
    """Draw who goes on, many times: what the set holds covers the blocks of those drawn to go on
    (2 each, at their second block) in at least about the quantile's share of draws."""
    rng = random.Random(3)
    chances = [rng.uniform(0.3, 0.9) for _ in range(12)]
    fresh = [Running(21, 220, 200, 1, lambda step, c=c: c) for c in chances]  # type: ignore[misc]
    now, peak = peak_blocks(fresh, 128, 0.95)
    covered = sum(2 * sum(rng.random() < c for c in chances) <= peak for _ in range(4000))
    assert covered / 4000 >= 0.94
    assert now < peak < 24  # more than they hold now, less than all of the growth


def test_past_max_exact_the_quantile_of_the_sum_is_approximated_within_a_few_percent() -> None:
    """Hundreds of answers on 16-token blocks make the exact distribution too slow to count at
    every reading (seconds): past ``MAX_EXACT`` the Cornish-Fisher expansion stands for it."""
    rng = random.Random(1)
    for _ in range(100):
        count = rng.randint(20, 120)
        weights = [rng.randint(1, 40) for _ in range(count)]
        chances = [rng.choice([rng.uniform(0.01, 0.2), rng.uniform(0.2, 1.0)]) for _ in range(count)]
        quantile = rng.choice([0.9, 0.99, 0.999])
        with mock.patch.object(forecast, "MAX_EXACT", 10**12):
            exact = forecast._quantile_of_sum(weights, chances, quantile)
        with mock.patch.object(forecast, "MAX_EXACT", 0):
            approximate = forecast._quantile_of_sum(weights, chances, quantile)
        assert exact * 0.99 - 1 <= approximate <= exact * 1.03 + 2
    with mock.patch.object(forecast, "MAX_EXACT", 0):
        assert forecast._quantile_of_sum([3] * 20, [1.0] * 20, 0.99) == 60  # certain: no spread
        assert forecast._quantile_of_sum([3] * 20, [0.0] * 20, 0.99) == 0


def test_few_answers_on_many_blocks_are_counted_on_blocks_rounded_up_never_less() -> None:
    """Below ``MIN_APPROXIMATED`` answers the normal approximation is poor (two answers of about
    1,000 blocks each, as with 1-token blocks, came out 500 blocks short): past ``MAX_EXACT`` their
    blocks are rounded up to a power of two instead, never less than exact, and not by more than
    the rounding."""
    rng = random.Random(2)
    for _ in range(200):
        count = rng.randint(1, forecast.MIN_APPROXIMATED - 1)
        weights = [rng.randint(1, 1200) for _ in range(count)]
        chances = [rng.uniform(0.05, 1.0) for _ in range(count)]
        quantile = rng.choice([0.5, 0.9, 0.99])
        with mock.patch.object(forecast, "MAX_EXACT", 10**12):
            exact = forecast._quantile_of_sum(weights, chances, quantile)
        rounded = forecast._quantile_of_sum(weights, chances, quantile)
        unit = 1
        while count * (sum(weights) // unit + count) > forecast.MAX_EXACT:
            unit *= 2
        assert exact <= rounded <= min(sum(weights), exact + count * (unit - 1))
