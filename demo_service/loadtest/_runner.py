"""N concurrent clients working through a fixed list of requests, honouring ``Retry-After`` when asked.

Each client takes the next request, sends it (streamed or not), and records every attempt: status,
the ``x-gpu-admission-reason`` of a rejection, ``Retry-After``, time to first token. A rejected
request (503 or 429) is retried after the server's ``Retry-After`` only with ``honour_retry_after``;
otherwise it counts as rejected and the client moves on.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import httpx
from tqdm.auto import tqdm

from ._retry import REASON_HEADER, REJECTED, parse_retry_after
from ._scrape import Timeline, scrape
from ._workload import DEFAULT_MIX, ENDPOINTS, Job, LengthClass, make_jobs


@dataclass(frozen=True, slots=True)
class LoadTestConfig:
    url: str = "http://127.0.0.1:8000"
    endpoint: str = "chat"
    clients: int = 16
    requests: int = 200
    honour_retry_after: bool = False
    max_retries: int = 5
    #: Longest wait for one Retry-After (a server could ask for minutes).
    max_retry_wait: float = 30.0
    stream: bool = True
    max_tokens: int | None = None
    mix: tuple[LengthClass, ...] = DEFAULT_MIX
    metrics_interval: float = 0.5
    timeout: float = 300.0
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        if self.clients < 1 or self.requests < 1:
            raise ValueError("need at least one client and one request")
        if self.endpoint == "generate" and self.stream:
            object.__setattr__(self, "stream", False)  # /v1/generate does not stream


@dataclass(slots=True)
class Attempt:
    started: float
    finished: float
    status: int  # 0: no HTTP answer (connection error, timeout)
    reason: str | None = None
    retry_after: float | None = None


@dataclass(slots=True)
class RequestRecord:
    index: int
    length_class: str
    started: float
    finished: float = 0.0
    attempts: list[Attempt] = field(default_factory=list)
    time_to_first_token: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None

    @property
    def status(self) -> int:
        return self.attempts[-1].status if self.attempts else 0

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    @property
    def latency(self) -> float:
        """From the first attempt to the answer, retry waits included."""
        return self.finished - self.started


@dataclass(slots=True)
class LoadResult:
    config: LoadTestConfig
    records: list[RequestRecord]
    timeline: Timeline
    started_at: float  # wall clock (time.time()) at the start
    duration: float


async def run_load(config: LoadTestConfig) -> LoadResult:
    jobs = deque(
        make_jobs(
            config.requests,
            endpoint=config.endpoint,
            mix=config.mix,
            max_tokens=config.max_tokens,
            stream=config.stream,
            seed=config.seed,
        )
    )
    base = config.url.rstrip("/")
    limits = httpx.Limits(max_connections=config.clients + 2, max_keepalive_connections=config.clients + 2)
    timeline = Timeline()
    records: list[RequestRecord] = []
    bar = tqdm(total=config.requests, desc="requests", unit="req", disable=not config.progress)
    counts = {"ok": 0, "rejected": 0, "failed": 0, "retries": 0}
    started_at, started = time.time(), time.perf_counter()
    async with httpx.AsyncClient(timeout=config.timeout, limits=limits) as client:
        scraper = asyncio.ensure_future(scrape(client, base + "/metrics", timeline, started, config.metrics_interval))

        async def worker() -> None:
            while jobs:
                job = jobs.popleft()
                record = await _request(client, base + ENDPOINTS[config.endpoint], job, config, started, counts)
                records.append(record)
                counts["ok" if record.ok else "rejected" if record.status in REJECTED else "failed"] += 1
                bar.set_postfix(counts, refresh=False)
                bar.update()

        try:
            await asyncio.gather(*(worker() for _ in range(config.clients)))
        finally:
            scraper.cancel()
            await asyncio.gather(scraper, return_exceptions=True)
            bar.close()
    records.sort(key=lambda r: r.index)
    return LoadResult(config, records, timeline, started_at, time.perf_counter() - started)


async def _request(
    client: httpx.AsyncClient, url: str, job: Job, config: LoadTestConfig, t0: float, counts: dict[str, int]
) -> RequestRecord:
    record = RequestRecord(job.index, job.length_class, time.perf_counter() - t0)
    for attempt_number in range(config.max_retries + 1):
        attempt = Attempt(time.perf_counter() - t0, 0.0, 0)
        record.attempts.append(attempt)
        try:
            await _send(client, url, job, config.stream, record, attempt, t0)
        except httpx.HTTPError as exc:
            record.error = f"{type(exc).__name__}: {exc}"
        attempt.finished = time.perf_counter() - t0
        if attempt.status in REJECTED and config.honour_retry_after and attempt_number < config.max_retries:
            counts["retries"] += 1
            wait = attempt.retry_after if attempt.retry_after is not None else 1.0
            await asyncio.sleep(min(wait, config.max_retry_wait))
            continue
        break
    record.finished = time.perf_counter() - t0
    return record


async def _send(
    client: httpx.AsyncClient, url: str, job: Job, stream: bool, record: RequestRecord, attempt: Attempt, t0: float
) -> None:
    async with client.stream("POST", url, json=job.body) as response:
        attempt.status = response.status_code
        if response.status_code != 200:
            await response.aread()
            attempt.reason = response.headers.get(REASON_HEADER) or _problem_reason(response)
            attempt.retry_after = parse_retry_after(response.headers.get("retry-after"))
            if response.status_code not in REJECTED:
                record.error = f"HTTP {response.status_code}: {response.text[:200]}"
            return
        record.error = None
        if not stream:
            _usage(record, json.loads(await response.aread()).get("usage"))
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                record.error = str(event["error"].get("message", event["error"]))
                break
            if record.time_to_first_token is None and _has_text(event):
                record.time_to_first_token = time.perf_counter() - t0 - attempt.started
            _usage(record, event.get("usage"))


def _has_text(event: dict[str, Any]) -> bool:
    for choice in event.get("choices") or ():
        if choice.get("text") or (choice.get("delta") or {}).get("content"):
            return True
    return False


def _usage(record: RequestRecord, usage: dict[str, Any] | None) -> None:
    if usage:
        record.prompt_tokens = int(usage.get("prompt_tokens", 0))
        record.completion_tokens = int(usage.get("completion_tokens", 0))


def _problem_reason(response: httpx.Response) -> str | None:
    try:
        body = response.json()
    except ValueError:
        return None
    reason = str(body.get("type", "")).rpartition(":")[2] if isinstance(body, dict) else ""
    return reason or None
