"""The shared ledger behind Redis Sentinel, with real processes: a primary, a replica, three
sentinels, and worker processes holding long leases while the primary is killed or stalled."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpu_asgi import ledger_from_url
from gpu_asgi._ledger.redis.connect import parse_sentinel_url

from ._redis import EMPTY, eventually, requires_redis_server
from ._sentinel import Sentinels, sentinels

pytestmark = requires_redis_server

ROOT = Path(__file__).resolve().parent.parent
BUDGET = 1_000_000
WORKERS = 3
RUNS = int(os.environ.get("GPUASGI_FAILOVER_RUNS", "10"))


def test_a_sentinel_url_names_the_sentinels_the_service_and_the_database() -> None:
    address = parse_sentinel_url("redis+sentinel://:s3cret@10.0.0.1:26379,10.0.0.2,[::1]:5000/gpu/2?sentinel_password=x")
    assert address.sentinels == (("10.0.0.1", 26379), ("10.0.0.2", 26379), ("::1", 5000))
    assert (address.service, address.db, address.password, address.sentinel_password) == ("gpu", 2, "s3cret", "x")
    assert not address.tls and parse_sentinel_url("rediss+sentinel://h/gpu").tls
    for bad in ("redis+sentinel://h:1", "redis+sentinel:///gpu", "redis+sentinel://h/gpu/x", "redis+sentinel://h/gpu?x=1"):
        with pytest.raises(ValueError):
            parse_sentinel_url(bad)


@pytest.fixture
def group(tmp_path: Path) -> Iterator[Sentinels]:
    with sentinels(tmp_path) as started:
        yield started


async def test_the_ledger_follows_sentinel_to_the_promoted_replica(group: Sentinels) -> None:
    ledger = ledger_from_url(group.url, 100, namespace="follow", lease_ttl=1.5)
    held = await ledger.reserve(40)  # type: ignore[attr-defined]
    group.wait_in_sync()
    old = group.primary.port
    group.primary.kill()
    await eventually(lambda: group.master_port() not in (None, old), timeout=30)
    # While no primary answered, admission failed closed; then it finds the promoted replica, with
    # no restart: the lease it copied is there, and a new request is admitted there.
    promoted = group.wait_replicated()  # grants wait for one replica (a Sentinel URL's default)
    await eventually(lambda: ledger.available, timeout=30)  # type: ignore[attr-defined]
    more = await asyncio.wait_for(ledger.reserve(60), 30)  # type: ignore[attr-defined]
    assert promoted.ledger_state("follow")["reserved"] == 100
    held.release()
    more.release()
    await eventually(lambda: promoted.ledger_state("follow") == EMPTY)
    await ledger.aclose()  # type: ignore[attr-defined]


def most_held_at_once(records: list[dict[str, Any]]) -> int:
    """The largest sum of leases the workers held at one instant (by their own records)."""
    events = []
    for record in records:
        if record["outcome"] == "granted":
            events += [(record["granted"], 1, record["bytes"]), (record["released"], -1, record["bytes"])]
    events.sort(key=lambda e: (e[0], e[1]))  # at a tie a release comes first
    held = most = 0
    for _, kind, nbytes in events:
        held += kind * nbytes
        most = max(most, held)
    return most


def run_workers(url: str, namespace: str, seconds: float, folder: Path) -> list[subprocess.Popen[bytes]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return [
        subprocess.Popen(
            [sys.executable, "-m", "tests._failover_worker", url, namespace, str(BUDGET), str(seconds),
             str(folder / f"worker-{i}.json"), str(i)],
            cwd=ROOT, env=env,
        )
        for i in range(WORKERS)
    ]


async def test_failovers_under_load_never_grant_a_byte_twice(group: Sentinels, tmp_path: Path) -> None:
    """RUNS failovers in a row on one group, alternately the primary killed (SIGKILL; it comes back
    as a replica) and stalled (SIGSTOP, as a network stall; the sentinels demote it when it runs
    again), each under load from WORKERS processes holding long leases."""
    recoveries: dict[str, list[float]] = {"kill": [], "stall": []}
    for run in range(RUNS):
        fault = "kill" if run % 2 == 0 else "stall"
        folder = tmp_path / f"run-{run}"
        folder.mkdir()
        namespace = f"chaos-{run}"
        old = group.wait_replicated(replicas=2)
        workers = run_workers(group.url, namespace, 5.0, folder)
        await asyncio.sleep(2.0)  # under load: leases held, requests queued
        assert old.process is not None
        faulted = time.monotonic()
        if fault == "kill":
            old.kill()
        else:
            old.process.send_signal(signal.SIGSTOP)  # it answers nobody, and keeps its connections
        await eventually(lambda port=old.port: group.master_port() not in (None, port), timeout=30)  # type: ignore[misc]
        new = group.server(group.master_port())
        assert new is not None
        if fault == "kill":
            group.rejoin(old, new)  # the old primary comes back, as a replica
        else:
            old.process.send_signal(signal.SIGCONT)  # back; the sentinels demote it
        for i in range(WORKERS):  # the workers ask until one of their requests asked after it is granted
            (folder / f"worker-{i}.json.fault").write_text(repr(faulted))
        for worker in workers:
            assert worker.wait(60) == 0
        records = [r for i in range(WORKERS) for r in json.loads((folder / f"worker-{i}.json").read_text())]
        assert not [r for r in records if r["outcome"] == "error"], records
        # The bound: by the workers' own records, never more held at once than the budget.
        assert most_held_at_once(records) <= BUDGET, fault
        # Every request answered within its wait (plus what Redis's timeout adds), none stuck.
        assert max(r["answered"] - r["asked"] for r in records) < 4.0 + 2.0
        after = [r["granted"] for r in records if r["outcome"] == "granted" and r["asked"] > faulted]
        assert after, f"{fault}: nothing was admitted after the failover"
        recoveries[fault].append(min(after) - faulted)
        # Afterwards the new primary holds no lease nobody holds: those whose release did not reach
        # it during the failover expire within the lease TTL.
        await settle(group, namespace)
    for fault, seconds in recoveries.items():
        print(f"{fault}: from the fault to the first grant after it: {min(seconds):.2f}-{max(seconds):.2f} s "
              f"(median {sorted(seconds)[len(seconds) // 2]:.2f} s, {len(seconds)} runs)")


async def settle(group: Sentinels, namespace: str, timeout: float = 15) -> None:
    """Until the namespace holds nothing on the primary; a script must run to reap what expired,
    and a statistics read is one."""
    ledger = ledger_from_url(group.url, BUDGET, namespace=namespace, replicas=0)
    deadline = time.monotonic() + timeout
    try:
        while True:
            with contextlib.suppress(Exception):
                await ledger.refresh_statistics()  # type: ignore[attr-defined]
                primary = group.server(group.master_port())
                if primary is not None and primary.ledger_state(namespace) == EMPTY:
                    return
            assert time.monotonic() < deadline, "leases nobody holds are still on the primary"
            await asyncio.sleep(0.5)
    finally:
        await ledger.aclose()  # type: ignore[attr-defined]
