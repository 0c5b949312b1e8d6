"""gpu_asgi: admit GPU-bound ASGI requests against a VRAM byte budget.

Everything public is importable from here; the modules behind it are private.
"""

from ._admission import Admission
from ._analytic import AnalyticEstimator
from ._calibration import CalibratedEstimator, PeakCalibration
from ._dependencies import gpu_admission, gpu_reservation
from ._device_policy import DeviceGuard, ThermalPolicy
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
from ._estimate import (
    Estimator,
    LinearEstimator,
    budget_bytes,
    calibrate,
    cuda_peak_measurer,
    fit_linear,
)
from ._executor import DeviceExecutor
from ._health import health_report, health_router
from ._ledger import Ledger
from ._ledger_contract import MAX_PRIORITY, MIN_PRIORITY, BudgetLedger, DeviceStatistics, LedgerStatistics, Reservation
from ._ledger_url import ledger_from_url
from ._metrics import GPUMetrics
from ._middleware import GPUAdmissionMiddleware
from ._otel_config import configure_tracing
from ._probe import DeviceReading, NoDeviceProbe, NVMLProbe, Probe, TorchProbe, auto_probe
from ._sampler import DeviceSampler, DeviceSnapshot
from ._tagging import RouteSpec, gpu_bound
from ._telemetry import Phase, gpu_phase
from ._tenancy import DEFAULT_TENANT, TenantPolicy, TenantStatistics
from ._tenants import TenantKey, api_key_tenant
from ._tokens import HeuristicTokenCounter, HFTokenCounter, TokenCounter

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
]
