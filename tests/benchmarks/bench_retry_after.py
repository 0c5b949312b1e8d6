"""How true is ``Retry-After``? A steady drain, a 20 s idle gap, then a burst, on a simulated clock.

    python -m tests.benchmarks.bench_retry_after [--seed 1] [--steady 120] [--gap 20] [--burst 300]

The in-process ``Ledger`` runs on a virtual clock (``clock=``): requests of 1-8 units hold their
bytes for an exponentially distributed time (mean 2 s) after admission, against a budget of 64
units. Phase 1: arrivals at 6.5/s (about 90 % of what the budget drains) for ``--steady`` s.
Phase 2: no arrivals for ``--gap`` s (the queue drains, then the GPU idles). Phase 3: ``--burst``
requests at once, then arrivals at 6.5/s for 60 s. For every request that has to wait, the
``Retry-After`` a refused request would have been given at that instant
(``ledger.retry_after(nbytes)``) is compared with the wait it really had until admission; the
ratio's distribution is reported for waits of at least 1 s (the header's resolution).
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import itertools
import random
import statistics
from typing import Any

from gpu_asgi import Ledger, Reservation

from ._report import table, write_report

BUDGET = 64
RATE = 6.5
MEAN_HOLD = 2.0
AFTER_BURST = 60.0


def workload(seed: int, steady: float, gap: float, burst: int) -> list[tuple[float, int, float, str]]:
    """(arrival time, units, hold seconds, phase)."""
    rng = random.Random(seed)
    arrivals: list[tuple[float, int, float, str]] = []

    def one(t: float, phase: str) -> None:
        arrivals.append((t, rng.randint(1, 8), rng.expovariate(1 / MEAN_HOLD), phase))

    t = 0.0
    while (t := t + rng.expovariate(RATE)) < steady:
        one(t, "steady")
    burst_at = steady + gap
    for _ in range(burst):
        one(burst_at, "burst")
    t = burst_at
    while (t := t + rng.expovariate(RATE)) < burst_at + AFTER_BURST:
        one(t, "after burst")
    return arrivals


async def simulate(arrivals: list[tuple[float, int, float, str]]) -> list[dict[str, Any]]:
    now = [0.0]
    ledger = Ledger(BUDGET, max_queue=100_000, max_wait=float("inf"), clock=lambda: now[0])
    events: list[tuple[float, int, str, Any]] = []
    order = itertools.count()
    for arrival in arrivals:
        heapq.heappush(events, (arrival[0], next(order), "arrive", arrival))
    pending: dict[asyncio.Task[Reservation], dict[str, Any]] = {}
    records: list[dict[str, Any]] = []

    async def settle() -> None:
        for _ in range(5):
            await asyncio.sleep(0)
        for task in [t for t in pending if t.done()]:
            record = pending.pop(task)
            record["wait"] = now[0] - record["arrived"]
            heapq.heappush(events, (now[0] + record["hold"], next(order), "release", task.result()))

    while events:
        now[0], _, kind, payload = heapq.heappop(events)
        if kind == "release":
            payload.release()
        else:
            _, units, hold, phase = payload
            hint = ledger.retry_after(units)  # what a request refused now would be told
            record = {"arrived": now[0], "hold": hold, "phase": phase, "hint": hint, "wait": 0.0}
            pending[asyncio.ensure_future(ledger.reserve(units))] = record
            records.append(record)
        await settle()
    return records


def summarize(records: list[dict[str, Any]], phase: str | None) -> dict[str, Any]:
    chosen = [r for r in records if r["wait"] >= 1.0 and (phase is None or r["phase"] == phase)]
    ratios = sorted(r["hint"] / r["wait"] for r in chosen)
    if not ratios:
        return {"phase": phase or "all", "requests": 0}

    def q(p: float) -> float:
        return ratios[min(len(ratios) - 1, int(p * len(ratios)))]

    far = statistics.median(abs(x - 1) for x in ratios)
    return {
        "phase": phase or "all",
        "requests": len(ratios),
        "p10": q(0.10),
        "median": statistics.median(ratios),
        "p90": q(0.90),
        "max_hint_s": max(r["hint"] for r in chosen),
        "max_wait_s": max(r["wait"] for r in chosen),
        "median_abs_error": far,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--steady", type=float, default=120.0)
    parser.add_argument("--gap", type=float, default=20.0)
    parser.add_argument("--burst", type=int, default=300)
    options = parser.parse_args()
    records = asyncio.run(simulate(workload(options.seed, options.steady, options.gap, options.burst)))
    rows = [summarize(records, phase) for phase in (None, "steady", "burst", "after burst")]
    columns = ["phase", "requests", "p10", "median", "p90", "max_hint_s", "max_wait_s"]
    print(table([[row.get(c, "-") for c in columns] for row in rows], columns))
    overall = rows[0]
    ok = 0.67 <= overall["median"] <= 1.5 and 0.5 <= overall["p90"] <= 2.0
    print(
        f"\nRetry-After / actual wait, waits >= 1 s: median {overall['median']:.2f}, p90 {overall['p90']:.2f}"
        f" -> {'meets' if ok else 'MISSES'} the bar (median in [0.67, 1.5], p90 in [0.5, 2])"
    )
    path = write_report("bench_retry_after", {"settings": vars(options), "results": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
