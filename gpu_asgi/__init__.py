"""gpu_asgi: admit GPU-bound ASGI requests against a VRAM byte budget.

Everything public is importable from here; the modules behind it are private. ``RedisLedger``
is imported on first use, so ``import gpu_asgi`` does not import ``redis``.
"""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Any

from . import _errors
from ._admission.gate import Admission
from ._admission.spec import RouteSpec
from ._admission.tenant_keys import TenantKey, api_key_tenant
from ._asgi.dependencies import gpu_admission, gpu_reservation
from ._asgi.middleware import GPUAdmissionMiddleware
from ._asgi.routes import gpu_bound
from ._device.executor import DeviceExecutor, StopOnCancel, stop_requested
from ._device.policy import DeviceGuard, ThermalPolicy
from ._device.probe import DeviceReading, NoDeviceProbe, NVMLProbe, Probe, TorchProbe, auto_probe
from ._device.sampler import DeviceSampler, DeviceSnapshot
from ._errors import (
    AdmissionRejected,
    GPUAdmissionError,
    LedgerUnavailable,
    NeverFits,
    QueueFull,
    QueueTimeout,
    ShuttingDown,
)
from ._estimate.analytic import AnalyticEstimator
from ._estimate.calibration import CalibratedEstimator, PeakCalibration
from ._estimate.contract import Estimator, budget_bytes
from ._estimate.lengths import LengthStatistics, OutputLengths
from ._estimate.linear import LinearEstimator, calibrate, cuda_peak_measurer, fit_linear
from ._estimate.paged import PagedKVEstimator, paged_kv_budget
from ._estimate.tokens import HeuristicTokenCounter, HFTokenCounter, TokenCounter
from ._ledger.contract import MAX_PRIORITY, MIN_PRIORITY, BudgetLedger, DeviceStatistics, LedgerStatistics, Reservation
from ._ledger.memory import Ledger
from ._ledger.tenants import DEFAULT_TENANT, TenantPolicy, TenantStatistics
from ._ledger.url import ledger_from_url
from ._lifecycle import Lifecycle
from ._observe.health import health_report, health_router
from ._observe.metrics import GPUMetrics
from ._observe.tracing import Phase, gpu_phase
from ._observe.tracing_setup import configure_tracing

if TYPE_CHECKING:
    from ._ledger.redis.ledger import RedisLedger

__all__ = [  # noqa: RUF022 - grouped by what a user does, not sorted
    # the middleware and what an endpoint sees
    "Admission",
    "GPUAdmissionMiddleware",
    "RouteSpec",
    "gpu_admission",
    "gpu_bound",
    "gpu_reservation",
    # estimating a request's bytes
    "AnalyticEstimator",
    "CalibratedEstimator",
    "Estimator",
    "LinearEstimator",
    "OutputLengths",
    "PagedKVEstimator",
    "PeakCalibration",
    "budget_bytes",
    "paged_kv_budget",
    "HFTokenCounter",
    "HeuristicTokenCounter",
    "TokenCounter",
    # the budget ledgers and tenants
    "BudgetLedger",
    "Ledger",
    "LedgerStatistics",
    "RedisLedger",
    "Reservation",
    "TenantKey",
    "TenantPolicy",
    "api_key_tenant",
    "ledger_from_url",
    # the device
    "DeviceExecutor",
    "DeviceGuard",
    "DeviceSampler",
    "Probe",
    "StopOnCancel",
    "ThermalPolicy",
    "auto_probe",
    "stop_requested",
    # observability, readiness and drain
    "GPUMetrics",
    "Lifecycle",
    "configure_tracing",
    "gpu_phase",
    "health_router",
    # errors a caller of a ledger or of the middleware's API can receive
    "AdmissionRejected",
    "GPUAdmissionError",
    "LedgerUnavailable",
    "NeverFits",
    "QueueFull",
    "QueueTimeout",
]

#: Public, importable from here, and documented, but not in ``__all__``: the types of values the
#: API returns that a user rarely names, the concrete probes ``auto_probe`` picks, the helpers of
#: the calibration workflow and of a hand-made health endpoint, and constants.
_ALSO_PUBLIC: tuple[Any, ...] = (
    calibrate, cuda_peak_measurer, fit_linear, health_report,
    DeviceReading, DeviceSnapshot, DeviceStatistics, LengthStatistics, NVMLProbe, NoDeviceProbe, Phase, ShuttingDown, TenantStatistics,
    TorchProbe,
)
_CONSTANTS = (DEFAULT_TENANT, MAX_PRIORITY, MIN_PRIORITY)

#: Errors the middleware answers as problem+json (clients match on ``reason``); a direct caller of a
#: ledger can also get two of them (``OverTenantQuota``, ``DeadlineUnmeetable``) and catches them
#: as ``AdmissionRejected``. Importable from here for one more release, with a DeprecationWarning.
_DEPRECATED_ERRORS = frozenset({
    "BodyError", "BodyTimeout", "BodyTooLarge", "ClientClosedRequest", "DeadlineUnmeetable", "DeviceMemoryLow",
    "DeviceProbeFailed", "InvalidField", "InvalidHeader", "InvalidJSON", "InvalidTenant", "OverTenantQuota",
    "UnsupportedMediaType",
})

_LAZY = {"RedisLedger": "._ledger.redis.ledger"}  # the redis extra: imported on first use


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        value.__module__ = __name__
        globals()[name] = value
        return value
    if name in _DEPRECATED_ERRORS:
        warnings.warn(
            f"gpu_asgi.{name} is deprecated and leaves gpu_asgi in the next release: catch GPUAdmissionError "
            "(AdmissionRejected for a ledger's refusals) and read .reason instead",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(_errors, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


# Reprs, tracebacks and docs show the public name wherever a class or function lives (as httpx does).
for _name in (*__all__, *(value.__name__ for value in _ALSO_PUBLIC)):
    if _name not in _LAZY:
        _value = globals()[_name]
        if getattr(_value, "__module__", "").startswith(__name__ + "._"):
            _value.__module__ = __name__
del _name, _value
