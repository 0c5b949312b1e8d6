"""What a rejection looks like to a client: its status, gpu_asgi's reason header, ``Retry-After``.

Standard library only: the locustfile imports it into an environment that has locust and nothing else.
"""

from __future__ import annotations

import email.utils
import time

REJECTED = (429, 503)
REASON_HEADER = "x-gpu-admission-reason"


def parse_retry_after(value: str | None) -> float | None:
    """``Retry-After`` as seconds: delay-seconds or an HTTP date (RFC 9110)."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())
