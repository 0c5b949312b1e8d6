"""Reach the admission from an endpoint: ``Depends(gpu_reservation)`` or ``request.state``.

Admission happens when the endpoint's body is first read: FastAPI reads it before it resolves
dependencies when the endpoint declares a body parameter; a Starlette endpoint reads it itself.
"""

from __future__ import annotations

from starlette.requests import HTTPConnection

from .._admission.gate import Admission
from .._ledger.contract import Reservation
from .responder import ADMISSION_STATE_KEY


def gpu_admission(request: HTTPConnection) -> Admission:
    """The :class:`Admission` of this request (FastAPI: ``Depends(gpu_admission)``)."""
    admission = request.scope.get("state", {}).get(ADMISSION_STATE_KEY)
    if admission is None:
        raise RuntimeError(
            "This request has not been admitted by GPUAdmissionMiddleware. Admission happens when the "
            "body is first read: read it before asking (`await request.body()`; in FastAPI declare a "
            "body parameter). Also check that the route is tagged with @gpu_bound and the middleware added."
        )
    return admission  # type: ignore[no-any-return]


def gpu_reservation(request: HTTPConnection) -> Reservation:
    """The :class:`Reservation` held for this request (FastAPI: ``Depends(gpu_reservation)``)."""
    return gpu_admission(request).reservation
