"""Redis with a replica and three sentinels, all real processes on 127.0.0.1, for failover tests."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import redis

from ._redis import REDIS_SERVER, RedisServer, free_port

SERVICE = "gpu"
#: Sentinels call a primary down after this silence, and fail over at once (quorum 2 of 3).
DOWN_AFTER_MS = 1000


class Sentinels:
    """A primary, two replicas of it, and three sentinels watching them under ``SERVICE``: after a
    failover one replica is left, so grants that wait for one (``RedisLedger(replicas=1)``) go on."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.primary = RedisServer(args=["--dir", str(folder)])
        self.replicas: list[RedisServer] = []
        self.ports = [free_port() for _ in range(3)]
        self.processes: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{port}" for port in self.ports)
        return f"redis+sentinel://{hosts}/{SERVICE}/0"

    def start(self) -> Sentinels:
        assert REDIS_SERVER is not None
        self.primary.start()
        for index in range(2):
            folder = self.folder / f"replica-{index}"
            folder.mkdir(exist_ok=True)
            replica = RedisServer(args=["--replicaof", "127.0.0.1", str(self.primary.port), "--dir", str(folder)])
            self.replicas.append(replica.start())
        self.wait_in_sync()
        for index, port in enumerate(self.ports):
            config = self.folder / f"sentinel-{index}.conf"
            config.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {self.folder}\n"
                f"sentinel monitor {SERVICE} 127.0.0.1 {self.primary.port} 2\n"
                f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}\n"
                f"sentinel failover-timeout {SERVICE} 20000\n"
                f"sentinel parallel-syncs {SERVICE} 1\n"
            )
            self.processes.append(
                subprocess.Popen([REDIS_SERVER, str(config), "--sentinel"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            )
        deadline = time.monotonic() + 20
        while not all(self._sees_replica(port) for port in self.ports):
            if time.monotonic() > deadline:
                raise RuntimeError("the sentinels did not find the primary and its replica")
            time.sleep(0.05)
        return self

    def _sees_replica(self, port: int) -> bool:
        with contextlib.suppress(redis.RedisError), self.sentinel(port) as client:
            replicas = client.execute_command("SENTINEL", "REPLICAS", SERVICE)
            return bool(replicas)
        return False

    def sentinel(self, port: int) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=port, socket_timeout=2, decode_responses=True)

    def master_port(self) -> int | None:
        """The primary's port as the sentinels' majority says."""
        answers = []
        for port in self.ports:
            with contextlib.suppress(redis.RedisError), self.sentinel(port) as client:
                address = client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)
                answers.append(int(address[1]))
        return max(set(answers), key=answers.count) if answers else None

    def rejoin(self, server: RedisServer, primary: RedisServer) -> None:
        """A killed server back on its port, as a replica of ``primary`` (the sentinels keep it so)."""
        folder = self.folder / f"rejoined-{server.port}-{time.monotonic_ns()}"
        folder.mkdir()
        server.args = ["--replicaof", "127.0.0.1", str(primary.port), "--dir", str(folder)]
        server.start()

    def server(self, port: int | None) -> RedisServer | None:
        return next((s for s in (self.primary, *self.replicas) if s.port == port), None)

    def wait_replicated(self, replicas: int = 1, timeout: float = 30) -> RedisServer:
        """Until the sentinels' primary has ``replicas`` replicas online (after a failover, the
        other replica resyncs from the promoted one); that primary."""
        deadline = time.monotonic() + timeout
        while True:
            primary = self.server(self.master_port())
            if primary is not None and primary.process is not None:
                with contextlib.suppress(redis.RedisError), primary.client() as client:
                    info = client.info("replication")
                    online = [k for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)
                              and v.get("state") == "online"]
                    if info.get("role") == "master" and len(online) >= replicas:
                        return primary
            if time.monotonic() > deadline:
                raise RuntimeError("no primary with a replica online")
            time.sleep(0.05)

    def wait_in_sync(self, timeout: float = 20) -> None:
        """Until every replica's link to its primary is up."""
        deadline = time.monotonic() + timeout
        for replica in self.replicas:
            while True:
                with contextlib.suppress(redis.RedisError), replica.client() as client:
                    if client.info("replication").get("master_link_status") == "up":
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError("a replica did not sync")
                time.sleep(0.05)

    def stop(self) -> None:
        for process in self.processes:
            process.kill()
            process.wait(10)
        self.processes = []
        for server in (self.primary, *self.replicas):
            if server.process is not None and server.process.poll() is None:
                server.process.send_signal(signal.SIGCONT)  # a stalled one must run to stop
            server.stop()


@contextlib.contextmanager
def sentinels(folder: Path) -> Iterator[Sentinels]:
    group = Sentinels(folder)
    try:
        yield group.start()
    finally:
        group.stop()
