"""gpu_asgi: admit GPU-bound ASGI requests against a VRAM byte budget.

Everything public is importable from here; the modules behind it are private.
"""

from ._dependencies import gpu_admission, gpu_reservation
from ._errors import (
    AdmissionRejected,
    BodyError,
    BodyTimeout,
    BodyTooLarge,
    GPUAdmissionError,
    InvalidField,
    InvalidJSON,
    NeverFits,
    QueueFull,
    QueueTimeout,
    UnsupportedMediaType,
)
from ._estimate import (
    AnalyticEstimator,
    Estimator,
    LinearEstimator,
    budget_bytes,
    calibrate,
    cuda_peak_measurer,
    fit_linear,
)
from ._ledger import BudgetLedger, DeviceStatistics, Ledger, LedgerStatistics, Reservation
from ._middleware import Admission, GPUAdmissionMiddleware
from ._tagging import RouteSpec, gpu_bound
from ._tokens import HeuristicTokenCounter, HFTokenCounter, TokenCounter

__all__ = [
    "Admission",
    "AdmissionRejected",
    "AnalyticEstimator",
    "BodyError",
    "BudgetLedger",
    "BodyTimeout",
    "BodyTooLarge",
    "DeviceStatistics",
    "Estimator",
    "GPUAdmissionError",
    "GPUAdmissionMiddleware",
    "HFTokenCounter",
    "HeuristicTokenCounter",
    "InvalidField",
    "InvalidJSON",
    "Ledger",
    "LedgerStatistics",
    "LinearEstimator",
    "NeverFits",
    "QueueFull",
    "QueueTimeout",
    "Reservation",
    "RouteSpec",
    "TokenCounter",
    "UnsupportedMediaType",
    "budget_bytes",
    "calibrate",
    "cuda_peak_measurer",
    "fit_linear",
    "gpu_admission",
    "gpu_bound",
    "gpu_reservation",
]
