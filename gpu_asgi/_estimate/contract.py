"""The contract every estimator shares, and the middleware relies on.

The :class:`Estimator` protocol and :class:`ObservingEstimator` (one that learns from measured
peaks), the adapter for an estimator of the first documented shape (:func:`as_estimator`), the
count check every estimator makes first, and the budget they share.
Everything an estimator counts is the *variable* cost of a request. Weights and the CUDA context
are fixed per device and come off the budget once, in :func:`budget_bytes`; no estimator ever
counts them. It imports no estimator.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

DEFAULT_UTILIZATION = 0.90


@runtime_checkable
class Estimator(Protocol):
    """What the middleware asks of an estimator, per request."""

    def estimate(
        self, prompt_tokens: int, max_new_tokens: int, batch: int = 1, *, sampling: bool | None = None
    ) -> int:
        """Peak bytes one request of `batch` sequences adds on top of the fixed cost.

        `sampling` is what the request asked for: True (sampling), False (greedy decoding) or
        None (it did not say: the estimator's own default). An estimator that does not tell the
        two apart ignores it.
        """
        ...


@runtime_checkable
class ObservingEstimator(Estimator, Protocol):
    """An estimator that learns from what requests really used (``CalibratedEstimator``):
    ``Admission.report_peak_bytes`` hands it each measured peak."""

    def observe(
        self, prompt_tokens: int, max_new_tokens: int, batch: int, peak_bytes: int, *, sampling: bool | None = None
    ) -> object:
        """One request's measured peak, with the counts (and ``sampling``) it was estimated from.
        What it returns (``CalibratedEstimator``: the route's factor after it) is not read."""
        ...


def as_estimator(estimator: Any) -> Estimator:
    """``estimator`` ready for the middleware's call ``estimate(prompt, max_new, batch, sampling=...)``.

    An estimator written to the first documented signature, ``estimate(prompt_tokens,
    max_new_tokens, batch)``, keeps working: it is wrapped so that ``sampling=`` is not passed to
    it, nor to its ``observe(prompt_tokens, max_new_tokens, batch, peak_bytes)`` if it has one.
    Anything without an ``estimate()`` method is refused here, where it is declared.
    """
    try:
        parameters = inspect.signature(estimator.estimate).parameters.values()
    except (AttributeError, TypeError, ValueError):
        raise TypeError(f"{estimator!r} is not an Estimator: it needs an estimate() method") from None
    if any(p.name == "sampling" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return estimator  # type: ignore[no-any-return]
    # A wrapper of its own for one that learns: the wrapper's observe is then a method of its class,
    # which is what isinstance(..., ObservingEstimator) looks for (a forwarded attribute is not, on
    # every Python version).
    return ObservingWithoutSampling(estimator) if isinstance(estimator, ObservingEstimator) else WithoutSampling(estimator)


@dataclass(frozen=True, slots=True)
class WithoutSampling:
    """An estimator of the first documented shape, which takes no ``sampling=``: its estimate
    does not depend on it. Other attributes are the wrapped estimator's."""

    inner: Any

    def estimate(
        self, prompt_tokens: int, max_new_tokens: int, batch: int = 1, *, sampling: bool | None = None
    ) -> int:
        return int(self.inner.estimate(prompt_tokens, max_new_tokens, batch))

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)


@dataclass(frozen=True, slots=True)
class ObservingWithoutSampling(WithoutSampling):
    """:class:`WithoutSampling` around an estimator that also learns: its ``observe`` gets no
    ``sampling=`` either."""

    def observe(
        self, prompt_tokens: int, max_new_tokens: int, batch: int, peak_bytes: int, *, sampling: bool | None = None
    ) -> object:
        return self.inner.observe(prompt_tokens, max_new_tokens, batch, peak_bytes)


def check_counts(prompt_tokens: int, max_new_tokens: int, batch: int) -> None:
    """Refuse a negative token count or an empty batch (both estimators check this first)."""
    if prompt_tokens < 0 or max_new_tokens < 0:
        raise ValueError(f"token counts must be >= 0, got {prompt_tokens=} {max_new_tokens=}")
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")


def budget_bytes(
    total_bytes: int,
    *,
    utilization: float = DEFAULT_UTILIZATION,
    weights_bytes: int = 0,
    runtime_overhead_bytes: int = 0,
) -> int:
    """Bytes left for requests: `total * utilization - weights - runtime overhead`.

    The fixed costs come off the device once, here, and never per request.
    """
    if not 0 < utilization <= 1:
        raise ValueError(f"utilization must be in (0, 1], got {utilization}")
    budget = int(total_bytes * utilization) - weights_bytes - runtime_overhead_bytes
    if budget <= 0:
        raise ValueError(
            f"no budget left: {total_bytes} B x {utilization} - {weights_bytes} B weights"
            f" - {runtime_overhead_bytes} B runtime overhead = {budget} B"
        )
    return budget
