"""A private ``redis-server`` on a free loopback port, for the shared-ledger tests and benchmark."""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator, Sequence

import pytest
import redis

REDIS_SERVER = shutil.which("redis-server")
#: The one reason these tests skip; CI installs redis-server (see .ci/run).
requires_redis_server = pytest.mark.skipif(
    REDIS_SERVER is None, reason="redis-server is not on PATH (apt-get install redis-server; .ci/run installs it)"
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _server_version() -> tuple[int, ...]:
    assert REDIS_SERVER is not None
    out = subprocess.run([REDIS_SERVER, "--version"], capture_output=True, text=True, check=True).stdout
    match = re.search(r"v=(\d+)\.(\d+)", out)
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


class RedisServer:
    """``redis-server --port N --save '' --appendonly no``; stop and start again on the same port."""

    def __init__(self, port: int | None = None, args: Sequence[str] = ()) -> None:
        self.port = port or free_port()
        #: More ``redis-server`` arguments (``--replicaof``, ``--dir``, ...).
        self.args = list(args)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        assert REDIS_SERVER is not None and self.process is None
        args = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        if _server_version() >= (7, 0):
            args += ["--enable-debug-command", "local"]  # DEBUG SLEEP plays a slow Redis
        args += self.args
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            with contextlib.suppress(redis.ConnectionError), self.client() as client:
                if client.ping():
                    return self
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.02)

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(10)
            self.process = None

    def kill(self) -> None:
        """SIGKILL: the server dies at once, as in a crash, its unreplicated writes with it."""
        if self.process is not None:
            self.process.kill()
            self.process.wait(10)
            self.process = None

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5, decode_responses=True)

    def ledger_state(self, namespace: str) -> dict[str, object]:
        """What the namespace holds in Redis: bytes reserved, leases, tickets."""
        tag = "{" + namespace + "}"
        with self.client() as client:
            reserved = {device: int(n) for device, n in client.hgetall(f"{tag}:reserved").items()}
            return {
                "reserved": sum(reserved.values()),
                "leases": client.hlen(f"{tag}:lease"),
                "tickets": client.hlen(f"{tag}:ticket"),
                "queued": client.zcard(f"{tag}:queue"),
            }


EMPTY = {"reserved": 0, "leases": 0, "tickets": 0, "queued": 0}


@contextlib.contextmanager
def running_redis() -> Iterator[RedisServer]:
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    """One server per test module; tests keep apart by namespace."""
    with running_redis() as server:
        yield server


@pytest.fixture
def own_redis_server() -> Iterator[RedisServer]:
    """A server this test alone may stop, restart or stall."""
    with running_redis() as server:
        yield server


@pytest.fixture
def namespace() -> str:
    return f"test-{uuid.uuid4().hex[:10]}"


async def eventually(predicate: Callable[[], object], timeout: float = 10.0, interval: float = 0.02) -> float:
    """Poll ``predicate()`` (sync, e.g. a look at Redis) until true; the seconds it took, or fail."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"still false after {timeout} s: {predicate}")
        await asyncio.sleep(interval)
    return time.monotonic() - start
