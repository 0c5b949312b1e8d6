"""The demo with learned lengths: a batch decodes only on bytes it holds, grows before it runs past
them, pauses while none are free, takes them from requests still queued, and stops when it cannot."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from prometheus_client import CollectorRegistry

from demo_service import Batcher, BucketedEstimator, DemoSettings, LoadedModel, Sampling
from demo_service._batching.buckets import bucket
from demo_service._metrics import DemoMetrics
from gpu_asgi import AnalyticEstimator, Ledger, Reservation

from ._asgi import client, wait_until
from ._demo import batcher_of, ledger_of, loaded_model, model_dir, running

LIMIT = 48
PREDICTED = 4


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return loaded_model(model_dir(tmp_path_factory))


@pytest.fixture
def estimator(model: LoadedModel) -> BucketedEstimator:
    return BucketedEstimator(AnalyticEstimator.from_config(model.model.config, dtype=model.dtype))


def ids(model: LoadedModel, text: str) -> list[int]:
    return model.tokenizer.encode(text, add_special_tokens=False)


class Watch:
    """Each decoding step of a batcher, with the bytes the ledger held when its token came back."""

    def __init__(self, batcher: Batcher, ledger: Ledger) -> None:
        self.steps: list[tuple[int, int]] = []  # (tokens so far in the batch's longest row, bytes held)
        step = batcher._on_step

        def on_step(slots, tokens):  # type: ignore[no-untyped-def]
            step(slots, tokens)
            produced = max(len(s.text.token_ids) + (s.finish_reason == "stop") for _, s in slots)
            self.steps.append((produced, ledger.statistics().reserved_bytes))

        batcher._on_step = on_step  # type: ignore[method-assign]


def metrics() -> DemoMetrics:
    return DemoMetrics(CollectorRegistry())


def sample(demo_metrics: DemoMetrics, name: str) -> float:
    value = demo_metrics.growth_bytes._value.get() if name == "growth_bytes" else demo_metrics.growth_denied._value.get()
    return float(value)


async def test_a_batch_grows_before_it_decodes_past_its_bytes(model: LoadedModel, estimator: BucketedEstimator) -> None:
    prompt = ids(model, "Tell me a long story")
    worst = estimator.estimate(len(prompt), LIMIT)
    ledger = Ledger({"cpu": worst})
    reservation = ledger.try_reserve(estimator.estimate(len(prompt), PREDICTED))
    assert reservation is not None
    demo_metrics = metrics()
    async with Batcher(model, estimator=estimator, ledger=ledger, window=0.0, metrics=demo_metrics) as batcher:
        watch = Watch(batcher, ledger)
        generation = batcher.submit(
            [prompt], max_new_tokens=LIMIT, reserved_bytes=reservation.requested_bytes,
            reserved_tokens=PREDICTED, reservation=reservation,
        )
        (sequence,) = await generation.result()
    assert sequence.completion_tokens == LIMIT  # the answer was not cut by its prediction
    assert sample(demo_metrics, "growth_bytes") > 0
    # Every step ran on bytes the ledger held: the padded batch's cost at that length, never more.
    for produced, held in watch.steps:
        assert held >= estimator.batch_bytes([len(prompt)], [produced]), (produced, held)
    assert max(held for _, held in watch.steps) <= worst
    # The loans went back with the batch; the request still holds its own reservation.
    assert ledger.statistics().reserved_bytes == reservation.requested_bytes
    # Strict and learned decode the same tokens (greedy).
    async with Batcher(model, window=0.0) as strict:
        (alone,) = await strict.submit([prompt], max_new_tokens=LIMIT).result()
    assert alone.text.token_ids == sequence.text.token_ids
    reservation.release()


async def test_a_batch_pauses_while_no_bytes_are_free_and_resumes_when_they_are(
    model: LoadedModel, estimator: BucketedEstimator
) -> None:
    prompt, worst, own, ledger, reservation, other = crowded(model, estimator, max_wait=60)
    async with Batcher(model, estimator=estimator, ledger=ledger, window=0.0) as batcher:
        watch = Watch(batcher, ledger)
        generation = batcher.submit(
            [prompt], max_new_tokens=LIMIT, reserved_bytes=own, reserved_tokens=PREDICTED, reservation=reservation
        )
        await wait_until(lambda: ledger.statistics().waiting == 1, timeout=30)  # the batch asks for more
        paused_at = len(watch.steps)
        await asyncio.sleep(0.5)
        assert len(watch.steps) == paused_at  # nothing decoded while it waits
        assert paused_at <= estimator_steps(estimator, len(prompt), own) + 1
        other.release()
        (sequence,) = await generation.result()
    assert sequence.completion_tokens == LIMIT
    assert all(held <= worst for _, held in watch.steps)
    reservation.release()


def crowded(
    model: LoadedModel, estimator: BucketedEstimator, *, max_wait: float
) -> tuple[list[int], int, int, Ledger, Reservation, Reservation]:
    """A device with room for one request's worst case, the request holding its predicted bytes
    and someone else the rest: ``(prompt, worst, own, ledger, its reservation, the other's)``."""
    prompt = ids(model, "Tell me a long story")
    worst = estimator.estimate(len(prompt), LIMIT)
    own = estimator.estimate(len(prompt), PREDICTED)
    ledger = Ledger({"cpu": worst}, max_wait=max_wait)
    reservation, other = ledger.try_reserve(own), ledger.try_reserve(worst - own)
    assert reservation is not None and other is not None
    return prompt, worst, own, ledger, reservation, other


def estimator_steps(estimator: BucketedEstimator, prompt: int, nbytes: int) -> int:
    return max(t for t in range(LIMIT + 1) if estimator.batch_bytes([prompt], [t]) <= nbytes)


async def test_a_running_batch_takes_bytes_from_a_queued_request_which_gets_them_back(
    model: LoadedModel, estimator: BucketedEstimator
) -> None:
    first, second = ids(model, "Tell me a long story"), ids(model, "And another one, please")
    own = [estimator.estimate(len(p), PREDICTED) for p in (first, second)]
    capacity = sum(own)  # room for what both reserved, nothing free to grow into
    assert max(estimator.estimate(len(p), LIMIT) for p in (first, second)) <= capacity
    ledger = Ledger({"cpu": capacity}, max_wait=60)
    held = [ledger.try_reserve(n) for n in own]
    assert None not in held
    # One row per batch, so the second waits here, admitted and holding bytes, while the first runs.
    async with Batcher(model, estimator=estimator, ledger=ledger, window=0.0, max_batch_size=1) as batcher:
        watch = Watch(batcher, ledger)
        generations = [
            batcher.submit(
                [p], max_new_tokens=LIMIT, reserved_bytes=n, reserved_tokens=PREDICTED, reservation=r,
                sampling=Sampling(),
            )
            for p, n, r in zip((first, second), own, held)
        ]
        (done,) = await asyncio.wait_for(generations[0].result(), 60)
        owed = generations[1].owed
        held[0].shrink(0)  # type: ignore[union-attr]  # as the app does once a batch is off the device
        (then,) = await asyncio.wait_for(generations[1].result(), 60)
    assert [done.completion_tokens, then.completion_tokens] == [LIMIT, LIMIT]  # neither deadlocked nor cut
    assert owed > 0  # the running batch took the queued request's bytes ...
    assert all(held_bytes <= capacity for _, held_bytes in watch.steps)  # ... and never more than the device
    # ... and the second got them back, as a loan, for its own batch: with that loan returned, the
    # ledger holds what is left of its reservation.
    assert ledger.statistics().reserved_bytes == own[1] - owed
    for r in held:
        r.release()  # type: ignore[union-attr]
    assert ledger.statistics().reserved_bytes == 0


async def test_a_batch_that_cannot_grow_within_max_wait_ends_its_answers_there(
    model: LoadedModel, estimator: BucketedEstimator
) -> None:
    prompt, worst, own, ledger, reservation, other = crowded(model, estimator, max_wait=0.3)  # other: held for good
    demo_metrics = metrics()
    async with Batcher(model, estimator=estimator, ledger=ledger, window=0.0, metrics=demo_metrics) as batcher:
        generation = batcher.submit(
            [prompt], max_new_tokens=LIMIT, reserved_bytes=own, reserved_tokens=PREDICTED, reservation=reservation
        )
        (sequence,) = await asyncio.wait_for(generation.result(), 60)
    assert sequence.finish_reason == "length"
    assert sequence.completion_tokens <= estimator_steps(estimator, len(prompt), own) + 1 < LIMIT
    assert sample(demo_metrics, "growth_denied") == 1
    assert ledger.statistics().reserved_bytes == own + (worst - own)  # no loan left behind
    other.release()
    reservation.release()


def test_the_reserve_setting_is_strict_learned_or_a_quantile() -> None:
    assert DemoSettings(progress=False).reserve_quantile is None
    assert DemoSettings(progress=False, reserve="learned").reserve_quantile == 0.9
    assert DemoSettings(progress=False, reserve="0.75").reserve_quantile == 0.75
    for bad in ("bogus", "0", "1.5"):
        with pytest.raises(ValueError, match="reserve"):
            DemoSettings(progress=False, reserve=bad)


async def test_through_the_app_learned_admission_reserves_less_once_answers_are_seen(model: LoadedModel) -> None:
    # Stop strings common enough that nearly every answer ends within a few tokens (rarer ones, as
    # "x" and "z" alone, leave a third of the answers at the limit and the median near it).
    body = {"prompt": "Tell me a story", "max_new_tokens": 64, "temperature": 1.0, "stop": ["x", "z", "e", "a"]}
    async with running(model, reserve="0.5") as app, client(app) as http:
        first = await http.post("/v1/generate", json=body)
        assert first.status_code == 200
        cold = first.json()["admission"]["estimated_bytes"]
        answers = [first]
        for _ in range(20):  # past OutputLengths' min_samples
            answers.append(await http.post("/v1/generate", json=body))
        assert all(a.status_code == 200 for a in answers)
        lengths = [a.json()["usage"]["completion_tokens"] for a in answers]
        warm = (await http.post("/v1/generate", json=body)).json()["admission"]["estimated_bytes"]
        report = (await http.get("/health")).json()
        await wait_until(lambda: ledger_of(app).statistics().reserved_bytes == 0, timeout=30)
        assert batcher_of(app).idle
    assert sorted(lengths)[len(lengths) // 2] < 48  # the stop strings ended answers early
    assert warm < cold  # learnt: it reserves for the answers it saw, not for max_new_tokens
    assert report["output_lengths"], report


async def test_through_the_app_streams_that_run_past_the_prediction_complete(model: LoadedModel) -> None:
    async with running(model, reserve="0.5") as app, client(app) as http:
        name = app.state.service.model_name
        # Stop strings common enough that nearly every answer ends within a few tokens: the learnt
        # median must fall below the limit's length bucket, or the reservation already covers it.
        stops = ["x", "z", "e", "a"]
        short = {"model": name, "prompt": "Hi", "max_tokens": 48, "temperature": 1.0, "stop": stops}
        for _ in range(20):  # the route learns that its answers are short
            assert (await http.post("/v1/completions", json=short)).status_code == 200
        (learnt,) = (await http.get("/health")).json()["output_lengths"]
        assert bucket(learnt["predicted_tokens"]) < bucket(48), learnt
        # Now one that runs to its limit (no stop string), streamed, on the same route.
        long = {"model": name, "prompt": "Hi", "max_tokens": 48, "stream": True}
        events = []
        async with http.stream("POST", "/v1/completions", json=long) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(line)
        await wait_until(lambda: ledger_of(app).statistics().reserved_bytes == 0, timeout=30)
        demo_metrics = batcher_of(app).metrics
    assert '"finish_reason":"length"' in events[-1].replace(" ", "")  # it ran to max_tokens ...
    assert demo_metrics.growth_bytes._value.get() > 0  # ... on bytes its batch borrowed as it went
    assert demo_metrics.growth_denied._value.get() == 0
