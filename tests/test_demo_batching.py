"""Dynamic batching: one generate for concurrent requests, outputs equal to running each alone."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from demo_service import Batcher, BucketedEstimator, LoadedModel, Sampling, bucket
from demo_service._batching.decode import SequenceText
from gpu_asgi import AnalyticEstimator, Ledger

from ._asgi import client
from ._demo import batcher_of, loaded_model, model_dir, running

PROMPTS = [
    "Hello there",
    "The quick brown fox jumps over the lazy dog, twice, and then sits down.",
    "你好，世界",
    "One two three four five",
    "def f(x): return x * 2",
]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return loaded_model(model_dir(tmp_path_factory))



def ids(model: LoadedModel, text: str) -> list[int]:
    return model.tokenizer.encode(text, add_special_tokens=False)


async def run_all(
    batcher: Batcher, prompts: list[list[int]], max_new_tokens: list[int], **kw: object
) -> list[list[int]]:
    generations = [batcher.submit([p], max_new_tokens=n, **kw) for p, n in zip(prompts, max_new_tokens)]  # type: ignore[arg-type]
    results = [await g.result() for g in generations]
    return [result[0].text.token_ids for result in results]


async def test_concurrent_requests_share_one_generate_and_match_unbatched_greedy(model: LoadedModel) -> None:
    prompts = [ids(model, p) for p in PROMPTS]
    limits = [4, 9, 6, 12, 7]  # each sequence stops at its own limit inside the batch
    async with Batcher(model, window=0.5) as batched:
        together = await run_all(batched, prompts, limits)
        assert (batched.generate_calls, list(batched.batch_sizes)) == (1, [5])
    async with Batcher(model, window=0.0, max_batch_size=1) as alone:
        separately = await run_all(alone, prompts, limits)
        assert alone.generate_calls == 5
    assert [len(t) for t in together] == limits
    assert together == separately


async def test_streamed_deltas_add_up_to_the_final_text(model: LoadedModel) -> None:
    async with Batcher(model, window=0.05) as batcher:
        generations = [batcher.submit([ids(model, p)], max_new_tokens=10, stream=True) for p in PROMPTS[:3]]

        async def collect(generation):  # type: ignore[no-untyped-def]
            return [delta async for delta in generation.deltas()]

        streams = await asyncio.gather(*(collect(g) for g in generations))
        results = [(await g.result())[0] for g in generations]
    for deltas, sequence in zip(streams, results):
        assert "".join(d.text for d in deltas) == sequence.text.text
        assert deltas[-1].finish_reason == "length" and all(d.finish_reason is None for d in deltas[:-1])
        assert sequence.text.text == model.tokenizer.decode(sequence.text.token_ids, skip_special_tokens=True)


async def test_requests_with_different_sampling_do_not_share_a_batch(model: LoadedModel) -> None:
    prompt = ids(model, PROMPTS[0])
    async with Batcher(model, window=0.3) as batcher:
        greedy = [batcher.submit([prompt], max_new_tokens=3) for _ in range(2)]
        hot = [batcher.submit([prompt], max_new_tokens=3, sampling=Sampling(0.7, 0.9)) for _ in range(2)]
        for generation in greedy + hot:
            await generation.result()
        assert sorted(batcher.batch_sizes) == [2, 2]
    assert {g.batch_rows for g in greedy} == {2}


async def test_n_sequences_per_prompt_come_back_in_openai_order(model: LoadedModel) -> None:
    async with Batcher(model, window=0.0) as batcher:
        generation = batcher.submit([ids(model, "a"), ids(model, "b c d")], max_new_tokens=3, n=2)
        sequences = await generation.result()
    assert [s.index for s in sequences] == [0, 1, 2, 3]
    assert sequences[0].text.token_ids == sequences[1].text.token_ids  # greedy: n copies agree
    assert generation.prompt_tokens == len(ids(model, "a")) + len(ids(model, "b c d"))
    assert generation.batch_rows == 4


async def test_stop_strings_end_a_sequence_and_never_reach_the_stream(model: LoadedModel) -> None:
    prompt = ids(model, PROMPTS[1])
    async with Batcher(model, window=0.0) as batcher:
        free = (await batcher.submit([prompt], max_new_tokens=12).result())[0].text.text
        stop = free[len(free) // 2 : len(free) // 2 + 3]
        generation = batcher.submit([prompt], max_new_tokens=12, stop=[stop], stream=True)
        streamed = "".join([d.text async for d in generation.deltas()])
        (sequence,) = await generation.result()
    assert sequence.finish_reason == "stop"
    assert sequence.text.text == free[: free.find(stop)] == streamed
    assert stop not in streamed


async def test_a_cancelled_request_stops_without_stopping_its_batch(model: LoadedModel) -> None:
    async with Batcher(model, window=0.2) as batcher:
        keep = batcher.submit([ids(model, "keep going")], max_new_tokens=40)
        leave = batcher.submit([ids(model, "leave early")], max_new_tokens=400, stream=True)
        never = batcher.submit([ids(model, "never started")], max_new_tokens=5, sampling=Sampling(0.5))
        never.cancel()  # still queued: it never reaches the device
        async for _ in leave.deltas():
            leave.cancel()  # after its first token
        (kept,) = await keep.result()
        await leave.result()
        assert await never.started is False
    assert len(kept.text.token_ids) == 40 and kept.finish_reason == "length"
    assert leave.sequences[0].finish_reason == "cancelled" and leave.completion_tokens < 10
    assert batcher.generate_calls == 1  # the cancelled, differently-sampled request never ran


def test_buckets_round_up_to_quarter_octaves() -> None:
    assert [bucket(n) for n in (0, 1, 16, 17, 64, 65, 128, 129, 200, 1000, 1025)] == [
        0,
        16,
        16,
        32,
        64,
        80,
        128,
        160,
        224,
        1024,
        1280,
    ]
    assert all(n <= bucket(n) < n + max(16, n / 4) for n in range(1, 5000))  # under 25 % more above 64


async def test_padding_into_a_batch_is_paid_for_by_reservations_or_a_loan(model: LoadedModel) -> None:
    base = AnalyticEstimator.from_config(model.model.config, dtype=model.dtype)
    estimator = BucketedEstimator(base)
    short, long = ids(model, "hi"), ids(model, "word " * 300)
    own = [estimator.estimate(len(short), 8), estimator.estimate(len(long), 8)]
    padded = base.estimate(len(long), 8, 2)
    assert padded > sum(own)  # the short request padded to the long one costs more than both reserved

    ledger = Ledger({"cpu": sum(own)})  # no room to lend: they run apart
    held = [ledger.try_reserve(n) for n in own]
    async with Batcher(model, estimator=estimator, ledger=ledger, window=0.2) as batcher:
        for generation in [batcher.submit([p], max_new_tokens=8, reserved_bytes=n) for p, n in zip((short, long), own)]:
            await generation.result()
        assert sorted(batcher.batch_sizes) == [1, 1]
    roomy = Ledger({"cpu": padded})  # room for the padding: it is borrowed for the batch, then returned
    held = [roomy.try_reserve(n) for n in own]
    async with Batcher(model, estimator=estimator, ledger=roomy, window=0.2) as batcher:
        for generation in [batcher.submit([p], max_new_tokens=8, reserved_bytes=n) for p, n in zip((short, long), own)]:
            await generation.result()
        assert list(batcher.batch_sizes) == [2]
    assert roomy.statistics().reserved_bytes == sum(own)  # the loan is back; the requests still hold theirs
    for reservation in held:
        reservation.release()  # type: ignore[union-attr]


async def test_through_the_app_concurrent_requests_batch_and_match_sequential_ones(model: LoadedModel) -> None:
    bodies = [{"prompt": p, "max_new_tokens": 5} for p in PROMPTS]
    # The batch forms when all five are in (max_batch_size), not when a window ends: no race with a busy machine.
    async with running(model, batch_window_ms=60_000, max_batch_size=len(bodies)) as app, client(app) as http:
        together = await asyncio.gather(*(http.post("/v1/generate", json=b) for b in bodies))
        assert batcher_of(app).generate_calls == 1
    async with running(model, max_batch_size=1, batch_window_ms=0) as app, client(app) as http:
        alone = [await http.post("/v1/generate", json=b) for b in bodies]
    assert [r.json()["admission"]["batch_size"] for r in together] == [5] * 5
    assert [r.json()["text"] for r in together] == [r.json()["text"] for r in alone]


def test_partial_characters_are_held_back_until_they_settle(model: LoadedModel) -> None:
    tokenizer = model.tokenizer
    text = "🙂 naïve 你好 𝔘𝔫𝔦𝔠𝔬𝔡𝔢"
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tokenizer.decode(token_ids[:i]) for i in range(1, len(token_ids)))  # some split a character
    sequence = SequenceText(tokenizer)
    deltas = [sequence.push(t) for t in token_ids] + [sequence.finish()]
    assert "".join(deltas) == text and not any("\ufffd" in d for d in deltas)
