"""What the demo's OpenAPI schema says about error answers: every status gpu_asgi or the demo gives.

gpu_asgi answers before the endpoint runs, so FastAPI cannot see those answers; they are declared
here, once, for every generating route: problem+json (RFC 9457), with OpenAI's ``error`` member
on the OpenAI routes, and ``Retry-After`` on the overload answers.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from .problems import MEDIA_TYPE


class Problem(BaseModel):
    """An RFC 9457 problem. Extension members (``field``, ``required_bytes``, ``errors``, ...) may follow."""

    model_config = ConfigDict(extra="allow")

    type: str = Field(description="A URI naming the problem: urn:gpu-asgi:problem:<reason> or urn:demo-service:problem:<reason>.")
    title: str
    status: int
    detail: str
    instance: str | None = None


class OpenAIError(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class OpenAIProblem(Problem):
    """A problem that also carries OpenAI's error object, which OpenAI's SDKs show."""

    error: OpenAIError


_RETRY_AFTER = {
    "Retry-After": {
        "description": "Seconds until enough GPU memory is expected to be free (from the observed release rate).",
        "schema": {"type": "integer", "minimum": 1},
    }
}
_WHEN = {
    400: "The body is not JSON, not UTF-8, nested too deeply, or holds an integer of more than 4300 digits "
    "(gpu_asgi: invalid-json), or x-request-timeout is not a positive, finite number of seconds (invalid-header).",
    404: "The model named is not served here.",
    408: "The body was not received in time (gpu_asgi: body-timeout).",
    413: "The body is too large (body-too-large), or the request needs more GPU memory than the whole budget "
    "(exceeds-budget).",
    415: "The Content-Type is not JSON (gpu_asgi: unsupported-media-type).",
    422: "A field is missing, of the wrong type or out of range: gpu_asgi's invalid-field (prompt, max tokens, n), "
    "or the demo's validation (with an errors list).",
    429: "Overloaded, when the server answers overload with 429: queue-full, queue-timeout, deadline-unmeetable, "
    "device-memory-low.",
    500: "Generation failed.",
    503: "Overloaded (queue-full, queue-timeout, deadline-unmeetable, device-memory-low), or the ledger or the device probe is "
    "unavailable (ledger-unavailable, device-probe-failed).",
}


def error_responses(*, openai: bool) -> dict[int | str, dict[str, Any]]:
    """The ``responses=`` of a generating route: every error status, as problem+json."""
    schema = _inline((OpenAIProblem if openai else Problem).model_json_schema())
    responses: dict[int | str, dict[str, Any]] = {}
    for status, description in _WHEN.items():
        response: dict[str, Any] = {"description": description, "content": {MEDIA_TYPE: {"schema": schema}}}
        if status in (429, 503):
            response["headers"] = _RETRY_AFTER
        responses[status] = response
    return responses


def _inline(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with its ``$defs`` substituted: OpenAPI resolves ``$ref`` against the whole document."""
    defs = schema.pop("$defs", {})

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return walk(defs[ref.removeprefix("#/$defs/")])
            return {key: walk(value) for key, value in node.items()}
        if isinstance(node, list):
            return [walk(item) for item in node]
        return node

    return walk(schema)  # type: ignore[no-any-return]
