"""What a :class:`DeviceExecutor` thread tells code running on it: its device, where its spans go,
and how to wait for the device. ``gpu_phase`` (``_observe.tracing``) reads it."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from opentelemetry.trace import TracerProvider


@dataclass(frozen=True, slots=True)
class ThreadBinding:
    """One device thread's settings, fixed when the thread starts."""

    device: str
    #: The executor's tracer provider; None: the global one.
    tracer_provider: TracerProvider | None
    #: Whether each ``gpu_phase`` waits for the device before its span ends.
    synchronize: bool
    #: Waits for this thread's device (None: nothing to wait for, as on the CPU).
    sync: Callable[[], None] | None


_thread = threading.local()


def bind_thread(binding: ThreadBinding | None) -> None:
    """Record ``binding`` for the calling thread."""
    _thread.binding = binding


def thread_binding() -> ThreadBinding | None:
    """The calling thread's binding; None outside a device thread."""
    return getattr(_thread, "binding", None)
