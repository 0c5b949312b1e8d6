"""The forecast of the KV blocks running requests hold (gpu_asgi/_vllm/forecast.py), against a
step-by-step count, and the bound admission relies on."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_asgi._estimate.paged import blocks_for as blocks
from gpu_asgi._vllm.forecast import Running, peak_blocks


def counted(running: list[Running], block_size: int) -> tuple[int, int]:
    """The same, one step at a time."""
    longest = max((r.steps for r in running), default=0)
    totals = [
        sum(blocks(min(r.held + step, r.end), block_size) * r.sequences for r in running if step < r.steps)
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
def test_the_peak_is_the_most_held_at_any_step(running: list[Running], block_size: int) -> None:
    assert peak_blocks(running, block_size) == counted(running, block_size)


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


def test_requests_that_take_their_second_block_after_others_end_share_the_cache() -> None:
    """Two answers of 200 tokens after 20 of prompt, 128-token blocks: together at their start
    they need 4 blocks, but one halfway through ends before the other takes its second block."""
    fresh = Running(held=21, end=220, steps=200)
    halfway = Running(held=120, end=220, steps=100)
    assert peak_blocks([fresh, halfway], 128) == (2, 3)
    assert peak_blocks([fresh, fresh], 128) == (2, 4)
    assert peak_blocks([], 128) == (0, 0)
