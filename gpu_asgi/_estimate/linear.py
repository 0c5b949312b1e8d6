"""The linear estimator, ``batch × (fixed + per token × tokens)``, and its fit to measured peaks.

:class:`LinearEstimator`, :func:`fit_linear` (least squares that covers every sample),
:func:`calibrate` (one measured request per prompt length, then the fit) and
:func:`cuda_peak_measurer` (what it measures on a CUDA device). The contract it implements is in
``contract``. torch is imported lazily so the middleware core runs with starlette alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from .contract import check_counts

DEFAULT_PROMPT_LENGTHS = (16, 128, 512, 2048)


@dataclass(frozen=True, slots=True)
class LinearEstimator:
    """`batch * (fixed_bytes + bytes_per_token * (prompt + max_new))`.

    `fixed_bytes` is per request (buffers that do not grow with length), not weights.
    """

    bytes_per_token: int
    fixed_bytes: int = 0

    def __post_init__(self) -> None:
        if self.bytes_per_token < 0 or self.fixed_bytes < 0:
            raise ValueError(f"coefficients must be >= 0, got {self!r}")

    def estimate(
        self, prompt_tokens: int, max_new_tokens: int, batch: int = 1, *, sampling: bool | None = None
    ) -> int:
        check_counts(prompt_tokens, max_new_tokens, batch)  # `sampling` does not change a linear fit
        return batch * (self.fixed_bytes + self.bytes_per_token * (prompt_tokens + max_new_tokens))


def fit_linear(samples: Iterable[tuple[int, int]], *, margin: float = 0.0) -> LinearEstimator:
    """Fit `(total_tokens, measured_peak_bytes)` pairs of single requests.

    Least squares gives the slope; `fixed_bytes` is then raised until every sample is
    covered, and both coefficients grow by `margin`. Exact rational arithmetic, so a
    clean line is recovered to the byte.
    """
    if margin < 0:
        raise ValueError(f"margin must be >= 0, got {margin}")
    points = [(Fraction(x), Fraction(y)) for x, y in samples]
    if len({x for x, _ in points}) < 2:
        raise ValueError("fit_linear needs samples at two or more distinct token counts")
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    cov = sum((x - mean_x) * (y - mean_y) for x, y in points)
    var = sum((x - mean_x) ** 2 for x, _ in points)
    # Memory never shrinks with length; a negative slope is noise, not physics.
    per_token = max(Fraction(0), cov / var)
    fixed = max(Fraction(0), max(y - per_token * x for x, y in points))
    scale = 1 + Fraction(str(margin))  # str: 0.05 means 1/20, not its binary float
    return LinearEstimator(bytes_per_token=math.ceil(per_token * scale), fixed_bytes=math.ceil(fixed * scale))


def calibrate(
    measure: Callable[[int, int], int],
    *,
    prompt_lengths: Sequence[int] = DEFAULT_PROMPT_LENGTHS,
    max_new_tokens: int = 32,
    margin: float = 0.05,
) -> LinearEstimator:
    """Measure one request per prompt length and fit a `LinearEstimator` to the peaks."""
    samples = [(p + max_new_tokens, measure(p, max_new_tokens)) for p in prompt_lengths]
    return fit_linear(samples, margin=margin)


def cuda_peak_measurer(model: Any, *, device: Any = None) -> Callable[[int, int], int]:
    """A `measure` for `calibrate`: peak CUDA bytes of one `model.generate` call.

    Random prompt ids of the asked length, exactly `max_new_tokens` new tokens (EOS is
    suppressed), under `torch.inference_mode()`; returns `max_memory_allocated` minus
    what was allocated before, so weights are excluded. Run it before serving: other
    work on the device would count. Allocator fragmentation (reserved, not allocated)
    is not seen: keep a margin. Untested on CPU-only CI.
    """
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("CUDA is not available")
    dev = torch.device(device) if device is not None else next(model.parameters()).device
    if dev.type != "cuda":
        raise ValueError(f"model must be on a CUDA device, got {dev}")
    generator = torch.Generator().manual_seed(0)  # same prompts on every run

    def measure(prompt_tokens: int, max_new_tokens: int) -> int:
        ids = torch.randint(0, model.config.vocab_size, (1, max(prompt_tokens, 1)), generator=generator)
        torch.cuda.synchronize(dev)
        before = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        with torch.inference_mode():
            ids = ids.to(dev)
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                           max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens)
        torch.cuda.synchronize(dev)
        return torch.cuda.max_memory_allocated(dev) - before

    return measure
