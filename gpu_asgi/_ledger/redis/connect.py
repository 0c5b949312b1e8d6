"""The shared ledger's Redis client, from a URL: one server, or the primary that Sentinel names.

``redis://``, ``rediss://`` and ``unix://`` are redis-py's own URLs. A Sentinel deployment is
``redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/service[/db]`` (TLS to the data
nodes: ``rediss+sentinel://``; port 26379 when left out); the user and password are the data
nodes', and ``?sentinel_password=`` (and ``sentinel_username=``) are the sentinels' own if they
ask for one. The client asks the sentinels for the primary when it connects and again after a
connection fails, so the ledger follows a failover without a restart (docs/deployment.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff

SENTINEL_SCHEMES = frozenset({"redis+sentinel", "rediss+sentinel"})
SENTINEL_PORT = 26379


@dataclass(frozen=True, slots=True)
class SentinelAddress:
    """What a ``redis+sentinel://`` URL names."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    tls: bool = False
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    sentinel_username: str | None = None
    sentinel_password: str | None = field(default=None, repr=False)


def is_sentinel_url(url: str) -> bool:
    return urlsplit(url).scheme.lower() in SENTINEL_SCHEMES


def parse_sentinel_url(url: str) -> SentinelAddress:
    """The sentinels, service and db of a ``redis+sentinel://`` URL; ``ValueError`` saying what is wrong."""
    parts = urlsplit(url)
    if parts.scheme.lower() not in SENTINEL_SCHEMES:
        raise ValueError(f"not a Sentinel URL: {url!r} (redis+sentinel://host:26379,host2:26379/service)")
    credentials, _, hosts = parts.netloc.rpartition("@")
    sentinels = tuple(_host_port(item) for item in hosts.split(",") if item.strip())
    if not sentinels:
        raise ValueError("a Sentinel URL names at least one sentinel: redis+sentinel://host:26379/service")
    path = [p for p in parts.path.split("/") if p]
    if not path or len(path) > 2:
        raise ValueError("a Sentinel URL's path is /service or /service/db, e.g. redis+sentinel://host:26379/gpu/0")
    db = 0
    if len(path) == 2:
        if not path[1].isdigit():
            raise ValueError(f"the database must be a number, got {path[1]!r}")
        db = int(path[1])
    username = password = None
    if credentials:
        user, sep, secret = credentials.partition(":")
        username, password = (unquote(user) or None), (unquote(secret) if sep else None)
    query = {key: values[-1] for key, values in parse_qs(parts.query).items()}
    unknown = sorted(set(query) - {"sentinel_username", "sentinel_password"})
    if unknown:
        raise ValueError(f"unknown Sentinel URL option {unknown[0]!r} (sentinel_username, sentinel_password)")
    return SentinelAddress(
        sentinels, unquote(path[0]), db, parts.scheme.lower() == "rediss+sentinel", username, password,
        query.get("sentinel_username"), query.get("sentinel_password"),
    )


def _host_port(item: str) -> tuple[str, int]:
    """``host``, ``host:port`` or ``[v6 address]:port``."""
    item = item.strip()
    if item.startswith("["):
        host, _, rest = item[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else str(SENTINEL_PORT)
    elif item.count(":") == 1:
        host, port = item.split(":")
    elif ":" in item:
        raise ValueError(f"an IPv6 sentinel is written [address]:port, got {item!r}")
    else:
        host, port = item, str(SENTINEL_PORT)
    if not host or not port.isdigit():
        raise ValueError(f"a sentinel is host[:port], got {item!r}")
    return host, int(port)


def redis_client(url: str, *, max_connections: int, timeout: float) -> Redis:
    """A client for ``url`` whose calls wait for a free connection (a burst is not an outage) and
    reconnect once at once (after a restart, or to a newly promoted primary)."""
    retry = Retry(NoBackoff(), 1)
    if not is_sentinel_url(url):
        # timeout=None: a call waits for a connection as long as its own timeout allows.
        pool = BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=None, retry=retry,
            socket_timeout=timeout, socket_connect_timeout=timeout,
        )
        return Redis.from_pool(pool)  # the client owns the pool and closes it
    address = parse_sentinel_url(url)
    sentinel_kwargs: dict[str, Any] = {"socket_timeout": timeout, "socket_connect_timeout": timeout}
    if address.sentinel_password is not None:
        sentinel_kwargs |= {"username": address.sentinel_username, "password": address.sentinel_password}
    sentinel = Sentinel(list(address.sentinels), sentinel_kwargs=sentinel_kwargs)  # type: ignore[no-untyped-call, unused-ignore]  # typed in redis-py >= 8
    # Sentinel's pool raises when all its connections are busy; the scripts' caller waits and
    # retries then (scripts.POOL_RETRY_SECONDS), so a burst still waits its turn.
    client: Redis = sentinel.master_for(
        address.service, redis_class=Redis, db=address.db, username=address.username, password=address.password,
        ssl=address.tls, max_connections=max_connections, retry=retry,
        socket_timeout=timeout, socket_connect_timeout=timeout,
    )
    return client
