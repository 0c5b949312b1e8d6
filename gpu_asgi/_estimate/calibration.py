"""Learning from measured peaks: a per-route correction of an estimator (opt-in).

``PeakCalibration`` keeps one factor per route, from the ratios measured peak / estimate:
raised at once to a ratio above it, lowered slowly toward a high quantile of the recent
ratios and never below that quantile. ``CalibratedEstimator`` multiplies an inner estimator by
its route's factor; the middleware hands every ``Admission.report_peak_bytes`` back to it.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

from .contract import Estimator, as_estimator

logger = logging.getLogger("gpu_asgi.calibration")

DEFAULT_QUANTILE = 0.99
DEFAULT_WINDOW = 256
DEFAULT_LOWER_RATE = 0.05
DEFAULT_MIN_SAMPLES = 16
#: A change of the factor by this fraction since the last log line is logged.
LOG_STEP = 0.01


@dataclass(slots=True)
class _Route:
    factor: float
    ratios: deque[float]
    #: The factor last written to the log.
    logged: float
    observed: int = 0


class PeakCalibration:
    """Per-route correction factors learnt from measured peak / estimate ratios.

    - ``initial_factor``: the factor of a route before anything was measured. 1.0 trusts the
      estimator; start above the worst error you fear (e.g. 1.5 on a GPU you never measured)
      so the first requests cannot over-commit the device, and let the peaks bring it down.
    - A ratio above the factor raises it to that ratio at once.
    - Otherwise, once ``min_samples`` ratios are in, the factor moves ``lower_rate`` of the way
      toward the ``quantile`` of the last ``window`` ratios, and never below that quantile.
    - ``registry``: a prometheus-client registry (e.g. ``GPUMetrics(...).registry``) for the gauge
      ``<namespace>_estimate_correction{route}``; None exports nothing.

    Thread-safe: peaks may be reported from a device thread.
    """

    def __init__(
        self,
        *,
        initial_factor: float = 1.0,
        quantile: float = DEFAULT_QUANTILE,
        window: int = DEFAULT_WINDOW,
        lower_rate: float = DEFAULT_LOWER_RATE,
        min_samples: int = DEFAULT_MIN_SAMPLES,
        registry: Any = None,
        namespace: str = "gpu_asgi",
    ) -> None:
        if initial_factor <= 0:
            raise ValueError(f"initial_factor must be > 0, got {initial_factor}")
        if not 0 < quantile <= 1:
            raise ValueError(f"quantile must be in (0, 1], got {quantile}")
        if not 0 < lower_rate <= 1:
            raise ValueError(f"lower_rate must be in (0, 1], got {lower_rate}")
        if window < 1 or not 1 <= min_samples <= window:
            raise ValueError("need window >= 1 and 1 <= min_samples <= window")
        self.initial_factor = initial_factor
        self.quantile = quantile
        self.window = window
        self.lower_rate = lower_rate
        self.min_samples = min_samples
        self._routes: dict[str, _Route] = {}
        self._lock = threading.Lock()
        self._gauge: Any = None
        if registry is not None:
            from prometheus_client import Gauge  # a registry was given: prometheus-client is installed

            self._gauge = Gauge(
                "estimate_correction", "Factor applied to the route's estimate, learnt from measured peaks.",
                ["route"], namespace=namespace, registry=registry, multiprocess_mode="livemax",
            )

    def __repr__(self) -> str:
        return (f"PeakCalibration(initial_factor={self.initial_factor}, quantile={self.quantile}, "
                f"window={self.window}, lower_rate={self.lower_rate}, min_samples={self.min_samples})")

    def factor(self, route: str) -> float:
        """The route's current correction (``initial_factor`` until something was observed)."""
        state = self._routes.get(route)
        return self.initial_factor if state is None else state.factor

    def factors(self) -> dict[str, float]:
        """Every route's current factor: a snapshot."""
        with self._lock:
            return {route: state.factor for route, state in self._routes.items()}

    def observe(self, route: str, estimated_bytes: int, peak_bytes: int) -> float:
        """Record one request's measured peak against its *uncorrected* estimate; return the factor."""
        if estimated_bytes <= 0 or peak_bytes < 0:
            raise ValueError(f"need estimated_bytes > 0 and peak_bytes >= 0, got {estimated_bytes}, {peak_bytes}")
        ratio = peak_bytes / estimated_bytes
        with self._lock:
            state = self._routes.get(route)
            if state is None:
                state = self._routes[route] = _Route(self.initial_factor, deque(maxlen=self.window), self.initial_factor)
            state.ratios.append(ratio)
            state.observed += 1
            before = state.factor
            if ratio > state.factor:
                state.factor = ratio  # an estimate was low: never wait to correct that
            elif len(state.ratios) >= self.min_samples:
                floor = _quantile(state.ratios, self.quantile)
                if floor < state.factor:
                    state.factor = max(floor, state.factor - self.lower_rate * (state.factor - floor))
            factor = state.factor
            if factor != before:
                self._changed(route, state, before, ratio)
        return factor

    def _changed(self, route: str, state: _Route, before: float, ratio: float) -> None:
        if self._gauge is not None:
            self._gauge.labels(route).set(state.factor)
        # Every raise is logged; the slow descent only once per LOG_STEP, or it would log each request.
        if state.factor > before or abs(state.factor - state.logged) >= LOG_STEP * state.logged:
            state.logged = state.factor
            logger.info(
                "estimate correction for route %r: %.3f -> %.3f (peak/estimate %.3f, %d measured)",
                route, before, state.factor, ratio, state.observed,
            )


def _quantile(values: deque[float], q: float) -> float:
    """The ``q`` quantile by the nearest-rank rule: a value that was really observed."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


class CalibratedEstimator:
    """``inner``'s estimate times the route's learnt factor (rounded up).

    ``@gpu_bound(estimator=CalibratedEstimator(base, calibration, route="generate"))``. The
    middleware passes ``Admission.report_peak_bytes(peak)`` on to :meth:`observe`, which
    compares the peak with ``inner``'s own estimate for the same request.
    """

    def __init__(self, inner: Estimator, calibration: PeakCalibration, route: str = "default") -> None:
        self.inner = as_estimator(inner)
        self.calibration = calibration
        self.route = route

    def __repr__(self) -> str:
        return f"CalibratedEstimator({self.inner!r}, route={self.route!r}, factor={self.factor:.3f})"

    @property
    def factor(self) -> float:
        return self.calibration.factor(self.route)

    def estimate(
        self, prompt_tokens: int, max_new_tokens: int, batch: int = 1, *, sampling: bool | None = None
    ) -> int:
        return math.ceil(self.inner.estimate(prompt_tokens, max_new_tokens, batch, sampling=sampling) * self.factor)

    def observe(
        self, prompt_tokens: int, max_new_tokens: int, batch: int, peak_bytes: int, *, sampling: bool | None = None
    ) -> float:
        """One request's measured peak; returns the route's factor after it."""
        estimated = self.inner.estimate(prompt_tokens, max_new_tokens, batch, sampling=sampling)
        return self.calibration.observe(self.route, estimated, peak_bytes)
