"""Policies that act on sampled device readings: thermal clamping and the "trust the device" guard.

Both read a :class:`DeviceSnapshot` the sampler already holds; neither touches NVML.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from .._errors import AdmissionRejected, DeviceMemoryLow, DeviceProbeFailed
from .sampler import DeviceSnapshot

DEFAULT_DEGRADED_ABOVE_CELSIUS = 75.0
DEFAULT_GUARD_MARGIN_BYTES = 512 << 20
DEFAULT_GUARD_MAX_AGE = 5.0
#: Response header set when the thermal policy lowered ``max_new_tokens``; its value is the new limit.
CLAMPED_HEADER = b"x-gpu-admission-clamped-max-new-tokens"


@dataclass(frozen=True, slots=True, kw_only=True)
class ThermalPolicy:
    """What a hot device means.

    Above ``degraded_above_celsius`` ``/health`` says ``degraded``. With ``clamp_max_new_tokens``
    set, a request whose devices include one above ``clamp_above_celsius`` (default: the degraded
    threshold) gets at most that many new tokens: the middleware lowers the value before estimating,
    the endpoint reads it from ``request.state.gpu_admission.max_new_tokens``, and the response
    carries ``x-gpu-admission-clamped-max-new-tokens``. Above ``unavailable_above_celsius`` (off by
    default) ``/health`` says ``unavailable``. Unknown or failed readings never clamp.
    """

    degraded_above_celsius: float = DEFAULT_DEGRADED_ABOVE_CELSIUS
    clamp_max_new_tokens: int | None = None
    clamp_above_celsius: float | None = None
    unavailable_above_celsius: float | None = None

    def __post_init__(self) -> None:
        if self.clamp_max_new_tokens is not None and self.clamp_max_new_tokens < 1:
            raise ValueError("clamp_max_new_tokens must be at least 1")

    def hottest(self, snapshot: DeviceSnapshot, devices: Iterable[str] | None = None) -> tuple[str, float] | None:
        """The hottest of ``devices`` (default: all read) as (name, °C), or None without a temperature."""
        readings = snapshot.readings
        names = readings if devices is None else devices
        best: tuple[str, float] | None = None
        for name in names:
            reading = readings.get(name)
            temperature = None if reading is None else reading.temperature_celsius
            if temperature is not None and (best is None or temperature > best[1]):
                best = (name, temperature)
        return best

    def max_new_tokens_limit(self, snapshot: DeviceSnapshot, devices: Iterable[str] | None = None) -> int | None:
        """The clamp to apply now, or None. Cheap: a loop over a handful of readings."""
        if self.clamp_max_new_tokens is None or snapshot.error is not None:
            return None
        hottest = self.hottest(snapshot, devices)
        threshold = self.degraded_above_celsius if self.clamp_above_celsius is None else self.clamp_above_celsius
        return self.clamp_max_new_tokens if hottest is not None and hottest[1] > threshold else None


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceGuard:
    """ "Trust the device": refuse admission when the device's real free memory is too low.

    Before the ledger places a request, the guard compares each candidate device's sampled free
    memory (plus this process's own allocator slack, see ``DeviceReading.available_bytes``) with
    the estimate plus ``margin_bytes``; the ledger places the request only on devices that pass.
    When none does, the client gets 503 ``device-memory-low`` with ``Retry-After`` and the ledger
    is not touched. A request that waited in the queue is checked again on the device it was
    granted (its bytes are returned if that device fell short meanwhile). Memory used by other
    processes, fragmentation or an estimator that runs low show up here even when the ledger has
    room.

    When there is no usable reading (the probe failed, the reading is older than ``max_age``
    seconds, or the device is not in it), ``on_probe_failure`` decides: ``"open"`` admits as if
    the guard were off (the default: a broken probe should not stop serving), ``"closed"`` refuses
    with 503 ``device-probe-failed``.
    """

    margin_bytes: int = DEFAULT_GUARD_MARGIN_BYTES
    on_probe_failure: Literal["open", "closed"] = "open"
    max_age: float = DEFAULT_GUARD_MAX_AGE

    def __post_init__(self) -> None:
        if self.on_probe_failure not in ("open", "closed"):
            raise ValueError("on_probe_failure must be 'open' or 'closed'")
        if self.margin_bytes < 0:
            raise ValueError("margin_bytes must be >= 0")

    @property
    def fails_closed(self) -> bool:
        return self.on_probe_failure == "closed"

    def unreadable(self, device: str, snapshot: DeviceSnapshot, now: float) -> str | None:
        """Why ``device`` has no usable free-memory figure in ``snapshot``, or None when it has one."""
        reading = snapshot.readings.get(device) if snapshot.fresh(now, self.max_age) else None
        if reading is not None and reading.available_bytes is not None:
            return None
        return _why_unreadable(device, snapshot, now, self.max_age)

    def refusal(self, device: str, nbytes: int, snapshot: DeviceSnapshot, now: float) -> AdmissionRejected | None:
        """The error to answer with, or None to admit. The caller sets ``retry_after``."""
        reading = snapshot.readings.get(device) if snapshot.fresh(now, self.max_age) else None
        available = None if reading is None else reading.available_bytes
        if available is None:
            if not self.fails_closed:
                return None
            why = self.unreadable(device, snapshot, now)
            return DeviceProbeFailed(f"The free memory of {device} could not be checked: {why}.", device=device)
        needed = nbytes + self.margin_bytes
        if available >= needed:
            return None
        return DeviceMemoryLow(
            f"{device} has {available} bytes free; this request needs {nbytes} plus a margin of {self.margin_bytes}.",
            device=device,
            available_bytes=available,
            required_bytes=needed,
        )


def _why_unreadable(device: str, snapshot: DeviceSnapshot, now: float, max_age: float) -> str:
    if snapshot.error is not None:
        return snapshot.error
    if not snapshot.fresh(now, max_age):
        return f"the last reading is older than {max_age:g} s"
    if device not in snapshot.readings:
        return f"the probe has no reading for {device}"
    return "the probe reports no free-memory figure"
