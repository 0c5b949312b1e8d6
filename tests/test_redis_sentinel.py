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

from gpu_asgi import AdmissionRejected, Ledger, LedgerUnavailable, RedisLedger, ledger_from_url
from gpu_asgi._ledger.redis.connect import parse_sentinel_url, redis_client
from gpu_asgi._ledger.redis.primary import SentinelPrimary, _fields

from ._redis import EMPTY, RedisServer, eventually, requires_redis_server
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


def test_a_sentinels_reply_is_read_raw_or_as_redis_py_parses_it() -> None:
    """``SENTINEL MASTER`` comes as a flat list (RESP2, unparsed) or as redis-py's dict, whose
    flags are a set in some versions: the same fields either way."""
    flat = [b"name", b"gpu", b"ip", b"10.0.0.1", b"port", b"6380", b"flags", b"master,o_down"]
    parsed = {"name": "gpu", "ip": "10.0.0.1", "port": 6380, "flags": {"o_down", "master"}, "is_master": True}
    for reply in (flat, parsed):
        fields = _fields(reply)
        assert (fields["ip"], fields["port"]) == ("10.0.0.1", "6380")
        assert set(fields["flags"].split(",")) == {"master", "o_down"}


class Told:
    """A sentinel that answers ``SENTINEL MASTER`` with a fixed primary (or fails to answer)."""

    def __init__(self, port: int | None, flags: str = "master") -> None:
        self.port, self.flags = port, flags

    async def execute_command(self, *args: Any) -> list[bytes]:
        if self.port is None:
            raise ConnectionError("unreachable")
        return [b"ip", b"127.0.0.1", b"port", str(self.port).encode(), b"flags", self.flags.encode()]


@pytest.mark.parametrize(
    ("told", "named"),
    [
        ((Told(1), Told(1), Told(1)), 1),
        ((Told(1), Told(1), Told(None)), 1),  # an unreachable one has no say
        ((Told(1), Told(None), Told(None)), None),  # no majority answered
        ((Told(2), Told(1), Told(2)), None),  # a failover still spreading: one lags
        ((Told(1), Told(1, "master,o_down"), Told(1)), None),
        ((Told(1), Told(1, "master,failover_in_progress"), Told(1)), None),
    ],
)
async def test_the_sentinels_agree_only_when_every_one_that_answers_names_one_address(
    told: tuple[Told, ...], named: int | None
) -> None:
    primary = SentinelPrimary(told, "gpu")  # type: ignore[arg-type]
    assert await primary.agreed(1.0) == (None if named is None else ("127.0.0.1", named))
    assert await primary.names(("127.0.0.1", 1), 1.0) is (named == 1)


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
    group.wait_replicated()  # grants wait for one replica (a Sentinel URL's default)
    await eventually(lambda: ledger.available, timeout=30)  # type: ignore[attr-defined]
    more = await reserve_as_a_client(ledger, 60)
    # Sentinels sometimes fail over twice (a split vote, then a later epoch promotes the other
    # replica): the grant was made on the primary they name now, and only there.
    promoted = group.wait_replicated()
    assert promoted.ledger_state("follow")["reserved"] == 100
    held.release()
    more.release()
    await eventually(lambda: promoted.ledger_state("follow") == EMPTY)
    await ledger.aclose()  # type: ignore[attr-defined]


async def reserve_as_a_client(ledger: Any, nbytes: int, timeout: float = 30) -> Any:
    """Reserve as a client does: a 503 while the failover settles is asked again after its
    ``Retry-After``; any other refusal fails the test."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await asyncio.wait_for(ledger.reserve(nbytes), timeout)
        except LedgerUnavailable as exc:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(exc.retry_after or 0.2)


def address(server: RedisServer) -> tuple[str, int]:
    return "127.0.0.1", server.port


async def test_the_sentinels_name_the_primary_by_its_address_a_majority_answering(group: Sentinels) -> None:
    client = redis_client(group.url, max_connections=4, timeout=1.0)
    primary = SentinelPrimary.of(client)
    assert primary is not None and primary.service == "gpu" and len(primary.sentinels) == 3
    assert SentinelPrimary.of(redis_client(group.primary.url, max_connections=2, timeout=1.0)) is None
    assert await primary.names(address(group.primary), 1.0)
    assert not await primary.names(address(group.replicas[0]), 1.0)  # a replica, though the sentinels know it
    assert not await SentinelPrimary(primary.sentinels, "unknown").names(address(group.primary), 1.0)
    group.processes[0].kill()  # one of three sentinels gone: the other two are a majority
    group.processes[0].wait()
    assert await primary.names(address(group.primary), 1.0)
    group.processes[1].kill()  # one left: no majority, no grant
    group.processes[1].wait()
    assert not await primary.names(address(group.primary), 1.0)
    await client.aclose()


async def test_a_grant_from_a_server_the_sentinels_do_not_name_is_given_back_never_used(group: Sentinels) -> None:
    """An old primary back from a stall, before the sentinels demote it, still grants from its
    stale dataset: played by a server outside the group that the ledger reaches while the
    sentinels name the group's primary. Its grants are given back and the request refused."""
    stale = RedisServer().start()
    sentinels = redis_client(group.url, max_connections=4, timeout=1.0)
    ledger = RedisLedger(stale.url, 100, namespace="stale", heartbeat=0.2, lease_ttl=1.0, replicas=0)
    ledger._primary = SentinelPrimary.of(sentinels)  # what a Sentinel URL gives; here it names another server
    try:
        assert await ledger.reserve_if_free(40) is None
        await asyncio.sleep(0.3)  # past the heartbeat for which a failed call skips Redis
        with pytest.raises(LedgerUnavailable):
            await ledger.reserve(40)  # asked of the stale server, granted there, given back
        await eventually(lambda: stale.ledger_state("stale") == EMPTY)
        assert stale.client().hget("{stale}:counts", "admitted") == "2", "both asks were granted there first"
    finally:
        await ledger.aclose()
        await sentinels.aclose()
        stale.stop()


async def contended(ledger: Any) -> list[str]:
    """Behind a full budget given back 30 bytes at a time, a heavy tenant queues three requests,
    then a light one three: the order in which they are granted, as fair share decides it (and
    the tenants' standing after earlier rounds, which the ledger keeps)."""
    held = [await ledger.reserve(n) for n in (30, 30, 40)]
    order: list[str] = []

    async def ask(tenant: str, index: int) -> None:
        reservation = await ledger.reserve(30, tenant=tenant, deadline=25)
        order.append(f"{tenant}{index}")
        await asyncio.sleep(0.8)
        reservation.release()

    tasks = []
    for tenant in ("heavy", "light"):
        for index in range(3):  # apart, so that each takes its place in the queue in this order
            tasks.append(asyncio.ensure_future(ask(tenant, index)))
            await asyncio.sleep(0.15)
    await asyncio.sleep(0.3)
    for lease in held:
        lease.release()
        await asyncio.sleep(0.3)
    await asyncio.gather(*tasks)
    return order


async def granting(ledger: Any, timeout: float = 30) -> None:
    """Until three grants in a row are acknowledged by a replica: on a busy machine the sentinels
    may still be moving the other replica to the new primary, and until it has synced, grants
    fail closed (``LedgerUnavailable``), as they should."""
    deadline, landed = time.monotonic() + timeout, 0
    while landed < 3:
        try:
            (await ledger.reserve(1)).release()
            landed += 1
        except AdmissionRejected:
            assert time.monotonic() < deadline, "no grant was acknowledged after the failover"
            landed = 0
            await asyncio.sleep(0.2)


async def test_after_a_failover_the_queue_order_and_fair_share_go_on_as_if_none_happened(group: Sentinels) -> None:
    """Two contended rounds on the in-process ledger are the reference. On the Sentinel group: one
    round, a failover (the primary killed, with requests waiting), then the second. The promoted
    replica holds the tenants' standing from the first round, so the second begins as the
    reference's does (the tenant served first before now waits), and each tenant's requests are
    granted in the order they were asked. (Later in a round two tenants' turns can come within
    milliseconds of each other, and real time decides them: the test does not compare those.)"""
    reference = Ledger(100, max_wait=30)
    expected = [await contended(reference) for _ in range(2)]
    assert expected[1][0] != expected[0][0]  # so a replica that lost the standing would begin otherwise
    # A loaded machine can take longer than the default second for the replica to acknowledge.
    ledger = ledger_from_url(group.url, 100, namespace="fair", lease_ttl=1.5, max_wait=30, redis_timeout=3.0)
    try:
        assert await contended(ledger) == expected[0]
        holder = await ledger.reserve(100)  # type: ignore[attr-defined]
        waiting = [asyncio.ensure_future(ledger.reserve(30, tenant=t, deadline=20)) for t in ("heavy", "light")]  # type: ignore[attr-defined]
        group.wait_replicated()
        old = group.primary.port
        killed = time.monotonic()
        group.primary.kill()
        # Those waiting are refused at once, with a Retry-After, not left to wait out their deadline.
        for outcome in await asyncio.gather(*waiting, return_exceptions=True):
            assert isinstance(outcome, AdmissionRejected) and outcome.retry_after > 0, outcome
        assert time.monotonic() - killed < 5
        holder.release()
        await eventually(lambda: group.master_port() not in (None, old), timeout=30)
        group.wait_replicated()  # grants wait for one replica (a Sentinel URL's default)
        await eventually(lambda: ledger.available, timeout=30)  # type: ignore[attr-defined]
        await eventually(lambda: group.server(group.master_port()).ledger_state("fair")["reserved"] == 0, timeout=15)  # type: ignore[union-attr]
        await granting(ledger)
        after = await contended(ledger)
        assert after[0] == expected[1][0], (after, expected[1])
        for tenant in ("heavy", "light"):
            assert [r for r in after if r.startswith(tenant)] == [f"{tenant}{i}" for i in range(3)], after
    finally:
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


@pytest.mark.parametrize("fault", ["kill", "stall"])
async def test_failovers_under_load_never_grant_a_byte_twice(group: Sentinels, tmp_path: Path, fault: str) -> None:
    """RUNS // 2 failovers in a row on one group, the primary killed (SIGKILL; it comes back as a
    replica) or stalled (SIGSTOP, as a network stall; the sentinels demote it when it runs again),
    each under load from WORKERS processes holding long leases."""
    recoveries: dict[str, list[float]] = {fault: []}
    for run in range(RUNS // 2):
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
    for kind, seconds in recoveries.items():
        print(f"{kind}: from the fault to the first grant after it: {min(seconds):.2f}-{max(seconds):.2f} s "
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
