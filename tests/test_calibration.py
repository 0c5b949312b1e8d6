"""Learning from measured peaks: the correction rule, its metric and log, the report path, and a
simulated device whose true cost is 30% above or below the estimate."""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import random

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from gpu_asgi import (
    AnalyticEstimator,
    CalibratedEstimator,
    GPUAdmissionMiddleware,
    Ledger,
    LinearEstimator,
    PeakCalibration,
    budget_bytes,
    gpu_bound,
)
from gpu_asgi._estimate.contract import ObservingEstimator, as_estimator

from ._asgi import Words
from .test_estimate import QWEN2_1_5B

GIB = 1 << 30


def test_a_peak_above_the_estimate_raises_the_factor_at_once() -> None:
    calibration = PeakCalibration(min_samples=4)
    assert calibration.factor("gen") == 1.0
    assert calibration.observe("gen", 1_000, 1_300) == 1.3
    assert calibration.factor("gen") == 1.3 and calibration.factor("other") == 1.0  # per route
    assert calibration.observe("gen", 1_000, 1_200) == 1.3  # lower, but too few samples to come down
    assert calibration.observe("gen", 1_000, 2_000) == 2.0


def test_the_factor_comes_down_slowly_and_never_below_the_quantile() -> None:
    calibration = PeakCalibration(initial_factor=2.0, quantile=1.0, lower_rate=0.1, min_samples=3, window=10)
    factors = [calibration.observe("gen", 1_000, 700) for _ in range(100)]
    assert factors[:2] == [2.0, 2.0]  # min_samples not reached yet
    assert factors[2] == pytest.approx(2.0 - 0.1 * (2.0 - 0.7))  # a tenth of the way
    assert all(a > b for a, b in itertools.pairwise(factors[2:41]))  # strictly down, step by step
    assert min(factors) >= 0.7 and factors[-1] == pytest.approx(0.7, abs=1e-3)
    # The window's highest quantile is a floor: one larger ratio in the window holds the factor up.
    calibration.observe("gen", 1_000, 900)
    assert calibration.factor("gen") == 0.9
    assert all(calibration.observe("gen", 1_000, 700) >= 0.9 for _ in range(9))
    # ...until it has left the window (10 ratios): then the descent resumes.
    assert calibration.observe("gen", 1_000, 700) < 0.9


def test_quantile_ignores_rare_outliers_but_a_raise_still_covers_them() -> None:
    calibration = PeakCalibration(quantile=0.9, lower_rate=1.0, min_samples=10, window=10)
    for _ in range(9):
        calibration.observe("gen", 100, 50)
    # One 0.8 in ten ratios is above the 0.9 quantile (nearest rank: the 9th of 10), so lower_rate 1
    # takes the factor straight down to 0.5...
    assert calibration.observe("gen", 100, 80) == 0.5
    # ...and when such a peak comes again, it is above the factor: raised at once.
    assert calibration.observe("gen", 100, 80) == 0.8
    assert calibration.observe("gen", 100, 50) == 0.8  # two 0.8s in ten: now the 0.9 quantile


@given(st.lists(st.integers(1, 4_000), min_size=1, max_size=120), st.sampled_from([0.5, 0.9, 0.99, 1.0]),
       st.floats(0.01, 1.0))
def test_the_factor_covers_every_peak_above_it_and_never_sinks_below_the_quantile(
    peaks: list[int], quantile: float, lower_rate: float
) -> None:
    calibration = PeakCalibration(quantile=quantile, lower_rate=lower_rate, window=32, min_samples=8)
    window: list[float] = []
    factor = 1.0
    for peak in peaks:
        ratio = peak / 1_000
        window = [*window, ratio][-32:]
        before, factor = factor, calibration.observe("gen", 1_000, peak)
        if ratio > before:
            assert factor == ratio  # raised at once, exactly to what was used
        else:
            assert factor <= before  # otherwise it only comes down...
            if len(window) >= 8:  # ...and never below the window's quantile (nearest rank)
                assert factor >= sorted(window)[max(0, math.ceil(quantile * len(window)) - 1)]


def test_bad_arguments_are_refused() -> None:
    for options in ({"initial_factor": 0}, {"quantile": 0}, {"quantile": 1.5}, {"lower_rate": 0},
                    {"window": 0}, {"min_samples": 0}, {"window": 5, "min_samples": 6}):
        with pytest.raises(ValueError):
            PeakCalibration(**options)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        PeakCalibration().observe("gen", 0, 10)


def test_changes_are_logged_and_exported_as_a_gauge(caplog: pytest.LogCaptureFixture) -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    calibration = PeakCalibration(registry=registry, quantile=0.5, min_samples=1, lower_rate=0.001)
    with caplog.at_level(logging.INFO, logger="gpu_asgi.calibration"):
        calibration.observe("gen", 100, 150)
        calibration.observe("gen", 100, 100)  # 1.5 -> 1.4995: too small a step to log
        calibration.observe("chat", 100, 120)
    assert registry.get_sample_value("gpu_asgi_estimate_correction", {"route": "gen"}) == pytest.approx(1.4995)
    assert registry.get_sample_value("gpu_asgi_estimate_correction", {"route": "chat"}) == 1.2
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == 2
    assert "'gen': 1.000 -> 1.500" in messages[0] and "'chat': 1.000 -> 1.200" in messages[1]
    assert calibration.factors() == {"gen": pytest.approx(1.4995), "chat": 1.2}


def test_calibrated_estimator_scales_the_inner_estimate_and_learns_against_it() -> None:
    inner = LinearEstimator(bytes_per_token=10, fixed_bytes=5)
    calibrated = CalibratedEstimator(inner, PeakCalibration(quantile=0.5, min_samples=1), route="gen")
    assert calibrated.estimate(10, 0) == 105
    # The peak is compared with the inner estimate, whatever factor was applied when it ran.
    assert calibrated.observe(10, 0, 1, 210) == 2.0
    assert calibrated.estimate(10, 0, 2) == 420
    assert calibrated.observe(10, 0, 2, 210) == pytest.approx(2.0 - 0.05 * (2.0 - 1.0))  # 210 / 210: down a step


async def test_the_endpoints_report_reaches_the_routes_calibration() -> None:
    calibration = PeakCalibration(min_samples=1)
    estimator = CalibratedEstimator(LinearEstimator(bytes_per_token=1_000), calibration, route="generate")
    seen: list[int] = []

    @gpu_bound(estimator=estimator)
    async def generate(request: Request) -> JSONResponse:
        await request.body()  # admission happens at the body read
        admission = request.state.gpu_admission
        seen.append(admission.estimated_bytes)
        admission.report_peak_bytes(15_000)  # the model really used 1.5x the inner estimate (10 tokens)
        return JSONResponse({"ok": True})

    app = Starlette(routes=[Route("/generate", generate, methods=["POST"])])
    app.add_middleware(GPUAdmissionMiddleware, ledger=Ledger(10**9), estimator=LinearEstimator(bytes_per_token=1),
                       token_counter=Words())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
        for _ in range(2):
            response = await http.post("/generate", json={"prompt": "a b c", "max_new_tokens": 7})
            assert response.status_code == 200
    assert seen == [10_000, 15_000]  # the second request was estimated with the learnt factor
    assert calibration.factor("generate") == 1.5


def test_an_estimator_that_learns_is_told_apart_by_its_protocol() -> None:
    calibrated = CalibratedEstimator(LinearEstimator(bytes_per_token=1), PeakCalibration())
    assert isinstance(calibrated, ObservingEstimator) and isinstance(as_estimator(calibrated), ObservingEstimator)
    assert not isinstance(LinearEstimator(bytes_per_token=1), ObservingEstimator)
    assert not isinstance(AnalyticEstimator.from_config(QWEN2_1_5B), ObservingEstimator)


async def test_a_report_reaches_an_estimator_of_the_first_documented_shape_without_sampling() -> None:
    """``estimate(prompt, max_new, batch)`` and ``observe(prompt, max_new, batch, peak)``, neither
    taking ``sampling=``: the wrapper made where it is declared still learns, and passes none."""
    observed: list[tuple[int, int, int, int]] = []

    class FirstShape:
        def estimate(self, prompt_tokens: int, max_new_tokens: int, batch: int = 1) -> int:
            return 1_000 * (prompt_tokens + max_new_tokens)

        def observe(self, prompt_tokens: int, max_new_tokens: int, batch: int, peak_bytes: int) -> None:
            observed.append((prompt_tokens, max_new_tokens, batch, peak_bytes))

    assert isinstance(as_estimator(FirstShape()), ObservingEstimator)
    assert not isinstance(as_estimator(LinearEstimator(bytes_per_token=1)), ObservingEstimator)

    @gpu_bound()
    async def generate(request: Request) -> JSONResponse:
        await request.body()
        request.state.gpu_admission.report_peak_bytes(9_000)
        return JSONResponse({"ok": True})

    app = Starlette(routes=[Route("/generate", generate, methods=["POST"])])
    app.add_middleware(GPUAdmissionMiddleware, ledger=Ledger(10**9), estimator=FirstShape(), token_counter=Words())  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
        response = await http.post("/generate", json={"prompt": "a b c", "max_new_tokens": 7, "temperature": 0.5})
    assert response.status_code == 200 and observed == [(3, 7, 1, 9_000)]


# -- a simulated device ---------------------------------------------------------------------


def simulate(
    true_ratio: float, requests: int = 200, seed: int = 3, initial_factor: float = 1.5
) -> tuple[int, int, float]:
    """Admit identical requests through a real Ledger with a calibrated analytic estimate.

    Each request really uses ``true_ratio`` x the analytic estimate (+-2% noise) and reports
    it when it ends. The device: 24 GiB less 3 GiB of weights; the budget is 90% of the 24 GiB
    less the weights. At every admission the true bytes of all running requests are checked
    against the device.
    Returns (concurrency admitted after ``requests`` requests, concurrency the true cost
    allows, the learnt factor).
    """
    rng = random.Random(seed)
    base = AnalyticEstimator.from_config(QWEN2_1_5B)
    # Before the first measurement only the initial factor stands between an estimate that is
    # 30% low and an over-committed device: start above the worst error expected.
    calibration = PeakCalibration(initial_factor=initial_factor)
    estimator = CalibratedEstimator(base, calibration, route="generate")
    device = 24 * GIB
    budget = budget_bytes(device, utilization=0.9, weights_bytes=3 * GIB)
    ledger = Ledger(budget)
    prompt, new = 2_048, 512
    true_bytes = round(true_ratio * base.estimate(prompt, new))
    running: list[tuple[float, int, int, object]] = []  # (end time, id, true bytes, reservation)
    now, started, done = 0.0, 0, 0
    while done < requests:
        while (reservation := ledger.try_reserve(estimator.estimate(prompt, new))) is not None:
            used = round(true_bytes * rng.uniform(0.98, 1.02))
            heapq.heappush(running, (now + rng.uniform(1.0, 3.0), started, used, reservation))
            started += 1
            in_use = sum(item[2] for item in running)
            assert in_use <= device - 3 * GIB, f"out of memory: {in_use} B in use after {done} requests"
        now, _, used, reservation = heapq.heappop(running)
        reservation.release()  # type: ignore[attr-defined]
        estimator.observe(prompt, new, 1, used)
        done += 1
    return budget // estimator.estimate(prompt, new), budget // true_bytes, calibration.factor("generate")


@pytest.mark.parametrize("true_ratio", [1.3, 0.7])
def test_after_200_requests_the_admitted_concurrency_fits_the_true_cost(true_ratio: float) -> None:
    admitted, allowed, factor = simulate(true_ratio)
    assert allowed >= 20  # a meaningful concurrency to compare
    assert abs(admitted - allowed) <= 0.1 * allowed, (admitted, allowed, factor)
    assert factor >= true_ratio * 0.98  # never below what was really used, bar the noise


def test_the_device_check_is_real_an_estimate_trusted_at_first_over_commits() -> None:
    """Starting at 1.0 with an estimate 30% low, the first wave already exceeds the device."""
    with pytest.raises(AssertionError, match=r"out of memory: .* after 0 requests"):
        simulate(1.3, initial_factor=1.0)
