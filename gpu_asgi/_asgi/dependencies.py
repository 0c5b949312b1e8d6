"""Reach the admission from an endpoint: ``Depends(gpu_admission)``, ``Depends(gpu_reservation)``
or ``request.state``.

An endpoint that declares one of these dependencies is admitted when the dependency runs, so
FastAPI's declaration order decides what comes first: an auth dependency declared before it
refuses a request before any byte is queued for or reserved (docs/endpoints.md). Any other tagged
endpoint is admitted when its body is first read.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

from starlette.requests import Request

from .._admission.gate import Admission
from .._ledger.contract import Reservation

#: Keys under ``scope["state"]`` (so ``request.state.gpu_admission`` in Starlette/FastAPI).
ADMISSION_STATE_KEY = "gpu_admission"
RESERVATION_STATE_KEY = "gpu_reservation"
#: Scope key holding the request's responder (its ``admit()``) while a tagged request waits for
#: its endpoint's call or its dependency to admit it.
ADMIT_SCOPE_KEY = "gpu_asgi.admit"


class _Deferred(Protocol):
    async def admit(self) -> Admission: ...

#: How many dependency levels are searched for ours: a bound on a cycle.
_MAX_DEPTH = 32
_declaring: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


async def gpu_admission(request: Request) -> Admission:
    """The :class:`Admission` of this request (FastAPI: ``Depends(gpu_admission)``).

    When the request is not admitted yet, it is admitted here: the body is read through the
    request (the endpoint still gets the same bytes), and a refusal is gpu_asgi's own answer
    (problem+json with its status and ``Retry-After``), not an error of the endpoint.
    """
    admission = request.scope.get("state", {}).get(ADMISSION_STATE_KEY)
    if admission is not None:
        return admission  # type: ignore[no-any-return]
    await request.body()  # through the middleware's receive, which then holds the body for admit()
    admission = request.scope.get("state", {}).get(ADMISSION_STATE_KEY)
    if admission is not None:  # the read admitted it (a tagged route that does not declare us)
        return admission  # type: ignore[no-any-return]
    deferred: _Deferred | None = request.scope.get(ADMIT_SCOPE_KEY)
    if deferred is None:
        raise RuntimeError(
            "This request has not been admitted by GPUAdmissionMiddleware: check that the route is tagged "
            "with @gpu_bound (or named in routes={...}) and that the middleware is added."
        )
    return await deferred.admit()


async def gpu_reservation(request: Request) -> Reservation:
    """The :class:`Reservation` held for this request (FastAPI: ``Depends(gpu_reservation)``);
    admits the request first when needed, as :func:`gpu_admission` does."""
    return (await gpu_admission(request)).reservation


def declares_admission(route: Any) -> bool:
    """Whether ``route`` (a FastAPI route) depends on :func:`gpu_admission` or :func:`gpu_reservation`,
    directly or through another dependency, and the app does not override them (a test's
    ``app.dependency_overrides``: then the request is admitted at its body read, as without them).
    The route's dependency tree is read once per route; the overrides at each request."""
    try:
        found = _declaring[route]
    except KeyError:
        found = _declaring[route] = _declares(getattr(route, "dependant", None), 0)
    except TypeError:  # None, or a route that cannot be weakly referenced: looked up each time
        found = _declares(getattr(route, "dependant", None), 0)
    if not found:
        return False
    overrides = getattr(getattr(route, "dependency_overrides_provider", None), "dependency_overrides", None)
    return not overrides or (gpu_admission not in overrides and gpu_reservation not in overrides)


def _declares(dependant: Any, depth: int) -> bool:
    if dependant is None or depth == _MAX_DEPTH:
        return False
    for dependency in getattr(dependant, "dependencies", ()):
        if getattr(dependency, "call", None) in (gpu_admission, gpu_reservation) or _declares(dependency, depth + 1):
            return True
    return False
