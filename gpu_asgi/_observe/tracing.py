"""OpenTelemetry spans: attribute names, the queue-wait span, and ``gpu_phase`` for endpoints.

Every span is a child of whatever span is current: the server span of
``opentelemetry-instrumentation-fastapi`` (or FastAPI's built-in telemetry, or any ASGI
instrumentation wrapping the app). Only the API is used here; with no SDK configured every call
is the API's no-op, so nothing is recorded and almost nothing is paid.

Attribute names: GenAI semantic conventions where one fits (``gen_ai.*``, ``error.type``), and the
``gpu_asgi.*`` namespace, documented in docs/tracing.md, for admission and device work, for which
no convention exists.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode, Tracer, TracerProvider

from .._device.binding import ThreadBinding, thread_binding

INSTRUMENTATION_NAME = "gpu_asgi"
INSTRUMENTATION_VERSION = "0.1.0"

# -- semantic conventions (names as in opentelemetry-semantic-conventions 0.66b2; that package now
#    marks its gen_ai constants deprecated because the GenAI conventions moved to their own
#    repository, with the names unchanged, so they are spelled out here) ---------------------------
GEN_AI_OPERATION_NAME = "gen_ai.operation.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
ERROR_TYPE = "error.type"

# -- gpu_asgi.* ---------------------------------------------------------------------------------
ADMISSION_ESTIMATED_BYTES = "gpu_asgi.admission.estimated_bytes"
ADMISSION_DEVICE = "gpu_asgi.admission.device"
ADMISSION_QUEUE_DEPTH = "gpu_asgi.admission.queue_depth"
ADMISSION_OUTCOME = "gpu_asgi.admission.outcome"
ADMISSION_REASON = "gpu_asgi.admission.reason"
ADMISSION_WAIT_SECONDS = "gpu_asgi.admission.wait_seconds"
ADMISSION_PRIORITY = "gpu_asgi.admission.priority"
#: The request's tenant as metrics name it: a tenant named in advance, ``default`` or ``other``.
ADMISSION_TENANT = "gpu_asgi.admission.tenant"
#: ``max_new_tokens`` as the client asked, when the thermal policy lowered it.
ADMISSION_REQUESTED_MAX_TOKENS = "gpu_asgi.admission.requested_max_tokens"
DEVICE = "gpu_asgi.device"
BATCH_SIZE = "gpu_asgi.batch_size"
COPY_DIRECTION = "gpu_asgi.copy.direction"
COPY_BYTES = "gpu_asgi.copy.bytes"

# -- outcomes of the queue wait -----------------------------------------------------------------
ADMITTED = "admitted"
REJECTED = "rejected"
TIMED_OUT = "timed_out"
DISCONNECTED = "disconnected"
CANCELLED = "cancelled"

# -- span names ---------------------------------------------------------------------------------
QUEUE_WAIT_SPAN = "gpu_asgi.queue_wait"
HOST_TO_DEVICE = "host_to_device"
DEVICE_TO_HOST = "device_to_host"
GENERATE = "generate"
_COPIES = frozenset({HOST_TO_DEVICE, DEVICE_TO_HOST})

#: ``gpu_phase`` keywords and the attributes they set.
PHASE_ATTRIBUTES: Mapping[str, str] = {
    "tokens_in": GEN_AI_USAGE_INPUT_TOKENS,
    "tokens_out": GEN_AI_USAGE_OUTPUT_TOKENS,
    "max_new_tokens": GEN_AI_REQUEST_MAX_TOKENS,
    "model": GEN_AI_REQUEST_MODEL,
    "operation": GEN_AI_OPERATION_NAME,
    "batch": BATCH_SIZE,
    "bytes": COPY_BYTES,
    "device": DEVICE,
}


def get_tracer(tracer_provider: TracerProvider | None = None) -> Tracer:
    """gpu_asgi's tracer from ``tracer_provider``, or the global one (a proxy until an SDK is set)."""
    return trace.get_tracer(INSTRUMENTATION_NAME, INSTRUMENTATION_VERSION, tracer_provider=tracer_provider)


_default_tracer = get_tracer()


@functools.lru_cache(maxsize=16)
def _tracer_of(tracer_provider: TracerProvider) -> Tracer:
    """One tracer per provider, built once: a device thread names its provider for every phase."""
    return get_tracer(tracer_provider)


# -- the queue wait, used by the middleware ----------------------------------------------------


def queue_wait_attributes(
    prompt_tokens: int,
    max_new_tokens: int,
    nbytes: int,
    batch: int,
    priority: int,
    clamped_from: int | None,
    tenant: str | None = None,
) -> dict[str, Any]:
    """Set right after the span starts, and only when it records: free when tracing is off."""
    attributes: dict[str, Any] = {
        GEN_AI_USAGE_INPUT_TOKENS: prompt_tokens,
        GEN_AI_REQUEST_MAX_TOKENS: max_new_tokens,
        ADMISSION_ESTIMATED_BYTES: nbytes,
        BATCH_SIZE: batch,
        ADMISSION_PRIORITY: priority,
    }
    if clamped_from is not None:
        attributes[ADMISSION_REQUESTED_MAX_TOKENS] = clamped_from
    if tenant is not None:
        attributes[ADMISSION_TENANT] = tenant
    return attributes


def end_queue_wait(
    span: Span, outcome: str, *, device: str | None, queue_depth: int, wait_seconds: float, reason: str | None
) -> None:
    if span.is_recording():
        attributes: dict[str, Any] = {
            ADMISSION_OUTCOME: outcome,
            ADMISSION_QUEUE_DEPTH: queue_depth,
            ADMISSION_WAIT_SECONDS: wait_seconds,
        }
        if device is not None:
            attributes[ADMISSION_DEVICE] = device
        if reason is not None:
            attributes[ADMISSION_REASON] = attributes[ERROR_TYPE] = reason
            span.set_status(Status(StatusCode.ERROR, reason))
        span.set_attributes(attributes)  # one call: the SDK takes the span's lock once
    span.end()


# -- phases inside the endpoint ----------------------------------------------------------------


class Phase:
    """The span of one phase; ``set(tokens_out=...)`` adds what is known only at the end."""

    __slots__ = ("span",)

    def __init__(self, span: Span) -> None:
        self.span = span

    def set(self, **attributes: Any) -> None:
        if self.span.is_recording():
            self.span.set_attributes(phase_attributes(attributes))


def phase_attributes(values: Mapping[str, Any]) -> dict[str, Any]:
    try:
        return {PHASE_ATTRIBUTES[key]: value for key, value in values.items() if value is not None}
    except KeyError as exc:
        known = ", ".join(sorted(PHASE_ATTRIBUTES))
        raise TypeError(f"unknown phase attribute {exc.args[0]!r}: use one of {known}, or attributes={{...}}") from None


@contextmanager
def gpu_phase(
    name: str,
    *,
    synchronize: bool | None = None,
    attributes: Mapping[str, Any] | None = None,
    tracer_provider: TracerProvider | None = None,
    **values: Any,
) -> Iterator[Phase]:
    """A span ``gpu_asgi.<name>`` around one phase of GPU work, in one line::

        with gpu_phase("host_to_device", bytes=ids.nbytes):
            ids = ids.to(device)
        with gpu_phase("generate", batch=len(prompts)) as phase:
            out = model.generate(ids, max_new_tokens=admission.max_new_tokens)
            phase.set(tokens_out=out.shape[-1] - ids.shape[-1])

    Keywords: ``tokens_in``, ``tokens_out``, ``max_new_tokens``, ``model``, ``operation``,
    ``batch``, ``bytes``, ``device`` (see ``PHASE_ATTRIBUTES``); anything else goes in
    ``attributes``. The copy phases ``host_to_device``/``device_to_host`` also get
    ``gpu_asgi.copy.direction``. In a :class:`DeviceExecutor` thread the executor's device, tracer
    and ``synchronize`` setting are the defaults; ``synchronize=True`` waits for the device before
    the span ends, so the span measures the GPU work and not just the kernel launches.
    """
    binding = thread_binding()
    if tracer_provider is None and binding is not None:
        tracer_provider = binding.tracer_provider
    tracer = _default_tracer if tracer_provider is None else _tracer_of(tracer_provider)
    span_attributes = phase_attributes(values)
    if binding is not None:
        span_attributes.setdefault(DEVICE, binding.device)
    if name in _COPIES:
        span_attributes[COPY_DIRECTION] = name
    if attributes:
        span_attributes.update(attributes)
    with tracer.start_as_current_span(INSTRUMENTATION_NAME + "." + name, attributes=span_attributes) as span:
        yield Phase(span)
        if synchronize if synchronize is not None else (binding is not None and binding.synchronize):
            _synchronize(binding)


def _synchronize(binding: ThreadBinding | None) -> None:
    if binding is not None:
        if binding.sync is not None:
            binding.sync()
        return
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
