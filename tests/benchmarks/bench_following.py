"""What one reading of vLLM's following costs the API server's event loop (gpu_asgi/_vllm).

    .venv/bin/python -m tests.benchmarks.bench_following

Every ``interval`` (0.05 s) following reads each running answer's tokens, forecasts the set and
resizes its reservations (``Following.resize``), on the event loop vLLM's API server serves HTTP
from. Here vLLM's request states are plain objects (as in tests/test_vllm_following.py) and the
ledger is the in-process one; the answers are at random points of geometric lengths, and what
was learnt is a window of 256 such answers of the same declared limit. Rows: the CPU build's
cache (128-token blocks, a limit of 400) and a GPU's (16-token blocks, limits up to 4,096), all of
the growth (``GPU_ASGI_GROWTH=all``) beside pooled (0.99, the default), and pooled counted at
every step with the exact distribution (no bound on the work, as before the bound) where that
takes under a few seconds. The share is of the time between two readings.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import statistics
import time
from contextlib import ExitStack
from types import SimpleNamespace
from typing import Any
from unittest import mock

from gpu_asgi import Ledger, OutputLengths
from gpu_asgi._asgi.dependencies import ADMISSION_STATE_KEY
from gpu_asgi._vllm import forecast
from gpu_asgi._vllm.following import DEFAULT_INTERVAL, Following

ROUTE = "POST /v1/completions"
PROMPT = 20
#: (block size, declared limit, mean answer length, answers running, unbounded pooled too)
CASES = (
    (128, 400, 68, 15, True),
    (128, 400, 68, 60, True),
    (16, 400, 68, 60, True),
    (16, 2048, 300, 100, True),
    (16, 4096, 500, 256, False),
)


def geometric(count: int, mean: int, limit: int, rng: random.Random) -> list[int]:
    stop = 1 / mean
    return [min(limit - 1, math.ceil(math.log(1 - rng.random()) / math.log(1 - stop))) for _ in range(count)]


async def reading_ms(block: int, limit: int, mean: int, answers: int, growth: float | None, repeats: int) -> float:
    """The median milliseconds of one ``Following.resize`` over ``repeats`` readings."""
    rng = random.Random(2)
    lengths = OutputLengths(0.5)
    for length in geometric(256, mean, limit, rng):
        lengths.observe(length, ROUTE, limit=limit)
    predicted = lengths.predict(limit, ROUTE)
    engine = SimpleNamespace(output_processor=SimpleNamespace(request_states={}))
    per_block = 1000
    ledger = Ledger(10**12)
    following = Following(ledger, engine, block_size=block, bytes_per_block=per_block, growth_quantile=growth)
    await following.tick()
    for i in range(answers):
        name = f"a{i}"
        _, followed = following.enter({"type": "http", "headers": [(b"x-request-id", name.encode())]})
        followed.state[ADMISSION_STATE_KEY] = SimpleNamespace(
            reservation=await ledger.reserve(math.ceil((PROMPT + predicted) / block) * per_block),
            prompt_tokens=PROMPT, max_new_tokens=limit, batch=1, reserved_tokens=predicted,
            endpoint_grows=lambda: None,
            survival_curve=lambda tokens: lengths.survival_curve(tokens, limit, ROUTE),
        )
        tokens = rng.randint(0, 2 * mean)
        engine.output_processor.request_states[f"cmpl-{name}-0"] = SimpleNamespace(
            request_id=name, external_req_id=f"cmpl-{name}-0",
            detokenizer=SimpleNamespace(num_output_tokens=lambda tokens=tokens: tokens),
        )
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        following.resize()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


async def run(repeats: int) -> None:
    print("| blocks of | limit | answers | all growth ms | pooled 0.99 ms | share of 50 ms | pooled, unbounded ms |")
    print("|--:|--:|--:|--:|--:|--:|--:|")
    for block, limit, mean, answers, unbounded in CASES:
        exact = await reading_ms(block, limit, mean, answers, None, repeats)
        pooled = await reading_ms(block, limit, mean, answers, 0.99, repeats)
        slow: Any = "-"
        if unbounded:
            with ExitStack() as stack:
                stack.enter_context(mock.patch.object(forecast, "MAX_POINTS", 10**9))
                stack.enter_context(mock.patch.object(forecast, "MAX_EXACT", 10**12))
                slow = f"{await reading_ms(block, limit, mean, answers, 0.99, 1):.1f}"
        share = pooled / (DEFAULT_INTERVAL * 1000)
        print(f"| {block} | {limit} | {answers} | {exact:.2f} | {pooled:.2f} | {share:.0%} | {slow} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=21, help="readings timed per row (the median is shown)")
    asyncio.run(run(parser.parse_args().repeats))


if __name__ == "__main__":
    main()
