"""``DeviceExecutor``: blocking model calls on one thread pinned to one device.

The thread sets its CUDA device once, when it starts, and runs every call under
``torch.inference_mode()``. The caller's OpenTelemetry context travels into the thread, so
``gpu_phase`` spans there nest under the request's server span. torch is imported in the thread,
lazily; on the CPU (device ``"cpu"``) the executor works without a GPU, and without torch at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Self, TypeVar

from opentelemetry.trace import TracerProvider

from .binding import ThreadBinding, bind_thread

T = TypeVar("T")

#: The stop flag of the call running on this thread (None outside a ``DeviceExecutor`` call).
_current = threading.local()


def stop_requested() -> bool:
    """In a ``DeviceExecutor`` call: True once the awaiting task was cancelled (its client left).

    Read it between steps (a decode step, a batch) and return early; the request's bytes are
    released only after the call has returned. Outside such a call: always False.
    """
    flag: threading.Event | None = getattr(_current, "stop", None)
    return flag is not None and flag.is_set()


class StopOnCancel:
    """A Hugging Face ``generate`` stopping criterion: stop every sequence once :func:`stop_requested`.

    ``model.generate(ids, stopping_criteria=StoppingCriteriaList([StopOnCancel()]))`` inside a
    ``DeviceExecutor`` call; generation ends after the step in progress.
    """

    def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
        import torch  # only ever called by transformers, which has torch

        return torch.full((input_ids.shape[0],), stop_requested(), dtype=torch.bool, device=input_ids.device)


class DeviceExecutor:
    """Run ``fn(*args)`` on this device's thread: ``out = await executor.run(generate, ids)``.

    - ``synchronize=True`` makes every ``gpu_phase`` in the thread wait for the device before its
      span ends (accurate phase timings, at the cost of a sync per phase); off by default.
    - ``inference_mode=False`` runs without ``torch.inference_mode()`` (e.g. for calibration).
    - Cancelling the awaiting task cannot kill the thread: it sets the call's stop flag
      (:func:`stop_requested`, :class:`StopOnCancel` for ``generate``), which a call that
      checks it between steps obeys at the next step, and ``run`` waits for the call to
      return before it re-raises the cancellation, so the request's reservation is still held
      while the device is using the memory. Repeated cancellations (anyio cancel scopes
      re-deliver them) are absorbed too: a cancelled request ends when its device call ends.

    One thread means calls on a device run one after another: batch requests (as the demo
    service does) to use the GPU fully. Create one executor per device and pick it by
    ``admission.device``. Call ``shutdown()`` (or use ``async with``) when the app stops.
    """

    def __init__(
        self,
        device: str = "cuda:0",
        *,
        synchronize: bool = False,
        inference_mode: bool = True,
        tracer_provider: TracerProvider | None = None,
    ) -> None:
        self.device = device
        self.synchronize = synchronize
        self.inference_mode = inference_mode
        self._tracer_provider = tracer_provider
        self._pool: ThreadPoolExecutor | None = None
        self._torch: Any = None
        self._init_error: BaseException | None = None

    def __repr__(self) -> str:
        return f"DeviceExecutor({self.device!r}, synchronize={self.synchronize}, inference_mode={self.inference_mode})"

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix=f"gpu_asgi-{self.device}", initializer=self._pin_thread
            )
        return self._pool

    def _pin_thread(self) -> None:
        """Once per thread: import torch, set the device, tell ``gpu_phase`` about this thread."""
        sync: Callable[[], None] | None = None
        try:
            torch = sys.modules.get("torch")
            if torch is None and (self.is_cuda or self.inference_mode):
                try:
                    import torch
                except ImportError:
                    if self.is_cuda:
                        raise RuntimeError(f"DeviceExecutor({self.device!r}) needs torch with CUDA") from None
            if torch is not None and self.is_cuda:
                torch.cuda.set_device(self.device)
                sync = functools.partial(torch.cuda.synchronize, self.device)
            self._torch = torch
        except BaseException as exc:  # reported on every call, not a silently broken pool
            self._init_error = exc
        bind_thread(ThreadBinding(self.device, self._tracer_provider, self.synchronize, sync))

    def _call_measured(
        self, fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[T, int | None]:
        torch = self._torch
        if not self.is_cuda or torch is None:
            return self._call(fn, args, kwargs), None  # the CPU allocator keeps no peak to read
        # Allocations are counted on the host as kernels are queued, so no synchronize is needed.
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        result = self._call(fn, args, kwargs)
        return result, max(0, torch.cuda.max_memory_allocated(self.device) - before)

    @staticmethod
    def _flagged(stop: threading.Event, call: Callable[..., T], *args: Any) -> T:
        """Run ``call`` on the thread with ``stop`` as its :func:`stop_requested` flag."""
        _current.stop = stop
        try:
            return call(*args)
        finally:
            _current.stop = None

    def _call(self, fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any]) -> T:
        if self._init_error is not None:
            raise self._init_error
        torch = self._torch
        mode = torch.inference_mode() if self.inference_mode and torch is not None else contextlib.nullcontext()
        with mode:
            return fn(*args, **kwargs)

    async def run(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """Run ``fn`` on the device thread and return its result (or raise its exception)."""
        return await self._run(self._call, fn, args, kwargs)

    async def run_measured(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> tuple[T, int | None]:
        """Like :meth:`run`, plus the call's peak device bytes above what was allocated before it.

        On CUDA, ``torch.cuda.reset_peak_memory_stats`` and ``max_memory_allocated`` bracket the
        call (the device's peak statistics are reset: do not read them elsewhere meanwhile). The
        peak is this call's own while nothing else allocates on the device, as when this executor
        is its only user. On the CPU nothing is recorded: ``None``. Hand the peak to
        ``admission.report_peak_bytes`` (for a batched call, split it between the requests).
        """
        return await self._run(self._call_measured, fn, args, kwargs)

    async def _run(self, call: Callable[..., T], fn: Callable[..., Any], args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> T:
        loop = asyncio.get_running_loop()
        context = contextvars.copy_context()  # carries the current span into the thread
        stop = threading.Event()
        future = loop.run_in_executor(self._executor(), context.run, self._flagged, stop, call, fn, args, kwargs)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            stop.set()  # a call that reads stop_requested() returns at its next step
            # The device is still working: wait for it, so the caller's reservation stays held.
            # anyio (Starlette's streams) re-cancels every loop iteration, so every cancellation
            # is absorbed until the call returns; the last one is re-raised after.
            while not future.done():
                try:
                    await asyncio.wait((future,))
                except asyncio.CancelledError:
                    continue
            raise

    def shutdown(self, wait: bool = True) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=wait)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.shutdown)
