"""Length buckets: what lets requests share a left-padded batch without spending more than they reserved.

A left-padded batch of ``rows`` sequences costs what ``rows`` copies of its *longest* prompt and
*largest* ``max_new_tokens`` cost: every row's KV cache is as long as the longest one, and rows that
finish early keep growing with padding until the whole batch ends. Each request reserved the bytes
of its *own* lengths, so a short request batched with a long one would use memory nobody reserved.

``BucketedEstimator`` rounds both lengths up to a bucket boundary before estimating, so every request
reserves as if it were as long as the longest request of its bucket. The batcher then puts requests
in one ``generate`` only when the padded batch's bytes are covered: by the requests' own
reservations (always enough within a bucket), topped up from the ledger when its bytes are free.

Boundaries are multiples of 16 up to 64 tokens and then quarter octaves (64, 80, 96, 112, 128, 160,
192, 224, 256, 320, ...): a request reserves at most about 25 % more than its own lengths need, and a
mixed workload still lands in few enough buckets to batch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from gpu_asgi import Estimator

MIN_STEP = 16


def bucket(tokens: int) -> int:
    """``tokens`` rounded up to the next bucket boundary (0 stays 0)."""
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0, got {tokens}")
    if tokens == 0:
        return 0
    # In [2^k, 2^(k+1)) the step is 2^(k-2): four boundaries per octave, never finer than MIN_STEP.
    step = max(MIN_STEP, 1 << max(0, tokens.bit_length() - 3))
    return -(-tokens // step) * step


@dataclass(frozen=True, slots=True)
class BucketedEstimator:
    """``base`` applied to bucketed lengths; give it to the middleware *and* the batcher."""

    base: Estimator

    def estimate(
        self, prompt_tokens: int, max_new_tokens: int, batch: int = 1, *, sampling: bool | None = None
    ) -> int:
        return self.base.estimate(bucket(prompt_tokens), bucket(max_new_tokens), batch, sampling=sampling)

    def batch_bytes(self, prompt_tokens: Iterable[int], max_new_tokens: Iterable[int]) -> int:
        """What one left-padded ``generate`` over these rows really needs (unbucketed lengths)."""
        prompts, news = list(prompt_tokens), list(max_new_tokens)
        return self.base.estimate(max(prompts), max(news), len(prompts))
