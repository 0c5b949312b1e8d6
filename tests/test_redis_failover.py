"""The shared ledger across a Redis failover: a replica promoted in the primary's place may miss the
last writes the primary acknowledged, and no byte may be granted twice because of it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpu_asgi import LedgerUnavailable
from gpu_asgi._ledger.redis.ledger import RedisLedger

from . import _redis
from ._redis import RedisServer, eventually, requires_redis_server

pytestmark = requires_redis_server
own_redis_server = _redis.own_redis_server  # fixture
namespace = _redis.namespace  # fixture


@pytest.fixture
def primary(own_redis_server: RedisServer) -> RedisServer:
    return own_redis_server


@pytest.fixture
def replica(primary: RedisServer, tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(args=["--replicaof", "127.0.0.1", str(primary.port), "--dir", str(tmp_path)]).start()
    deadline = time.monotonic() + 20
    while server.client().info("replication").get("master_link_status") != "up":
        assert time.monotonic() < deadline, "the replica did not sync"
        time.sleep(0.02)
    try:
        yield server
    finally:
        server.stop()


def reserved(server: RedisServer, namespace: str) -> object:
    return server.ledger_state(namespace)["reserved"]


async def test_a_promoted_replica_that_missed_the_last_writes_grants_no_byte_twice(
    primary: RedisServer, replica: RedisServer, tmp_path: Path, namespace: str
) -> None:
    holder = RedisLedger(primary.url, 100, namespace=namespace, lease_ttl=1.5)
    other = RedisLedger(primary.url, 100, namespace=namespace, lease_ttl=1.5)
    copied = await holder.reserve(30)
    await other.refresh_statistics()  # both workers have seen this dataset
    await eventually(lambda: reserved(replica, namespace) == 30)  # the replica has copied the lease
    # The replica stops copying (promoted by hand); the primary goes on acknowledging writes ...
    with replica.client() as client:
        client.execute_command("REPLICAOF", "NO", "ONE")
    lost = await holder.reserve(50)
    assert reserved(primary, namespace) == 80
    # ... and dies. The replica's dataset takes over at the primary's address, as a managed
    # service's endpoint moves to the promoted replica: the boot id is the same, the 50 are gone.
    with replica.client() as client:
        client.save()
    primary.kill()
    replica.stop()
    promoted = RedisServer(port=primary.port, args=["--dir", str(tmp_path)]).start()
    try:
        assert reserved(promoted, namespace) == 30
        # Another worker asks for what the lost lease holds: the new server's first script sees
        # another Redis process, grants pause, and the holder's heartbeat puts its 50 back.
        everything = asyncio.ensure_future(other.reserve(70))
        await eventually(lambda: reserved(promoted, namespace) == 80)
        await asyncio.sleep(1.0)
        assert not everything.done()  # 80 + 70 > 100: it waits, no byte is granted twice
        lost.release()
        (await asyncio.wait_for(everything, 5)).release()
        copied.release()
        await eventually(lambda: promoted.ledger_state(namespace) == _redis.EMPTY)
        assert (await other.refresh_statistics()).failovers == 1  # the gpu_asgi_ledger_failovers gauge
    finally:
        await holder.aclose()
        await other.aclose()
        promoted.stop()


async def test_with_replicas_a_grant_no_replica_has_is_given_back_not_used(
    primary: RedisServer, replica: RedisServer, namespace: str
) -> None:
    ledger = RedisLedger(primary.url, 100, namespace=namespace, replicas=1, redis_timeout=0.5)
    try:
        granted = await ledger.reserve(10)  # the replica has it: used
        replica.kill()
        # Nobody could have this grant after a failover: it goes back, and admission fails closed.
        with pytest.raises(LedgerUnavailable):
            await ledger.reserve(20)
        await eventually(lambda: reserved(primary, namespace) == 10)
        granted.release()
        await eventually(lambda: primary.ledger_state(namespace) == _redis.EMPTY)
    finally:
        await ledger.aclose()


def test_replicas_defaults_to_one_behind_sentinel_and_none_otherwise() -> None:
    assert RedisLedger("redis://127.0.0.1:1/0", 100).replicas == 0
    assert RedisLedger("redis+sentinel://127.0.0.1:1/gpu", 100).replicas == 1
    assert RedisLedger("redis+sentinel://127.0.0.1:1/gpu", 100, replicas=0).replicas == 0
    with pytest.raises(ValueError, match="replicas"):
        RedisLedger("redis://127.0.0.1:1/0", 100, replicas=-1)
