"""problem+json (RFC 9457) responses and the ``Retry-After`` header."""

from __future__ import annotations

import json
import math

from ._errors import GPUAdmissionError
from ._types import Send

#: Response header naming why gpu_asgi answered instead of the endpoint.
REASON_HEADER = b"x-gpu-admission-reason"


def retry_after_header(seconds: float) -> bytes:
    """Whole seconds, rounded up and at least 1, as RFC 9110 asks (delay-seconds)."""
    return str(max(1, math.ceil(seconds))).encode("ascii")


async def send_problem(send: Send, error: GPUAdmissionError, *, status: int | None = None, instance: str = "") -> None:
    """Send ``error`` as a complete ``application/problem+json`` response."""
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
    body = json.dumps(payload, separators=(",", ":")).encode("utf-8")
    headers = [
        (b"content-type", b"application/problem+json"),
        (b"content-length", str(len(body)).encode("ascii")),
        (REASON_HEADER, error.reason.encode("ascii")),
    ]
    if error.retry_after is not None:
        headers.append((b"retry-after", retry_after_header(error.retry_after)))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
