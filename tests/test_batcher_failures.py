"""The demo batcher's collector never dies silently: a batch it cannot form fails its requests
at once (a 500 problem through the app), any loan goes back, and later requests still run."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from demo_service import Batcher, BucketedEstimator, LoadedModel
from demo_service._batching.batcher import BORROW_PRIORITY, BatchFormingFailed
from gpu_asgi import MAX_PRIORITY, AnalyticEstimator, Ledger, Reservation

from ._demo import loaded_model, model_dir


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return loaded_model(model_dir(tmp_path_factory))


class LendingFails(Ledger):
    """A ledger whose padding loans fail with an unexpected error (a Redis hiccup, a bug)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.failures = 1

    async def reserve(self, nbytes: int, **options: Any) -> Reservation:
        if options.get("priority") == BORROW_PRIORITY and self.failures:
            self.failures -= 1
            raise RuntimeError("lending broke")
        return await super().reserve(nbytes, **options)


def test_padding_loans_use_a_priority_every_ledger_accepts() -> None:
    assert BORROW_PRIORITY == MAX_PRIORITY


async def test_a_batch_that_cannot_be_formed_fails_its_requests_and_the_collector_goes_on(model: LoadedModel) -> None:
    base = AnalyticEstimator.from_config(model.model.config, dtype=model.dtype)
    estimator = BucketedEstimator(base)
    short = model.tokenizer.encode("hi", add_special_tokens=False)
    long = model.tokenizer.encode("word " * 300, add_special_tokens=False)
    own = [estimator.estimate(len(short), 8), estimator.estimate(len(long), 8)]
    ledger = LendingFails({"cpu": base.estimate(len(long), 8, 2)})  # room to lend for padding
    held = [ledger.try_reserve(n) for n in own]
    async with Batcher(model, estimator=estimator, ledger=ledger, window=0.2) as batcher:
        generations = [batcher.submit([p], max_new_tokens=8, reserved_bytes=n) for p, n in zip((short, long), own)]
        for generation in generations:
            with pytest.raises(BatchFormingFailed, match="lending broke"):
                await asyncio.wait_for(generation.result(), 10)  # at once, not never
        assert ledger.statistics().reserved_bytes == sum(own)  # nothing borrowed is left out
        later = batcher.submit([short], max_new_tokens=4, reserved_bytes=own[0])
        (result,) = await asyncio.wait_for(later.result(), 30)  # the collector is still running
        assert len(result.text.token_ids) == 4
    for reservation in held:
        reservation.release()  # type: ignore[union-attr]
