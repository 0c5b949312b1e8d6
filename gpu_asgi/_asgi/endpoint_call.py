"""Admission when FastAPI calls a tagged endpoint: after every dependency it declares (auth) and
after FastAPI has validated its parameters, whatever the endpoint's shape.

FastAPI reads a body parameter before it resolves dependencies, so the body read, where other
shapes are admitted, comes before the app's own checks. ``@gpu_bound`` therefore gives FastAPI a
wrapper of the endpoint whose signature has one parameter more, the ``Request`` (FastAPI passes the
request to any parameter of that type, and documents none of it in OpenAPI). FastAPI calls the
wrapper once everything else has passed; the wrapper admits through that request, then calls the
endpoint (a plain ``def`` on a worker thread, as FastAPI would).

A generator endpoint (FastAPI streams what it yields) is called without being awaited, and its
first item comes after the response has started, too late for a refusal. It gets
``Depends(gpu_admission)`` instead, after its other parameters: it is admitted once its declared
dependencies have run, before FastAPI validates its body parameter.

Whatever else calls the wrapper (Starlette's router, a test calling the function) passes no
request: the endpoint is called as it is, and admitted at its body read.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from .dependencies import ADMIT_SCOPE_KEY, gpu_admission

#: The parameter the wrapper adds: a name no endpoint has (FastAPI passes it by keyword).
REQUEST_PARAMETER = "gpu_asgi_request__"
#: Set on a wrapper: FastAPI admits this endpoint when it calls it, so its body read only checks.
ADMITS_AT_CALL = "__gpu_asgi_admits_at_call__"


def admitting(endpoint: Callable[..., Any]) -> Callable[..., Any]:
    """``endpoint`` wrapped to be admitted when FastAPI calls it; other callables as they are."""
    if not inspect.isfunction(endpoint) or getattr(endpoint, ADMITS_AT_CALL, False):
        return endpoint  # a partial, a class, an instance: admitted at the body read, as before
    try:  # string annotations (``from __future__ import annotations``) evaluated, as FastAPI reads them
        signature = inspect.signature(endpoint, eval_str=True)
    except Exception:  # a name only a type checker sees: left as strings, for FastAPI
        signature = inspect.signature(endpoint)
    generator = inspect.isasyncgenfunction(endpoint) or inspect.isgeneratorfunction(endpoint)
    if generator:
        try:
            from fastapi import Depends
        except ImportError:  # no FastAPI: nothing would pass the dependency
            return endpoint
        added = inspect.Parameter(REQUEST_PARAMETER, inspect.Parameter.KEYWORD_ONLY, default=Depends(gpu_admission))
        call = _passing(endpoint)
    else:
        # FastAPI passes the request to one parameter only: the endpoint's own, when it has one.
        own = _request_parameter(signature)
        if own is not None:
            call = _admitting_call(endpoint, own, drop=False)
            call.__signature__ = signature  # type: ignore[attr-defined]
            setattr(call, ADMITS_AT_CALL, True)
            return call
        added = inspect.Parameter(REQUEST_PARAMETER, inspect.Parameter.KEYWORD_ONLY, annotation=Request)
        call = _admitting_call(endpoint, REQUEST_PARAMETER, drop=True)
    parameters = list(signature.parameters.values())
    # A keyword-only parameter goes before **kwargs, if there is one.
    at = len(parameters) - (bool(parameters) and parameters[-1].kind is inspect.Parameter.VAR_KEYWORD)
    parameters.insert(at, added)
    call.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
    setattr(call, ADMITS_AT_CALL, True)
    return call


def _request_parameter(signature: inspect.Signature) -> str | None:
    """The name of the endpoint's own ``Request`` parameter (by keyword), if it has one."""
    for parameter in signature.parameters.values():
        annotation = parameter.annotation
        if isinstance(annotation, type) and issubclass(annotation, Request):
            if parameter.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY):
                return parameter.name
    return None


def admits_at_call(endpoint: Any) -> bool:
    """Whether ``endpoint`` is a wrapper that FastAPI's call admits (or an instance whose
    ``__call__`` is one)."""
    if getattr(endpoint, ADMITS_AT_CALL, False) is True:
        return True
    if endpoint is None or inspect.isfunction(endpoint) or isinstance(endpoint, type):
        return False
    return getattr(type(endpoint).__call__, ADMITS_AT_CALL, False) is True


def _admitting_call(endpoint: Callable[..., Any], name: str, *, drop: bool) -> Callable[..., Any]:
    """Admit through the request FastAPI passes as ``name`` (ours, ``drop``ped; or the endpoint's own)."""
    is_async = inspect.iscoroutinefunction(endpoint)

    @functools.wraps(endpoint)
    async def call(*args: Any, **kwargs: Any) -> Any:
        request = kwargs.pop(name, None) if drop else kwargs.get(name)
        # The responder left admission to this call (without a middleware in front, nothing
        # waits here, and the tag only names the route). A refusal ends the request here, as
        # gpu_asgi's own answer.
        if request is not None:
            await request.body()  # the middleware's body read decides (kept: the endpoint reads this request)
            deferred = request.scope.get(ADMIT_SCOPE_KEY)
            if deferred is not None:
                await deferred.admit()
        if is_async:
            return await endpoint(*args, **kwargs)
        return await run_in_threadpool(endpoint, *args, **kwargs)

    return call


def _passing(endpoint: Callable[..., Any]) -> Callable[..., Any]:
    """A generator endpoint, called as it is: FastAPI tells its kind through ``__wrapped__``."""

    @functools.wraps(endpoint)
    def call(*args: Any, **kwargs: Any) -> Any:
        kwargs.pop(REQUEST_PARAMETER, None)
        return endpoint(*args, **kwargs)

    return call
