"""Samples the server's ``/metrics`` while the load runs: queue depth, reserved bytes, in flight."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

#: gpu_asgi's gauges (namespace ``gpu_asgi``); per-device ones are summed over devices.
GAUGES = {
    "gpu_asgi_queue_depth": "queue_depth",
    "gpu_asgi_reserved_bytes": "reserved_bytes",
    "gpu_asgi_capacity_bytes": "capacity_bytes",
    "gpu_asgi_in_flight_requests": "in_flight",
}


@dataclass(slots=True)
class Timeline:
    """One row per scrape; ``t`` is seconds since the load started."""

    t: list[float] = field(default_factory=list)
    queue_depth: list[float] = field(default_factory=list)
    reserved_bytes: list[float] = field(default_factory=list)
    capacity_bytes: list[float] = field(default_factory=list)
    in_flight: list[float] = field(default_factory=list)
    errors: int = 0

    def add(self, t: float, values: dict[str, float]) -> None:
        self.t.append(round(t, 3))
        for column in GAUGES.values():
            getattr(self, column).append(values.get(column, 0.0))


def parse_gauges(text: str) -> dict[str, float]:
    """The gauges above from a Prometheus text exposition (``prometheus_client.parser``)."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        column = GAUGES.get(family.name)
        if column is None:
            continue
        values[column] = sum(sample.value for sample in family.samples if sample.name == family.name)
    return values


async def scrape(client: httpx.AsyncClient, url: str, timeline: Timeline, started: float, interval: float) -> None:
    """Scrape every ``interval`` seconds until cancelled; failures are counted, not fatal."""
    while True:
        began = time.perf_counter()
        try:
            response = await client.get(url, headers={"accept": "text/plain"})
            response.raise_for_status()
            timeline.add(began - started, parse_gauges(response.text))
        except (httpx.HTTPError, ValueError):
            timeline.errors += 1
        await asyncio.sleep(max(0.0, interval - (time.perf_counter() - began)))
