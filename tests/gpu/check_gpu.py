"""The GPU checks, in one run on a machine with a CUDA device (none in CI: untested there).

    bash tests/gpu/run.sh          # installs the carried wheels if needed, then runs this

1. CUDA peak against the estimators: a tiny random-weight Qwen2 on cuda:0 generates for a few
   (prompt, max_new) shapes; the measured peak above the weights (``cuda_peak_measurer``) must not
   exceed ``AnalyticEstimator.from_config``'s estimate, and the ratio is printed.
2. The NVML probe against torch: ``NVMLProbe`` and ``TorchProbe`` report the same total memory,
   and free memory within 256 MiB of ``torch.cuda.mem_get_info``.
3. The device guard: with most free memory taken by a tensor, a tagged request that the ledger
   would admit is refused with 503 ``device-memory-low``; after the tensor is freed it is admitted.
4. ``DeviceExecutor("cuda:0")`` runs a call on its thread with the device set.

Exit status 0 when every check holds, 1 otherwise, 2 when there is no CUDA device.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

MIB = 1 << 20


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: nothing checked")
        return 2
    failures: list[str] = []
    for check in (check_peaks, check_probes, check_guard, check_executor):
        try:
            check(failures)
        except Exception as error:  # one broken check must not hide the others
            failures.append(f"{check.__name__}: {type(error).__name__}: {error}")
    print(json.dumps({"device": torch.cuda.get_device_name(0), "failures": failures}, indent=2))
    return 1 if failures else 0


def tiny_qwen2() -> Any:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=151_936, max_position_embeddings=4096,
    )
    return Qwen2ForCausalLM(config).to("cuda:0", dtype=torch.float16).eval()


def check_peaks(failures: list[str]) -> None:
    from gpu_asgi import AnalyticEstimator, cuda_peak_measurer

    model = tiny_qwen2()
    estimator = AnalyticEstimator.from_config(model.config, dtype="float16")
    measure = cuda_peak_measurer(model)
    for prompt, new in ((16, 16), (128, 32), (512, 64), (2048, 64)):
        peak = measure(prompt, new)
        estimate = estimator.estimate(prompt, new)
        print(f"peak prompt={prompt} new={new}: measured {peak / MIB:.1f} MiB, estimated {estimate / MIB:.1f} MiB, "
              f"ratio {estimate / max(peak, 1):.2f}")
        if peak > estimate:
            failures.append(f"peak {peak} > estimate {estimate} at prompt={prompt} new={new}")


def check_probes(failures: list[str]) -> None:
    import torch

    from gpu_asgi import NVMLProbe, TorchProbe

    free, total = torch.cuda.mem_get_info(0)
    nvml = {reading.device: reading for reading in NVMLProbe().read()}
    torch_readings = {reading.device: reading for reading in TorchProbe().read()}
    print(f"probes: torch free {free / MIB:.0f} MiB of {total / MIB:.0f}; nvml {nvml.get('cuda:0')}; "
          f"torch probe {torch_readings.get('cuda:0')}")
    reading = nvml.get("cuda:0")
    if reading is None or reading.memory_total_bytes != total:
        failures.append(f"NVML total {reading and reading.memory_total_bytes} != torch total {total}")
    elif reading.memory_free_bytes is None or abs(reading.memory_free_bytes - free) > 256 * MIB:
        failures.append(f"NVML free {reading.memory_free_bytes} not within 256 MiB of torch free {free}")
    if torch_readings.get("cuda:0") is None:
        failures.append("TorchProbe read no cuda:0")


def check_guard(failures: list[str]) -> None:
    import torch

    from gpu_asgi import (
        DeviceGuard,
        DeviceSampler,
        GPUAdmissionMiddleware,
        Ledger,
        LinearEstimator,
        NVMLProbe,
        RouteSpec,
    )

    async def endpoint(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    sampler = DeviceSampler(NVMLProbe(), interval=0.05)
    app = GPUAdmissionMiddleware(
        endpoint, ledger=Ledger({"cuda:0": 1 << 40}), estimator=LinearEstimator(bytes_per_token=MIB),
        sampler=sampler, device_guard=DeviceGuard(margin_bytes=64 * MIB), routes={"/generate": RouteSpec()},
    )

    async def post() -> int:
        body = json.dumps({"prompt": "a " * 100, "max_new_tokens": 100}).encode()
        sent: list[dict[str, Any]] = []
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict[str, Any]:
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/generate", "root_path": "", "query_string": b"",
                 "headers": [(b"content-type", b"application/json")], "state": {}}
        await app(scope, receive, send)
        return int(sent[0]["status"])

    async def run() -> tuple[int, int]:
        sampler.start()
        free, _ = torch.cuda.mem_get_info(0)
        hog = torch.empty(free - 128 * MIB, dtype=torch.uint8, device="cuda:0")
        await asyncio.sleep(0.3)
        refused = await post()
        del hog
        torch.cuda.empty_cache()
        await asyncio.sleep(0.3)
        admitted = await post()
        sampler.stop()
        return refused, admitted

    refused, admitted = asyncio.run(run())
    print(f"guard: with memory taken {refused}, after it was freed {admitted}")
    if (refused, admitted) != (503, 200):
        failures.append(f"device guard answered {refused} then {admitted}, expected 503 then 200")


def check_executor(failures: list[str]) -> None:
    import torch

    from gpu_asgi import DeviceExecutor

    async def run() -> int:
        async with DeviceExecutor("cuda:0") as executor:
            return await executor.run(torch.cuda.current_device)

    device = asyncio.run(run())
    if device != 0:
        failures.append(f"DeviceExecutor thread ran on device {device}")


if __name__ == "__main__":
    sys.exit(main())
