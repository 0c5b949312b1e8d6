"""Device probes: what the GPU itself says about memory, temperature and utilization.

A probe's ``read()`` is blocking (NVML and the CUDA driver are synchronous C calls), so it is only
ever called by :class:`DeviceSampler` in its background thread, never on the request path.
Device names are the ledger's (``"cuda:0"``, ...), so readings and budgets line up.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

NVML_MISSING = "NVMLProbe needs the NVIDIA Management Library bindings: pip install 'gpu_asgi[nvml]' (nvidia-ml-py)."


@dataclass(frozen=True, slots=True)
class DeviceReading:
    """One device at one moment. ``None`` means the probe cannot tell (e.g. no NVML on this device)."""

    device: str
    memory_total_bytes: int | None = None
    memory_used_bytes: int | None = None
    memory_free_bytes: int | None = None
    temperature_celsius: float | None = None
    #: Fraction of the last sample period a kernel was running (NVML's GPU utilization / 100).
    utilization_ratio: float | None = None
    #: Bytes PyTorch's caching allocator in *this* process holds without using them: the device
    #: counts them as used, but this process can reuse them. The device guard adds them to free memory.
    reclaimable_bytes: int = 0

    @property
    def available_bytes(self) -> int | None:
        """Free memory this process can use: device-free plus its own allocator's cached slack."""
        return None if self.memory_free_bytes is None else self.memory_free_bytes + self.reclaimable_bytes


@runtime_checkable
class Probe(Protocol):
    """Reads every device it knows. Blocking; may raise (the sampler records the error)."""

    name: str

    def read(self) -> tuple[DeviceReading, ...]: ...

    def close(self) -> None: ...


class NoDeviceProbe:
    """The CPU case: no device to read. Readings are empty and that is not an error."""

    name = "none"

    def read(self) -> tuple[DeviceReading, ...]:
        return ()

    def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return "NoDeviceProbe()"


class NVMLProbe:
    """Reads devices through NVML (``nvidia-ml-py``, imported on first read).

    ``devices`` maps ledger names to NVML indices or UUIDs. By default ``cuda:N`` is the N-th entry
    of ``CUDA_VISIBLE_DEVICES`` (an index or a ``GPU-``/``MIG-`` UUID), or NVML index N when it is
    unset. NVML numbers devices in PCI bus order; set ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (or pass an
    explicit mapping) on hosts with mixed GPU models so CUDA and NVML agree. ``nvml`` replaces the
    ``pynvml`` module (tests use a fake of that layer only).
    """

    name = "nvml"

    def __init__(self, devices: Mapping[str, int | str] | None = None, *, nvml: Any = None) -> None:
        self._devices = dict(devices) if devices is not None else None
        self._nvml = nvml
        self._handles: dict[str, Any] | None = None
        self._legacy_temperature = False

    def __repr__(self) -> str:
        return f"NVMLProbe(devices={self._devices!r})"

    def _open(self) -> dict[str, Any]:
        if self._nvml is None:
            try:
                import pynvml
            except ImportError:
                raise RuntimeError(NVML_MISSING) from None
            self._nvml = pynvml
        nvml = self._nvml
        nvml.nvmlInit()
        devices = self._devices if self._devices is not None else _visible_devices(nvml.nvmlDeviceGetCount())
        handles = {}
        for name, key in devices.items():
            if isinstance(key, str) and not key.isdigit():
                handles[name] = nvml.nvmlDeviceGetHandleByUUID(key)
            else:
                handles[name] = nvml.nvmlDeviceGetHandleByIndex(int(key))
        self._handles = handles
        return handles

    def read(self) -> tuple[DeviceReading, ...]:
        handles = self._handles if self._handles is not None else self._open()
        nvml = self._nvml
        cached = _torch_cached_bytes(handles)
        readings = []
        for name, handle in handles.items():
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            readings.append(
                DeviceReading(
                    device=name,
                    memory_total_bytes=int(memory.total),
                    memory_used_bytes=int(memory.used),
                    memory_free_bytes=int(memory.free),
                    temperature_celsius=self._optional(self._temperature, handle),
                    utilization_ratio=self._optional(
                        lambda h: nvml.nvmlDeviceGetUtilizationRates(h).gpu / 100.0, handle
                    ),
                    reclaimable_bytes=cached.get(name, 0),
                )
            )
        return tuple(readings)

    def _temperature(self, handle: Any) -> float:
        nvml = self._nvml
        if not self._legacy_temperature and hasattr(nvml, "nvmlDeviceGetTemperatureV"):
            try:
                return float(nvml.nvmlDeviceGetTemperatureV(handle, nvml.NVML_TEMPERATURE_GPU))
            except nvml.NVMLError:
                self._legacy_temperature = True  # older drivers lack the versioned call
        return float(nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU))

    def _optional(self, read: Any, handle: Any) -> float | None:
        """Temperature and utilization are not supported on every device (MIG, some vGPUs)."""
        try:
            return read(handle)  # type: ignore[no-any-return]
        except self._nvml.NVMLError:
            return None

    def close(self) -> None:
        if self._handles is not None:
            self._handles = None
            self._nvml.nvmlShutdown()


class TorchProbe:
    """Free/total memory from ``torch.cuda.mem_get_info``; no temperature or utilization.

    Note that the first read creates a CUDA context on every probed device in this process
    (hundreds of MB each): probe only the devices you serve from. Prefer :class:`NVMLProbe`.
    """

    name = "torch"

    def __init__(self, devices: tuple[str, ...] | None = None) -> None:
        self._devices = devices

    def __repr__(self) -> str:
        return f"TorchProbe(devices={self._devices!r})"

    def read(self) -> tuple[DeviceReading, ...]:
        import torch

        names = self._devices or tuple(f"cuda:{i}" for i in range(torch.cuda.device_count()))
        readings = []
        for name in names:
            free, total = torch.cuda.mem_get_info(name)
            cached = torch.cuda.memory_reserved(name) - torch.cuda.memory_allocated(name)
            readings.append(DeviceReading(name, total, total - free, free, reclaimable_bytes=max(0, cached)))
        return tuple(readings)

    def close(self) -> None:
        pass


def auto_probe() -> NVMLProbe | TorchProbe | NoDeviceProbe:
    """The best probe this machine allows: NVML, else torch's CUDA, else :class:`NoDeviceProbe`.

    Blocking (it initialises NVML to find out): call it at startup, not per request.
    """
    probe = NVMLProbe()
    try:
        probe.read()
    except Exception:  # no bindings, no driver, no device: try the next one
        pass
    else:
        return probe
    try:
        import torch
    except ImportError:
        return NoDeviceProbe()
    return TorchProbe() if torch.cuda.is_available() else NoDeviceProbe()


def _visible_devices(count: int) -> dict[str, int | str]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return {f"cuda:{i}": i for i in range(count)}
    entries = [entry.strip() for entry in visible.split(",") if entry.strip()]
    # CUDA stops at the first invalid entry; so do we (a negative index hides every later one).
    devices: dict[str, int | str] = {}
    for index, entry in enumerate(entries):
        if entry.lstrip("-").isdigit():
            if int(entry) < 0 or int(entry) >= count:
                break
            devices[f"cuda:{index}"] = int(entry)
        else:
            devices[f"cuda:{index}"] = entry
    return devices


def _torch_cached_bytes(handles: Mapping[str, Any]) -> dict[str, int]:
    """Allocator slack per device, only when torch is already imported and CUDA initialised here."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return {}
    cached = {}
    for name in handles:
        if name.startswith("cuda:"):
            cached[name] = max(0, torch.cuda.memory_reserved(name) - torch.cuda.memory_allocated(name))
    return cached
