"""Typed errors. Each one knows the problem+json (RFC 9457) answer it becomes."""

from __future__ import annotations

from typing import Any, ClassVar

#: Problem ``type`` URIs share this prefix; the slug after it is the ``reason``.
PROBLEM_TYPE_PREFIX = "urn:gpu-asgi:problem:"


class GPUAdmissionError(Exception):
    """Base class: a request that gpu_asgi answers itself instead of calling the endpoint."""

    status: ClassVar[int] = 400
    reason: ClassVar[str] = "bad-request"
    title: ClassVar[str] = "Bad request"
    #: The answer carries ``Connection: close``: the client's next try should open a new connection
    #: (which a load balancer sends to another replica).
    close_connection: ClassVar[bool] = False

    def __init__(self, detail: str, *, retry_after: float | None = None, **extensions: Any) -> None:
        super().__init__(detail)
        self.detail = detail
        self.retry_after = retry_after
        self.extensions = extensions

    @property
    def type(self) -> str:
        return PROBLEM_TYPE_PREFIX + self.reason


# -- request body -------------------------------------------------------------------------


class BodyError(GPUAdmissionError):
    """The request body could not be used to admit the request."""


class InvalidJSON(BodyError):
    status, reason, title = 400, "invalid-json", "Request body is not valid JSON"


class UnsupportedMediaType(BodyError):
    status, reason, title = 415, "unsupported-media-type", "Request body must be JSON"


class BodyTooLarge(BodyError):
    status, reason, title = 413, "body-too-large", "Request body is too large"


class BodyTimeout(BodyError):
    status, reason, title = 408, "body-timeout", "Request body was not received in time"


class InvalidHeader(GPUAdmissionError):
    """A request header gpu_asgi reads (``x-request-timeout``) has a value it cannot use."""

    status, reason, title = 400, "invalid-header", "A request header is invalid"


class InvalidTenant(GPUAdmissionError):
    """The tenant key of the request (a header, a body field or the tenant callable) cannot be used:
    too long, or with control characters. The problem names the ``header`` or ``field``."""

    status, reason, title = 400, "invalid-tenant", "The request's tenant key is invalid"


class InvalidField(BodyError):
    """A field is missing, of the wrong type or out of range."""

    status, reason, title = 422, "invalid-field", "Request body has an invalid field"


# -- admission ----------------------------------------------------------------------------


class AdmissionRejected(GPUAdmissionError):
    """The ledger refused the request; ``retry_after`` says when to try again."""

    status, reason, title = 503, "rejected", "GPU capacity is exhausted"


class QueueFull(AdmissionRejected):
    reason, title = "queue-full", "The GPU admission queue is full"


class QueueTimeout(AdmissionRejected):
    reason, title = "queue-timeout", "The request waited too long for GPU memory"


class DeadlineUnmeetable(AdmissionRejected):
    """The request would have to queue, and the predicted wait is longer than it is willing to wait."""

    reason, title = "deadline-unmeetable", "The GPU cannot admit the request within its deadline"


class NeverFits(AdmissionRejected):
    """The request needs more bytes than any allowed device's whole budget: retrying cannot help."""

    status, reason, title = 413, "exceeds-budget", "The request needs more GPU memory than the budget"


class OverTenantQuota(AdmissionRejected):
    """The request needs more bytes than its tenant may hold at once (its quota): retrying cannot help."""

    status, reason, title = 413, "exceeds-tenant-quota", "The request needs more GPU memory than its tenant's quota"


class DeviceMemoryLow(AdmissionRejected):
    """The ledger had room, but the device's real free memory (sampled) is below the estimate plus a margin."""

    reason, title = "device-memory-low", "The GPU has too little free memory right now"


class DeviceProbeFailed(AdmissionRejected):
    """The device guard fails closed and the device could not be read (or its reading is too old)."""

    reason, title = "device-probe-failed", "The GPU's free memory could not be checked"


class ClientClosedRequest(GPUAdmissionError):
    """The client disconnected before the request was admitted (while sending its body, or queued).

    Nobody reads this answer; it is sent for whatever records the request on its way out (an
    access log, an outer middleware). 499 is the status nginx logs for it.
    """

    status, reason, title = 499, "client-closed-request", "The client closed the request before it was admitted"


class LedgerUnavailable(AdmissionRejected):
    """The shared ledger (Redis) did not answer in time; admission fails closed rather than guess."""

    reason, title = "ledger-unavailable", "The GPU budget ledger is unavailable"


class ShuttingDown(AdmissionRejected):
    """The process is draining (``Lifecycle.drain``): it admits nothing new and fails its queue at once.

    Answered with ``Retry-After`` and ``Connection: close`` so that a load balancer or client
    retries on another replica.
    """

    reason, title = "shutting-down", "The server is shutting down"
    close_connection = True
