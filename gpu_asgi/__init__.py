"""gpu_asgi: admit GPU-bound ASGI requests against a VRAM byte budget.

Everything public is importable from here; the modules behind it are private.
"""

from ._admission.gate import Admission
from ._admission.tenant_keys import TenantKey, api_key_tenant
from ._asgi.dependencies import gpu_admission, gpu_reservation
from ._asgi.middleware import GPUAdmissionMiddleware
from ._asgi.routes import RouteSpec, gpu_bound
from ._device.executor import DeviceExecutor
from ._device.policy import DeviceGuard, ThermalPolicy
from ._device.probe import DeviceReading, NoDeviceProbe, NVMLProbe, Probe, TorchProbe, auto_probe
from ._device.sampler import DeviceSampler, DeviceSnapshot
from ._errors import (
    AdmissionRejected,
    BodyError,
    BodyTimeout,
    BodyTooLarge,
    ClientClosedRequest,
    DeadlineUnmeetable,
    DeviceMemoryLow,
    DeviceProbeFailed,
    GPUAdmissionError,
    InvalidField,
    InvalidHeader,
    InvalidJSON,
    InvalidTenant,
    LedgerUnavailable,
    NeverFits,
    OverTenantQuota,
    QueueFull,
    QueueTimeout,
    UnsupportedMediaType,
)
from ._estimate.analytic import AnalyticEstimator
from ._estimate.calibration import CalibratedEstimator, PeakCalibration
from ._estimate.linear import (
    Estimator,
    LinearEstimator,
    budget_bytes,
    calibrate,
    cuda_peak_measurer,
    fit_linear,
)
from ._estimate.paged import PagedKVEstimator, paged_kv_budget
from ._estimate.tokens import HeuristicTokenCounter, HFTokenCounter, TokenCounter
from ._ledger.contract import MAX_PRIORITY, MIN_PRIORITY, BudgetLedger, DeviceStatistics, LedgerStatistics, Reservation
from ._ledger.memory import Ledger
from ._ledger.tenants import DEFAULT_TENANT, TenantPolicy, TenantStatistics
from ._ledger.url import ledger_from_url
from ._observe.health import health_report, health_router
from ._observe.metrics import GPUMetrics
from ._observe.tracing import Phase, gpu_phase
from ._observe.tracing_setup import configure_tracing

__all__ = [
    "DEFAULT_TENANT",
    "MAX_PRIORITY",
    "MIN_PRIORITY",
    "Admission",
    "AdmissionRejected",
    "AnalyticEstimator",
    "BodyError",
    "BodyTimeout",
    "BodyTooLarge",
    "BudgetLedger",
    "CalibratedEstimator",
    "ClientClosedRequest",
    "DeadlineUnmeetable",
    "DeviceExecutor",
    "DeviceGuard",
    "DeviceMemoryLow",
    "DeviceProbeFailed",
    "DeviceReading",
    "DeviceSampler",
    "DeviceSnapshot",
    "DeviceStatistics",
    "Estimator",
    "GPUAdmissionError",
    "GPUAdmissionMiddleware",
    "GPUMetrics",
    "HFTokenCounter",
    "HeuristicTokenCounter",
    "InvalidField",
    "InvalidHeader",
    "InvalidJSON",
    "InvalidTenant",
    "Ledger",
    "LedgerStatistics",
    "LedgerUnavailable",
    "LinearEstimator",
    "NVMLProbe",
    "NeverFits",
    "NoDeviceProbe",
    "OverTenantQuota",
    "PagedKVEstimator",
    "PeakCalibration",
    "Phase",
    "Probe",
    "QueueFull",
    "QueueTimeout",
    "Reservation",
    "RouteSpec",
    "TenantKey",
    "TenantPolicy",
    "TenantStatistics",
    "ThermalPolicy",
    "TokenCounter",
    "TorchProbe",
    "UnsupportedMediaType",
    "api_key_tenant",
    "auto_probe",
    "budget_bytes",
    "calibrate",
    "configure_tracing",
    "cuda_peak_measurer",
    "fit_linear",
    "gpu_admission",
    "gpu_bound",
    "gpu_phase",
    "gpu_reservation",
    "health_report",
    "health_router",
    "ledger_from_url",
    "paged_kv_budget",
]
