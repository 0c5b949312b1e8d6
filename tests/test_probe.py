"""Device probes, the background sampler, the thermal policy and the device guard.

There is no GPU here. ``FakeNVML`` replaces only the ``pynvml`` module layer (the C library's
Python bindings): ``NVMLProbe``, the sampler and the policies above it are the real code.
Real NVML and CUDA are untested on this machine.
"""

from __future__ import annotations

import sys
import threading
import types
from typing import Any

import pytest

from gpu_asgi import (
    DeviceGuard,
    DeviceMemoryLow,
    DeviceProbeFailed,
    DeviceReading,
    DeviceSampler,
    NoDeviceProbe,
    NVMLProbe,
    ThermalPolicy,
    auto_probe,
)
from gpu_asgi._device.probe import _visible_devices
from gpu_asgi._device.sampler import DeviceSnapshot

GIB = 1 << 30


class FakeNVMLError(Exception):
    pass


class FakeNVML:
    """Stands in for the ``pynvml`` module: same function names, canned device state."""

    NVML_TEMPERATURE_GPU = 0
    NVMLError = FakeNVMLError

    def __init__(self, devices: list[dict[str, Any]]) -> None:
        self.devices = devices
        self.calls: list[str] = []
        self.initialised = 0
        self.fail_next: Exception | None = None
        self.versioned_temperature = True

    def nvmlInit(self) -> None:
        self.initialised += 1

    def nvmlShutdown(self) -> None:
        self.initialised -= 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        self.calls.append(f"index:{index}")
        return index

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> int:
        self.calls.append(f"uuid:{uuid}")
        return next(i for i, device in enumerate(self.devices) if device["uuid"] == uuid)

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Any:
        if self.fail_next is not None:
            error, self.fail_next = self.fail_next, None
            raise error
        device = self.devices[handle]
        return types.SimpleNamespace(total=device["total"], used=device["used"], free=device["total"] - device["used"])

    def nvmlDeviceGetTemperatureV(self, handle: int, sensor: int) -> int:
        if not self.versioned_temperature:
            raise FakeNVMLError("Function Not Found")
        return self.devices[handle]["celsius"]

    def nvmlDeviceGetTemperature(self, handle: int, sensor: int) -> int:
        self.calls.append("legacy-temperature")
        return self.devices[handle]["celsius"]

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> Any:
        utilization = self.devices[handle]["util"]
        if utilization is None:
            raise FakeNVMLError("Not Supported")
        return types.SimpleNamespace(gpu=utilization, memory=0)


def two_gpus() -> FakeNVML:
    return FakeNVML(
        [
            {"uuid": "GPU-aaa", "total": 24 * GIB, "used": 4 * GIB, "celsius": 61, "util": 35},
            {"uuid": "GPU-bbb", "total": 24 * GIB, "used": 20 * GIB, "celsius": 83, "util": None},
        ]
    )


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_nvml_probe_reads_memory_temperature_and_utilization(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    nvml = two_gpus()
    probe = NVMLProbe(nvml=nvml)
    first, second = probe.read()
    assert first == DeviceReading("cuda:0", 24 * GIB, 4 * GIB, 20 * GIB, 61.0, 0.35)
    assert second.device == "cuda:1" and second.memory_free_bytes == 4 * GIB and second.temperature_celsius == 83.0
    assert second.utilization_ratio is None  # not supported on that device: unknown, not an error
    probe.read()
    assert nvml.initialised == 1  # handles are opened once
    probe.close()
    assert nvml.initialised == 0


def test_nvml_probe_follows_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = two_gpus()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    (reading,) = NVMLProbe(nvml=nvml).read()
    assert reading.device == "cuda:0" and reading.memory_used_bytes == 20 * GIB  # CUDA's 0 is NVML's 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaa")
    (reading,) = NVMLProbe(nvml=nvml).read()
    assert reading.device == "cuda:0" and nvml.calls[-1] == "uuid:GPU-aaa"
    assert _visible_devices(2) == {"cuda:0": "GPU-aaa"}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,-1,1")
    assert _visible_devices(2) == {"cuda:0": 0}  # CUDA ignores everything after an invalid entry
    explicit = NVMLProbe({"gpu-b": "GPU-bbb"}, nvml=nvml).read()
    assert [r.device for r in explicit] == ["gpu-b"]


def test_nvml_probe_falls_back_to_the_legacy_temperature_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    nvml = two_gpus()
    nvml.versioned_temperature = False
    probe = NVMLProbe(nvml=nvml)
    assert [r.temperature_celsius for r in probe.read()] == [61.0, 83.0]
    probe.read()
    assert nvml.calls.count("legacy-temperature") == 4


def test_nvml_probe_imports_pynvml_lazily(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    fake = two_gpus()
    module = types.ModuleType("pynvml")
    for name in dir(fake):
        if not name.startswith("_"):
            setattr(module, name, getattr(fake, name))
    monkeypatch.setitem(sys.modules, "pynvml", module)
    probe = NVMLProbe()
    assert len(probe.read()) == 2
    monkeypatch.setitem(sys.modules, "pynvml", None)  # as if nvidia-ml-py were not installed
    with pytest.raises(RuntimeError, match=r"gpu_asgi\[nvml\]"):
        NVMLProbe().read()


def test_auto_probe_on_this_cpu_machine_is_no_device() -> None:
    probe = auto_probe()  # real pynvml is installed, but there is no driver here
    assert isinstance(probe, NoDeviceProbe)
    assert probe.read() == ()


def test_sampler_publishes_snapshots_and_keeps_the_last_good_reading_on_failure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    nvml, clock = two_gpus(), Clock()
    sampler = DeviceSampler(NVMLProbe(nvml=nvml), interval=1.0, clock=clock)
    assert not sampler.snapshot.ok and sampler.snapshot.error == "not sampled yet"
    good = sampler.sample()
    assert good.ok and good.taken_at == 100.0 and good.probe == "nvml"
    assert good.readings["cuda:1"].temperature_celsius == 83.0
    clock.now = 101.0
    nvml.fail_next = FakeNVMLError("GPU is lost")
    bad = sampler.sample()
    assert not bad.ok and "GPU is lost" in (bad.error or "")
    assert bad.readings is good.readings and bad.taken_at == 100.0
    assert not bad.fresh(clock.now, 5.0)
    clock.now = 102.0
    assert sampler.sample().fresh(clock.now, 0.5)


def test_no_device_sampler_is_clean() -> None:
    sampler = DeviceSampler()
    snapshot = sampler.sample()
    assert snapshot.ok and snapshot.readings == {} and snapshot.probe == "none"


async def test_sampler_thread_samples_in_the_background() -> None:
    reads = threading.Semaphore(0)

    class CountingProbe(NoDeviceProbe):
        name = "counting"

        def read(self) -> tuple[DeviceReading, ...]:
            reads.release()
            return (DeviceReading("cuda:0", memory_free_bytes=1),)

    async with DeviceSampler(CountingProbe(), interval=0.01) as sampler:
        assert sampler.snapshot.ok  # the first sample is taken before serving
        assert sampler.running
        for _ in range(3):
            assert reads.acquire(timeout=30)  # returns at the next read; the bound only catches a dead thread
    assert not sampler.running
    sampler.ensure_started()  # a request arriving during shutdown does not restart it
    assert not sampler.running


def snapshot(clock: Clock, **readings: DeviceReading) -> DeviceSnapshot:
    return DeviceSnapshot({r.device: r for r in readings.values()}, clock(), None, "fake")


def test_thermal_policy_clamps_only_above_its_threshold() -> None:
    clock = Clock()
    policy = ThermalPolicy(degraded_above_celsius=75, clamp_max_new_tokens=64)
    hot = snapshot(
        clock, a=DeviceReading("cuda:0", temperature_celsius=60), b=DeviceReading("cuda:1", temperature_celsius=80)
    )
    assert policy.hottest(hot) == ("cuda:1", 80)
    assert policy.max_new_tokens_limit(hot) == 64
    assert policy.max_new_tokens_limit(hot, ["cuda:0"]) is None  # this route cannot land on the hot device
    assert ThermalPolicy(clamp_max_new_tokens=64, clamp_above_celsius=85).max_new_tokens_limit(hot) is None
    assert ThermalPolicy().max_new_tokens_limit(hot) is None  # no clamp configured
    unknown = snapshot(clock, a=DeviceReading("cuda:0"))
    assert policy.max_new_tokens_limit(unknown) is None
    failed = DeviceSnapshot(hot.readings, hot.taken_at, "NVMLError: lost", "fake")
    assert policy.max_new_tokens_limit(failed) is None
    with pytest.raises(ValueError):
        ThermalPolicy(clamp_max_new_tokens=0)


def test_device_guard_compares_free_memory_with_estimate_plus_margin() -> None:
    clock = Clock()
    guard = DeviceGuard(margin_bytes=100)
    state = snapshot(clock, a=DeviceReading("cuda:0", memory_free_bytes=1000, reclaimable_bytes=50))
    assert guard.refusal("cuda:0", 950, state, clock()) is None  # 1000 free + 50 allocator slack
    refusal = guard.refusal("cuda:0", 951, state, clock())
    assert isinstance(refusal, DeviceMemoryLow) and refusal.reason == "device-memory-low" and refusal.status == 503
    assert refusal.extensions == {"device": "cuda:0", "available_bytes": 1050, "required_bytes": 1051}


@pytest.mark.parametrize("closed", [False, True], ids=["fail-open", "fail-closed"])
def test_device_guard_without_a_usable_reading(closed: bool) -> None:
    clock = Clock()
    guard = DeviceGuard(on_probe_failure="closed" if closed else "open", max_age=2.0)
    good = snapshot(clock, a=DeviceReading("cuda:0", memory_free_bytes=10))
    cases = {
        "not sampled yet": DeviceSnapshot(),
        "NVMLError: lost": DeviceSnapshot(good.readings, good.taken_at, "NVMLError: lost", "nvml"),
        "older than 2 s": good,
        "no reading for cuda:1": None,
        "no free-memory figure": snapshot(clock, a=DeviceReading("cuda:0")),
    }
    for why, state in cases.items():
        device = "cuda:1" if state is None else "cuda:0"
        now = clock() + 3.0 if why == "older than 2 s" else clock()
        refusal = guard.refusal(device, 10**12, good if state is None else state, now)
        if closed:
            assert isinstance(refusal, DeviceProbeFailed) and why in refusal.detail, (why, refusal)
        else:
            assert refusal is None, why
    with pytest.raises(ValueError):
        DeviceGuard(on_probe_failure="maybe")  # type: ignore[arg-type]
