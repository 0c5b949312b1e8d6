"""The device guard narrows the devices a request may use; the ledger must not read that as
"waiting cannot help" (413). A request that only a guarded-off device can hold is a shortage."""

from __future__ import annotations

from gpu_asgi import DeviceGuard, DeviceReading, Ledger

from ._asgi import client
from .test_health import GIB, SettableProbe, app_with, sampler_for


async def test_a_request_only_a_guarded_off_device_can_hold_is_503_device_memory_low() -> None:
    ledger = Ledger({"cuda:0": 1_000, "cuda:1": 500})
    probe = SettableProbe(
        a=DeviceReading("cuda:0", memory_free_bytes=100),  # filled by another process, for now
        b=DeviceReading("cuda:1", memory_free_bytes=GIB),
    )
    sampler = sampler_for(probe)
    async with client(app_with(ledger, sampler, device_guard=DeviceGuard(margin_bytes=0))) as http:
        refused = await http.post("/generate", json={"prompt": "a", "max_new_tokens": 800})  # 801 B: cuda:0 only
        probe.set("cuda:0", memory_free_bytes=GIB)  # the other process finished
        sampler.sample()
        admitted = await http.post("/generate", json={"prompt": "a", "max_new_tokens": 800})
    assert refused.status_code == 503, refused.text
    assert refused.headers["x-gpu-admission-reason"] == "device-memory-low"
    assert 1 <= int(refused.headers["retry-after"]) <= 600
    assert refused.json()["device"] == "cuda:0"
    assert admitted.status_code == 200 and admitted.json()["device"] == "cuda:0"
    assert ledger.statistics().rejected_total.get("exceeds-budget", 0) == 0


async def test_a_request_no_device_could_ever_hold_is_still_413() -> None:
    ledger = Ledger({"cuda:0": 600, "cuda:1": 500})
    probe = SettableProbe(
        a=DeviceReading("cuda:0", memory_free_bytes=100),
        b=DeviceReading("cuda:1", memory_free_bytes=GIB),
    )
    async with client(app_with(ledger, sampler_for(probe), device_guard=DeviceGuard(margin_bytes=0))) as http:
        refused = await http.post("/generate", json={"prompt": "a", "max_new_tokens": 800})
    assert refused.status_code == 413 and refused.headers["x-gpu-admission-reason"] == "exceeds-budget"
