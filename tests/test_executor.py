"""``DeviceExecutor``: one pinned thread, inference mode, context propagation, cancellation.

On the CPU the executor runs for real with device ``"cpu"``. For the CUDA path the test replaces
``torch.cuda.set_device`` and ``torch.cuda.synchronize`` (there is no GPU here) to check that the
device is set once per thread and that phases synchronize when asked; real CUDA is untested.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from typing import Any

import pytest
import torch
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gpu_asgi import DeviceExecutor, gpu_phase


def tracing() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


async def test_calls_run_on_one_thread_under_inference_mode() -> None:
    async with DeviceExecutor("cpu") as executor:

        def where(x: int, *, y: int) -> tuple[str, bool, int]:
            return threading.current_thread().name, torch.is_inference_mode_enabled(), x + y

        first = await executor.run(where, 1, y=2)
        second = await executor.run(where, 3, y=4)
    assert first[0] == second[0] and first[0].startswith("gpu_asgi-cpu") and first[0] != threading.current_thread().name
    assert first[1:] == (True, 3) and second[1:] == (True, 7)
    assert not torch.is_inference_mode_enabled()  # only inside the executor's calls


async def test_tensors_made_inside_are_inference_tensors_unless_disabled() -> None:
    with DeviceExecutor("cpu") as on, DeviceExecutor("cpu", inference_mode=False) as off:
        inside = await on.run(lambda: torch.ones(2) * 2)
        outside = await off.run(lambda: torch.ones(2) * 2)
    assert inside.is_inference() and not outside.is_inference()


async def test_exceptions_propagate() -> None:
    with DeviceExecutor("cpu") as executor:
        with pytest.raises(ZeroDivisionError):
            await executor.run(lambda: 1 / 0)
        assert await executor.run(lambda: "still works") == "still works"


async def test_phase_spans_in_the_thread_nest_under_the_callers_span() -> None:
    provider, exporter = tracing()
    tracer = provider.get_tracer("test")
    with DeviceExecutor("cpu", tracer_provider=provider) as executor:

        def work() -> None:
            with gpu_phase("host_to_device", bytes=8):
                pass
            with gpu_phase("generate", batch=2) as phase:
                phase.set(tokens_out=11)

        with tracer.start_as_current_span("request") as request_span:
            await executor.run(work)
        await executor.run(work)  # no caller span: the phases are roots, not children of the last one
    spans = exporter.get_finished_spans()
    nested = [span for span in spans if span.parent is not None]
    assert [span.name for span in nested] == ["gpu_asgi.host_to_device", "gpu_asgi.generate"]
    assert all(span.parent.span_id == request_span.get_span_context().span_id for span in nested)
    roots = [span.name for span in spans if span.parent is None]
    assert roots == ["request", "gpu_asgi.host_to_device", "gpu_asgi.generate"]
    assert all(span.attributes["gpu_asgi.device"] == "cpu" for span in spans if span.name.startswith("gpu_asgi."))


async def test_cancellation_waits_for_the_device_work() -> None:
    started, release = threading.Event(), threading.Event()
    finished: list[bool] = []

    def long_generate() -> None:
        started.set()
        release.wait(5)
        finished.append(True)

    with DeviceExecutor("cpu") as executor:
        task = asyncio.ensure_future(executor.run(long_generate))
        await asyncio.to_thread(started.wait, 5)
        task.cancel()
        await asyncio.sleep(0.02)
        task.cancel()  # anyio cancel scopes re-deliver: still absorbed
        await asyncio.sleep(0.02)
        assert not task.done()  # still waiting: the caller's reservation must stay held meanwhile
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert finished == [True]


async def test_cuda_device_is_set_once_and_phases_synchronize(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, Any]] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(("synchronize", device)))
    provider, exporter = tracing()

    def work() -> None:
        with gpu_phase("host_to_device"):
            calls.append(("copy", None))
        with gpu_phase("generate"):
            calls.append(("generate", None))
        with gpu_phase("device_to_host", synchronize=False):
            calls.append(("copy back", None))

    with DeviceExecutor("cuda:1", synchronize=True, tracer_provider=provider) as executor:
        await executor.run(work)
        await executor.run(work)
    once = [
        ("copy", None),
        ("synchronize", "cuda:1"),
        ("generate", None),
        ("synchronize", "cuda:1"),
        ("copy back", None),
    ]
    assert calls == [("set_device", "cuda:1"), *once, *once]
    assert {span.attributes["gpu_asgi.device"] for span in exporter.get_finished_spans()} == {"cuda:1"}


async def test_without_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # as if torch were not installed
    with DeviceExecutor("cpu") as cpu:
        assert await cpu.run(lambda: 42) == 42
    with DeviceExecutor("cuda:0") as cuda, pytest.raises(RuntimeError, match="needs torch with CUDA"):
        await cuda.run(lambda: 42)


async def test_run_measured_records_nothing_on_the_cpu() -> None:
    with DeviceExecutor("cpu") as executor:
        result, peak = await executor.run_measured(lambda x, *, y: (x + y, torch.is_inference_mode_enabled()), 1, y=2)
    assert result == (3, True) and peak is None


async def test_run_measured_brackets_the_call_with_cudas_peak_statistics(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fake allocator statistics (no GPU here): the peak is the call's own, above what was there."""
    allocated = {"now": 5_000, "peak": 9_000}  # 9,000 peaked before the call: reset must forget it
    calls: list[tuple[str, Any]] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated["now"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: allocated["peak"])

    def reset(device: Any = None) -> None:
        calls.append(("reset", device))
        allocated["peak"] = allocated["now"]

    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)

    def generate(nbytes: int) -> str:
        calls.append(("generate", nbytes))
        allocated["peak"] = max(allocated["peak"], allocated["now"] + nbytes)  # allocate, then free
        return "tokens"

    with DeviceExecutor("cuda:0") as executor:
        assert await executor.run_measured(generate, 1_500) == ("tokens", 1_500)
        assert await executor.run_measured(generate, 700) == ("tokens", 700)
        assert await executor.run(generate, 9_999) == "tokens"  # plain run: statistics untouched
    assert calls == [("reset", "cuda:0"), ("generate", 1_500), ("reset", "cuda:0"), ("generate", 700), ("generate", 9_999)]
