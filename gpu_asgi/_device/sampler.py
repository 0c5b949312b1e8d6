"""Background device sampling: a thread reads the probe every ``interval`` seconds.

The request path, ``/health`` and ``/metrics`` only read :attr:`DeviceSampler.snapshot`, an
immutable object swapped in whole, so nothing on the event loop ever waits on NVML.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Self

from .probe import DeviceReading, NoDeviceProbe, Probe

DEFAULT_SAMPLE_INTERVAL = 1.0


@dataclass(frozen=True, slots=True)
class DeviceSnapshot:
    """The latest readings. On a failed read, ``error`` is set and the previous readings are kept."""

    readings: Mapping[str, DeviceReading] = field(default_factory=lambda: MappingProxyType({}))
    #: Sampler clock time of the last successful read; None before the first one.
    taken_at: float | None = None
    error: str | None = "not sampled yet"
    probe: str = "none"

    @property
    def ok(self) -> bool:
        return self.error is None and self.taken_at is not None

    def age(self, now: float) -> float | None:
        return None if self.taken_at is None else max(0.0, now - self.taken_at)

    def fresh(self, now: float, max_age: float) -> bool:
        """The last read succeeded and is at most ``max_age`` seconds old."""
        return self.ok and now - self.taken_at <= max_age  # type: ignore[operator]


class DeviceSampler:
    """Samples ``probe`` in a daemon thread; read :attr:`snapshot` from anywhere, at no cost.

    Start it in your lifespan (``async with sampler:`` takes the first sample before serving),
    or let the middleware and ``/health`` start it lazily on first use. ``clock`` is for tests.
    """

    def __init__(
        self,
        probe: Probe | None = None,
        *,
        interval: float = DEFAULT_SAMPLE_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if interval <= 0:
            raise ValueError("interval must be positive")
        self.probe: Probe = probe if probe is not None else NoDeviceProbe()
        self.interval = interval
        self.clock = clock
        self._snapshot = DeviceSnapshot(probe=self.probe.name)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._stopped = False  # by stop(): the lazy start must not bring it back during shutdown

    def __repr__(self) -> str:
        return f"DeviceSampler({self.probe!r}, interval={self.interval})"

    @property
    def snapshot(self) -> DeviceSnapshot:
        return self._snapshot

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def sample(self) -> DeviceSnapshot:
        """Read the probe now (blocking) and publish the result."""
        with self._lock:  # one read at a time: NVML handles are not meant to be shared across reads
            previous = self._snapshot
            try:
                readings = self.probe.read()
            except Exception as exc:  # a failing probe is a state to report, not a crash
                snapshot = DeviceSnapshot(
                    previous.readings, previous.taken_at, f"{type(exc).__name__}: {exc}", self.probe.name
                )
            else:
                by_name = MappingProxyType({reading.device: reading for reading in readings})
                snapshot = DeviceSnapshot(by_name, self.clock(), None, self.probe.name)
            self._snapshot = snapshot
            return snapshot

    def start(self) -> None:
        """Start the background thread (idempotent). The first sample is taken at once, in the thread."""
        with self._lock:
            if self.running:
                return
            self._stopped = False
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="gpu_asgi-device-sampler", daemon=True)
            self._thread.start()

    def ensure_started(self) -> None:
        """Cheap enough for the request path: a field check, and a start only the first time."""
        if self._thread is None and not self._stopped:
            self.start()

    def stop(self, timeout: float | None = 5.0) -> None:
        self._stopped = True
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        self.probe.close()

    def _run(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> Self:
        self.sample()
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def __aenter__(self) -> Self:
        await asyncio.to_thread(self.sample)  # NVML's first call can take a while: keep the loop free
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.stop)
