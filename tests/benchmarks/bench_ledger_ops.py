"""Ledger operations: the in-process ``Ledger`` against the shared ``RedisLedger``, 1 and 4 processes.

    python -m tests.benchmarks.bench_ledger_ops [--seconds 3] [--clients 16] [--redis-url URL]
        [--workloads single free contended refused] [--ledgers in-process redis]

Each process runs coroutines ("clients") that loop reserve → release for ``--seconds``.
*ops/s* counts completed reserve+release pairs over all processes; *admission latency* is the
time ``await ledger.reserve()`` takes (p50/p99 over every call). The workloads:

- ``single``: one client per process, the budget always has room — one admission's own latency;
- ``free``: ``--clients`` per process, the budget always has room — throughput;
- ``contended``: ``--clients`` per process each hold 1–4 MiB for 1 ms against one 8 MiB budget
  (so most clients queue, and four processes queue four times as hard): queueing, wake-ups and
  the bypass rule at work;
- ``refused`` (not in the default run): the budget is held and ``max_queue`` is 0, so every
  reserve is refused ``queue-full``; *ops/s* counts refusals: the cost of answering overload.

With 4 processes the in-process rows are four *separate* budgets (that is the over-commit a
shared ledger prevents); they show the ceiling, not a correct configuration. Without
``--redis-url`` a private ``redis-server`` is started on a free loopback port.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import statistics
import time
import uuid
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from typing import Any

from gpu_asgi import Ledger, QueueFull
from gpu_asgi._ledger.redis.ledger import RedisLedger

from ._report import table, write_report

UNIT = 1 << 20
CONTENDED_BUDGET_UNITS = 8


async def _clients(
    kind: str, workload: str, redis_url: str, namespace: str, clients: int, seconds: float, start_at: float
) -> dict[str, Any]:
    budget = {"contended": CONTENDED_BUDGET_UNITS * UNIT, "refused": UNIT}.get(workload, 1 << 40)
    clients = 1 if workload == "single" else clients
    max_queue = 0 if workload == "refused" else 10_000
    ledger: Any = (
        Ledger(budget, max_queue=max_queue)
        if kind == "in-process"
        else RedisLedger(redis_url, budget, namespace=namespace, max_queue=max_queue, redis_timeout=5.0)
    )
    latencies: list[float] = []
    ops = 0
    rng = random.Random(os.getpid())
    hold = 0.001 if workload == "contended" else 0.0
    if isinstance(ledger, RedisLedger):
        await ledger.refresh_statistics()  # connected and scripts loaded before the clock starts
    holder = None
    if workload == "refused":
        with contextlib.suppress(QueueFull):  # one process of a shared budget holds it
            holder = await ledger.reserve(UNIT)
    await asyncio.sleep(max(0.0, start_at - time.time()))
    stop = time.perf_counter() + seconds

    async def client() -> None:
        nonlocal ops
        while time.perf_counter() < stop:
            nbytes = rng.randint(1, 4) * UNIT if workload == "contended" else UNIT
            began = time.perf_counter()
            try:
                reservation = await ledger.reserve(nbytes)
            except QueueFull:
                if workload != "refused":
                    raise
                latencies.append(time.perf_counter() - began)
                ops += 1
                await asyncio.sleep(0)
                continue
            if workload == "refused":  # the holder let go (another process's, at its end): not counted
                reservation.release()
                continue
            latencies.append(time.perf_counter() - began)
            if hold:
                await asyncio.sleep(hold)
            reservation.release()
            ops += 1
            if not hold:
                await asyncio.sleep(0)  # let the other clients (and background releases) run

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    elapsed = time.perf_counter() - started  # refusals leave nothing to land
    if holder is not None:  # held until every process's clients have stopped
        await asyncio.sleep(max(0.0, stop + 1.0 - time.perf_counter()))
        holder.release()
    if isinstance(ledger, RedisLedger):
        await ledger.aclose()  # every release has landed in Redis
    if workload != "refused":
        elapsed = time.perf_counter() - started
    return {"ops": ops, "elapsed": elapsed, "latencies": latencies}


def _process(args: tuple[str, str, str, str, int, float, float]) -> dict[str, Any]:
    return asyncio.run(_clients(*args))


def run(kind: str, workload: str, processes: int, redis_url: str, clients: int, seconds: float) -> dict[str, Any]:
    namespace = f"bench-{uuid.uuid4().hex[:8]}"  # one shared budget for this run's processes
    start_at = time.time() + 1.5 + 0.5 * processes  # after every process has imported and connected
    job = (kind, workload, redis_url, namespace, clients, seconds, start_at)
    with ProcessPoolExecutor(processes, mp_context=get_context("spawn")) as pool:
        results = list(pool.map(_process, [job] * processes))
    latencies = sorted(x for result in results for x in result["latencies"])
    elapsed = max(result["elapsed"] for result in results)
    return {
        "ledger": kind,
        "processes": processes,
        "workload": workload,
        "ops_per_second": sum(result["ops"] for result in results) / elapsed,
        "p50_us": statistics.median(latencies) * 1e6,
        "p99_us": latencies[int(0.99 * (len(latencies) - 1))] * 1e6,
        "operations": len(latencies),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--clients", type=int, default=16, help="concurrent coroutines per process")
    parser.add_argument("--redis-url", help="an existing Redis; default: start a private redis-server")
    parser.add_argument("--workloads", nargs="+", default=["single", "free", "contended"])
    parser.add_argument("--ledgers", nargs="+", default=["in-process", "redis"])
    options = parser.parse_args()

    server = None
    if options.redis_url is None:
        from tests._redis import RedisServer

        server = RedisServer().start()
    url = options.redis_url or server.url  # type: ignore[union-attr]
    rows = []
    try:
        for workload in options.workloads:
            for kind, processes in (("in-process", 1), ("in-process", 4), ("redis", 1), ("redis", 4)):
                if kind not in options.ledgers:
                    continue
                rows.append(run(kind, workload, processes, url, options.clients, options.seconds))
                row = rows[-1]
                print(f"{kind:10} ×{processes} {workload:9} {row['ops_per_second']:10.0f} ops/s", flush=True)
    finally:
        if server is not None:
            server.stop()
    header = ["workload", "ledger", "processes", "ops/s", "admission p50 µs", "admission p99 µs"]
    print()
    print(
        table(
            [
                [r["workload"], r["ledger"], r["processes"], round(r["ops_per_second"]), r["p50_us"], r["p99_us"]]
                for r in rows
            ],
            header,
        )
    )
    settings = {"seconds": options.seconds, "clients_per_process": options.clients, "cpus": os.cpu_count()}
    path = write_report("bench_ledger_ops", {"settings": settings, "results": rows})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
