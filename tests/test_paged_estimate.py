"""PagedKVEstimator and paged_kv_budget against a paged cache's allocation rule (vLLM's): each
sequence holds ceil(tokens / block_size) blocks, and one block of the cache is the null block."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpu_asgi import Estimator, Ledger, LinearEstimator, NeverFits, PagedKVEstimator, paged_kv_budget

KV_BYTES_PER_TOKEN = 4096  # the tiny Qwen2 of tests/vllm: 4 layers x 2 KV heads x 64 dims x 2 x float32


class BlockPool:
    """A paged KV cache as vLLM hands it out: ``num_blocks`` blocks, the first kept as the null
    block, each sequence given ceil(tokens / block_size) of the rest. ``allocate`` fails (False)
    when the blocks run out: where vLLM preempts a running request."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.free = num_blocks - 1
        self.block_size = block_size

    def allocate(self, tokens: int) -> bool:
        need = -(-tokens // self.block_size)
        if need > self.free:
            return False
        self.free -= need
        return True


def test_counts_whole_blocks_per_sequence() -> None:
    est = PagedKVEstimator(bytes_per_token=KV_BYTES_PER_TOKEN, block_size=128)
    assert isinstance(est, Estimator)
    block = 128 * KV_BYTES_PER_TOKEN
    assert est.bytes_per_block == block
    assert est.estimate(0, 1) == block
    assert est.estimate(100, 28) == block  # 128 tokens: exactly one block
    assert est.estimate(100, 29) == 2 * block  # 129 tokens: a second, whole block
    assert est.estimate(150, 50) == 2 * block
    assert est.estimate(150, 50, batch=3) == 6 * block  # each sequence its own blocks
    assert est.estimate(0, 0) == 0
    assert est.blocks(150, 50) == 2
    assert PagedKVEstimator(bytes_per_token=10, block_size=16, fixed_bytes=7).estimate(1, 16, 2) == 2 * (7 + 2 * 160)


def test_a_sequence_holds_at_most_max_sequence_tokens() -> None:
    """vLLM stops a sequence at max_model_len: an unset max_tokens means "up to it"."""
    est = PagedKVEstimator(bytes_per_token=1, block_size=16, max_sequence_tokens=100)
    assert est.estimate(30, 100) == 7 * 16  # 100 tokens, not 130
    assert est.estimate(30, 50) == 5 * 16  # under the cap: as without it
    assert est.blocks(99, 1000) == 7


def test_refuses_bad_settings() -> None:
    with pytest.raises(ValueError, match="block_size"):
        PagedKVEstimator(bytes_per_token=1, block_size=0)
    with pytest.raises(ValueError, match=">= 0"):
        PagedKVEstimator(bytes_per_token=-1, block_size=16)
    with pytest.raises(ValueError, match="batch"):
        PagedKVEstimator(bytes_per_token=1, block_size=16).estimate(1, 1, 0)
    with pytest.raises(ValueError, match="max_sequence_tokens"):
        PagedKVEstimator(bytes_per_token=1, block_size=16, max_sequence_tokens=0)
    with pytest.raises(ValueError, match="none for sequences"):
        paged_kv_budget(1, 128, 4096)
    with pytest.raises(ValueError, match=">= 1"):
        paged_kv_budget(16, 0, 4096)


def test_budget_leaves_out_the_null_block() -> None:
    assert paged_kv_budget(16, 128, KV_BYTES_PER_TOKEN) == 15 * 128 * KV_BYTES_PER_TOKEN
    assert paged_kv_budget(16, 128, KV_BYTES_PER_TOKEN, reserved_blocks=0) == 16 * 128 * KV_BYTES_PER_TOKEN


def fits(ledger: Ledger, nbytes: int) -> bool:
    """Whether the ledger admits ``nbytes`` now (a request larger than the whole budget never)."""
    try:
        return ledger.try_reserve(nbytes) is not None
    except NeverFits:
        return False


def admitted(estimator: Estimator, budget: int, requests: list[int]) -> list[int]:
    """The requests (total tokens each, prompt + max_new) a ledger of ``budget`` admits at once."""
    ledger = Ledger(budget)
    return [tokens for tokens in requests if fits(ledger, estimator.estimate(tokens, 0))]


def test_the_issue_case_linear_lets_in_too_many_paged_does_not() -> None:
    """16 blocks of 128 tokens, 200-token requests: the cache holds 7 at once (2 blocks each of
    the 15 usable). Linear, in tokens, admits 9, and the pool runs out: vLLM preempts."""
    budget = paged_kv_budget(16, 128, KV_BYTES_PER_TOKEN)
    requests = [200] * 40
    linear = admitted(LinearEstimator(bytes_per_token=KV_BYTES_PER_TOKEN), budget, requests)
    paged = admitted(PagedKVEstimator(bytes_per_token=KV_BYTES_PER_TOKEN, block_size=128), budget, requests)
    assert (len(linear), len(paged)) == (9, 7)
    pool = BlockPool(16, 128)
    assert not all(pool.allocate(tokens) for tokens in linear)
    pool = BlockPool(16, 128)
    assert all(pool.allocate(tokens) for tokens in paged)
    assert not pool.allocate(200)  # and an eighth would not have fitted: the ledger refused no room


@given(
    num_blocks=st.integers(2, 64),
    block_size=st.sampled_from([1, 8, 16, 32, 128]),
    requests=st.lists(st.integers(1, 3000), max_size=60),
)
def test_whatever_is_admitted_fits_the_pool(num_blocks: int, block_size: int, requests: list[int]) -> None:
    """Every set of requests the ledger admits together can be allocated at its longest."""
    estimator = PagedKVEstimator(bytes_per_token=KV_BYTES_PER_TOKEN, block_size=block_size)
    budget = paged_kv_budget(num_blocks, block_size, KV_BYTES_PER_TOKEN)
    pool = BlockPool(num_blocks, block_size)
    for tokens in admitted(estimator, budget, requests):
        assert pool.allocate(tokens)


@given(
    num_blocks=st.integers(2, 64),
    block_size=st.sampled_from([8, 16, 128]),
    requests=st.lists(st.integers(1, 3000), max_size=60),
)
def test_and_no_request_the_pool_could_still_hold_is_refused(
    num_blocks: int, block_size: int, requests: list[int]
) -> None:
    """Not over-cautious either: a request refused by the ledger would not have fit the pool."""
    estimator = PagedKVEstimator(bytes_per_token=KV_BYTES_PER_TOKEN, block_size=block_size)
    ledger = Ledger(paged_kv_budget(num_blocks, block_size, KV_BYTES_PER_TOKEN))
    pool = BlockPool(num_blocks, block_size)
    for tokens in requests:
        assert fits(ledger, estimator.estimate(tokens, 0)) == pool.allocate(tokens)
