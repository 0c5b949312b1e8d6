"""Errors the endpoints raise, answered as problem+json (RFC 9457), like gpu_asgi's own answers.

gpu_asgi answers body, size and overload problems before the endpoint runs; these handlers answer
what the endpoint finds wrong (FastAPI validation, an unknown model, a failed batch) in the same shape.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .._service import ClientGone

PROBLEM_TYPE_PREFIX = "urn:demo-service:problem:"
MEDIA_TYPE = "application/problem+json"
#: nginx's "client closed request": logged, never seen by the client that left.
CLIENT_CLOSED_REQUEST = 499

logger = logging.getLogger("demo_service")

_REASONS = {
    400: "bad-request",
    404: "not-found",
    405: "method-not-allowed",
    422: "invalid-request",
    500: "internal-error",
}


def problem(
    status: int, title: str, detail: str, request: Request, *, param: str | None = None, **extensions: Any
) -> JSONResponse:
    """A problem+json answer; it also carries OpenAI's ``error`` member, which OpenAI's SDKs show.

    ``param`` names the request field at fault, as OpenAI's ``error.param`` does.
    """
    reason = _REASONS.get(status, f"http-{status}")
    body = {
        "type": PROBLEM_TYPE_PREFIX + reason,
        "title": title,
        "status": status,
        "detail": detail,
        "instance": request.url.path,
        **extensions,
        "error": {
            "message": detail,
            "type": "invalid_request_error" if status < 500 else "server_error",
            "param": param,
            "code": reason,
        },
    }
    return JSONResponse(body, status_code=status, media_type=MEDIA_TYPE)


async def _validation(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    errors = [
        {"field": ".".join(str(part) for part in error["loc"][1:]) or "body", "message": error["msg"]}
        for error in exc.errors()
    ]
    detail = "; ".join(f"{e['field']}: {e['message']}" for e in errors)
    param = errors[0]["field"] if errors and errors[0]["field"] != "body" else None
    return problem(422, "The request body is invalid", detail, request, param=param, errors=errors)


async def _http(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    title = {404: "Not found", 405: "Method not allowed", 422: "The request is invalid"}.get(
        exc.status_code, "Request failed"
    )
    response = problem(exc.status_code, title, str(exc.detail), request)
    response.headers.update(exc.headers or {})
    return response


async def _client_gone(request: Request, exc: Exception) -> Response:
    return Response(status_code=CLIENT_CLOSED_REQUEST)


async def _internal(request: Request, exc: Exception) -> Response:
    logger.exception("request to %s failed", request.url.path, exc_info=exc)
    return problem(500, "Generation failed", f"{type(exc).__name__}: {exc}", request)


def install_problem_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _validation)
    app.add_exception_handler(HTTPException, _http)
    app.add_exception_handler(ClientGone, _client_gone)
    app.add_exception_handler(Exception, _internal)
