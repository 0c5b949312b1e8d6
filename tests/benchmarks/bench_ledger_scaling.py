"""Ledger cost against queue length, and a 1,000-waiter burst across 4 processes through Redis.

    python -m tests.benchmarks.bench_ledger_scaling [--waiters 10 100 1000] [--admissions 2000]

**CPU per admission.** ``N`` clients loop reserve → hold 2 ms → release against a budget that
holds 8 of them at once, so about ``N - 8`` always wait; sizes (1-8 units) and priorities (0-2)
vary, so waiters spread over several lanes. CPU per admission is the process's CPU time
(``time.process_time``) for the in-process ledger, and redis-server's (``INFO`` used_cpu_sys +
used_cpu_user) for the Redis ledger, each divided by the admissions made.

**Burst.** 4 processes × 250 clients each reserve once on one shared budget that holds 10 of
them, hold 5 ms and release: every outcome is counted (the bar: no ``ledger-unavailable`` while
Redis is up). Without ``--redis-url`` a private ``redis-server`` is started on a free port.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
import uuid
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from typing import Any

import redis

from gpu_asgi import GPUAdmissionError, Ledger
from gpu_asgi._ledger.redis.ledger import RedisLedger

from ._report import table, write_report

UNIT = 1 << 20
AT_ONCE = 8  # clients the budget holds at once (of the largest size)


def redis_cpu(url: str) -> float:
    with redis.Redis.from_url(url) as client:
        info = client.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


async def cpu_per_admission(kind: str, url: str, waiters: int, admissions: int) -> dict[str, Any]:
    budget = AT_ONCE * 8 * UNIT
    ledger: Any
    if kind == "in-process":
        ledger = Ledger(budget, max_queue=100_000, max_wait=600)
    else:
        ledger = RedisLedger(url, budget, namespace=f"scale-{uuid.uuid4().hex[:8]}", max_queue=100_000, max_wait=600)
        await ledger.refresh_statistics()
    rng = random.Random(waiters)
    done = 0
    warmup = min(admissions // 4, 500)
    marks: dict[str, float] = {}

    refused: dict[str, int] = {}

    async def client() -> None:
        nonlocal done
        while done < admissions + warmup:
            try:
                reservation = await ledger.reserve(rng.randint(1, 8) * UNIT, priority=rng.randint(0, 2))
            except GPUAdmissionError as exc:
                refused[exc.reason] = refused.get(exc.reason, 0) + 1
                await asyncio.sleep(0.01)
                continue
            done += 1
            if done == warmup:
                marks["cpu"] = time.process_time() if kind == "in-process" else redis_cpu(url)
                marks["wall"] = time.perf_counter()
            await asyncio.sleep(0.002)
            reservation.release()

    clients = [asyncio.ensure_future(client()) for _ in range(waiters + AT_ONCE)]
    await asyncio.gather(*clients)
    cpu = (time.process_time() if kind == "in-process" else redis_cpu(url)) - marks["cpu"]
    counted = done - warmup
    if isinstance(ledger, RedisLedger):
        await ledger.aclose()
    return {
        "ledger": kind,
        "waiters": waiters,
        "admissions": counted,
        "cpu_us_per_admission": cpu / counted * 1e6,
        "admissions_per_second": counted / (time.perf_counter() - marks["wall"]),
        "refused": refused,
    }


async def _burst_process(url: str, namespace: str, clients: int, start_at: float) -> dict[str, int]:
    ledger = RedisLedger(url, 10 * UNIT, namespace=namespace, max_queue=100_000, max_wait=120)
    await ledger.refresh_statistics()
    outcomes: dict[str, int] = {}
    await asyncio.sleep(max(0.0, start_at - time.time()))

    async def client() -> None:
        try:
            reservation = await ledger.reserve(UNIT)
        except GPUAdmissionError as exc:
            outcomes[exc.reason] = outcomes.get(exc.reason, 0) + 1
            return
        await asyncio.sleep(0.005)
        reservation.release()
        outcomes["admitted"] = outcomes.get("admitted", 0) + 1

    await asyncio.gather(*(client() for _ in range(clients)))
    await ledger.aclose()
    return outcomes


def _burst(args: tuple[str, str, int, float]) -> dict[str, int]:
    return asyncio.run(_burst_process(*args))


def burst(url: str, processes: int, total: int) -> dict[str, Any]:
    namespace = f"burst-{uuid.uuid4().hex[:8]}"
    start_at = time.time() + 2.0 + 0.5 * processes
    before = redis_cpu(url)
    with ProcessPoolExecutor(processes, mp_context=get_context("spawn")) as pool:
        results = list(pool.map(_burst, [(url, namespace, total // processes, start_at)] * processes))
    merged: dict[str, int] = {}
    for result in results:
        for key, n in result.items():
            merged[key] = merged.get(key, 0) + n
    return {"processes": processes, "waiters": total, "outcomes": merged, "redis_cpu_s": redis_cpu(url) - before}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--waiters", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--admissions", type=int, default=2000)
    parser.add_argument("--burst", type=int, default=1000, help="waiters in the 4-process burst (0: skip)")
    parser.add_argument("--redis-url")
    options = parser.parse_args()
    server = None
    if options.redis_url is None:
        from tests._redis import RedisServer

        server = RedisServer().start()
    url = options.redis_url or server.url  # type: ignore[union-attr]
    rows: list[dict[str, Any]] = []
    bursts = []
    try:
        for kind in ("in-process", "redis"):
            for waiters in options.waiters:
                rows.append(asyncio.run(cpu_per_admission(kind, url, waiters, options.admissions)))
                print(rows[-1], flush=True)
        if options.burst:
            bursts.append(burst(url, 4, options.burst))
            print(bursts[-1], flush=True)
    finally:
        if server is not None:
            server.stop()
    print()
    print(
        table(
            [
                [
                    r["ledger"],
                    r["waiters"],
                    r["admissions"],
                    r["cpu_us_per_admission"],
                    r["admissions_per_second"],
                    r["refused"],
                ]
                for r in rows
            ],
            ["ledger", "waiters", "admissions", "CPU µs / admission", "admissions/s", "refused"],
        )
    )
    for b in bursts:
        outcomes, cpu = b["outcomes"], b["redis_cpu_s"]
        print(f"\nburst: {b['waiters']} waiters over {b['processes']} processes: {outcomes}, Redis CPU {cpu:.2f} s")
    path = write_report("bench_ledger_scaling", {"settings": vars(options), "results": rows, "bursts": bursts})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
