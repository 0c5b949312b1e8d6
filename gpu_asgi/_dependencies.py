"""Reach the admission from an endpoint: ``Depends(gpu_reservation)`` or ``request.state``."""

from __future__ import annotations

from starlette.requests import HTTPConnection

from ._ledger import Reservation
from ._middleware import ADMISSION_STATE_KEY, Admission


def gpu_admission(request: HTTPConnection) -> Admission:
    """The :class:`Admission` of this request (FastAPI: ``Depends(gpu_admission)``)."""
    admission = request.scope.get("state", {}).get(ADMISSION_STATE_KEY)
    if admission is None:
        raise RuntimeError(
            "This request was not admitted by GPUAdmissionMiddleware: tag the route with @gpu_bound "
            "and add the middleware with app.add_middleware(GPUAdmissionMiddleware, ...)."
        )
    return admission  # type: ignore[no-any-return]


def gpu_reservation(request: HTTPConnection) -> Reservation:
    """The :class:`Reservation` held for this request (FastAPI: ``Depends(gpu_reservation)``)."""
    return gpu_admission(request).reservation
