"""problem+json (RFC 9457) responses, optionally with OpenAI's ``error`` object, and ``Retry-After``."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from .._admission.spec import RouteSpec
from .._errors import DeadlineUnmeetable, DeviceMemoryLow, GPUAdmissionError, QueueFull, QueueTimeout
from .._types import Send

#: Response header naming why gpu_asgi answered instead of the endpoint.
REASON_HEADER = b"x-gpu-admission-reason"
#: Refusals for load: answered with the configured ``reject_status`` (429 or 503).
OVERLOAD = (QueueFull, QueueTimeout, DeviceMemoryLow, DeadlineUnmeetable)


@dataclass(frozen=True, slots=True)
class ProblemStyle:
    """How gpu_asgi's own answers look: the status of a refusal for load, and whether the body
    carries OpenAI's ``error`` object (a route's ``RouteSpec.openai_errors`` wins)."""

    reject_status: int = 503
    openai_errors: bool = False

    def __post_init__(self) -> None:
        if self.reject_status not in (429, 503):
            raise ValueError("reject_status must be 429 or 503")

    async def send(self, send: Send, error: GPUAdmissionError, spec: RouteSpec | None, instance: str) -> None:
        """Answer ``error`` for a request of the route ``spec``."""
        # 429 (when configured) is for overload only; a ledger or probe outage stays a 503.
        status = self.reject_status if isinstance(error, OVERLOAD) else error.status
        openai = self.openai_errors if spec is None or spec.openai_errors is None else spec.openai_errors
        await send_problem(send, error, status=status, instance=instance, openai=openai)


def retry_after_header(seconds: float) -> bytes:
    """Whole seconds, rounded up and at least 1, as RFC 9110 asks (delay-seconds)."""
    return str(max(1, math.ceil(seconds))).encode("ascii")


def openai_error(error: GPUAdmissionError, status: int) -> dict[str, Any]:
    """OpenAI's error object for ``error``: what OpenAI's SDKs read to build their exception.

    ``message`` is the problem's title and detail (the SDKs put it in the exception's text),
    ``code`` its reason slug, ``param`` the body field at
    fault (or None); ``type`` follows OpenAI's families: ``invalid_request_error`` for a 4xx,
    ``rate_limit_exceeded`` for a 429, ``server_error`` for a 5xx.
    """
    kind = "rate_limit_exceeded" if status == 429 else "invalid_request_error" if status < 500 else "server_error"
    message = f"{error.title}: {error.detail}"
    return {"message": message, "type": kind, "param": error.extensions.get("field"), "code": error.reason}


async def send_problem(
    send: Send, error: GPUAdmissionError, *, status: int | None = None, instance: str = "", openai: bool = False
) -> None:
    """Send ``error`` as a complete ``application/problem+json`` response.

    With ``openai``, the body also carries OpenAI's ``{"error": {...}}`` member (an RFC 9457
    extension member), so OpenAI's client libraries show the reason in their exception.
    """
    status = status or error.status
    payload: dict[str, object] = {
        "type": error.type,
        "title": error.title,
        "status": status,
        "detail": error.detail,
    }
    if instance:
        payload["instance"] = instance
    payload.update(error.extensions)
    if openai:
        payload["error"] = openai_error(error, status)
    body = json.dumps(payload, separators=(",", ":")).encode("utf-8")
    headers = [
        (b"content-type", b"application/problem+json"),
        (b"content-length", str(len(body)).encode("ascii")),
        (REASON_HEADER, error.reason.encode("ascii")),
    ]
    if error.retry_after is not None:
        headers.append((b"retry-after", retry_after_header(error.retry_after)))
    if error.close_connection:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
