"""Reservations that follow vLLM's answers as they are generated, not only when they end.

A learned reservation covers ``prompt +`` the predicted length from the start, though an answer
takes its blocks one at a time and most end before their second. vLLM's API server process
tracks every request's tokens as the engine returns them (``output_processor.request_states``),
streamed or not. So, every ``interval``, each admitted request that vLLM runs is held at the
blocks it holds now (plus what it may add before the next reading), and one reservation of this
process (tenant ``FORECAST_TENANT``) holds the rest of what the running set is forecast to need
(``forecast.peak_blocks``). With all of the growth, that is the most blocks the requests still
running at any later step will have taken beyond those they hold, each running to its predicted
length, and a request's held blocks are never counted for another's growth: when it ends, the
middleware gives them back to the ledger, which admits the next request on them. With pooled
growth (``GPU_ASGI_GROWTH``), each runs on to its declared limit by chance and may lend its
blocks to the growth of those that outlive it; so its reservation hands its bytes over to the
forecast's when it ends (``Reservation.hand_over``), and the next reading gives back what the set
no longer needs. The ledger admits the next request when its own peak fits on top.

vLLM names a request by the ``X-Request-Id`` header (``cmpl-<id>-<prompt>``, ``chatcmpl-<id>``);
one is added where the client sent none. A request vLLM has not started yet, one this process
cannot find (a ``/v1/responses`` request, several prompts in one request, two requests with one
id), keeps the reservation admission gave it. One that vLLM has finished holds nothing.
"""

from __future__ import annotations

import contextlib
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._asgi.dependencies import ADMISSION_STATE_KEY
from .._estimate.paged import blocks_for
from .._ledger.contract import BudgetLedger, Reservation
from .._types import Scope
from .forecast import Running, peak_blocks
from .held import HeldOnATimer, resize_all
from .log import vllm_logger

if TYPE_CHECKING:
    from .._observe.metrics import GPUMetrics

__all__ = ["FORECAST_TENANT", "Following"]

#: The tenant the forecast's headroom is held for (shown beside the clients' in ``/health``).
FORECAST_TENANT = "gpu_asgi.forecast"
#: Seconds between two readings of vLLM's progress.
DEFAULT_INTERVAL = 0.05
_HEADER = b"x-request-id"


@dataclass(slots=True, eq=False)
class Followed:
    """One request sent on to vLLM under ``request_id``; its admission appears in ``state``."""

    request_id: str
    state: dict[str, Any]
    #: vLLM has reported tokens for it at least once.
    seen: bool = False
    tokens: int = 0
    at: float = 0.0
    #: Bytes its admission reserved (its own peak), when first seen.
    admitted: int = 0
    #: Bytes its forecast has run past ``admitted`` so far (counted in the growth metric once).
    past: int = 0


def vllm_key(external_id: str) -> tuple[str, int]:
    """The request id a vLLM request was named from, and its prompt's index (completions)."""
    if external_id.startswith("chatcmpl-"):
        return external_id[9:], 0
    if external_id.startswith("cmpl-"):
        base, _, index = external_id[5:].rpartition("-")
        if base and index.isdigit():
            return base, int(index)
    return external_id, 0


class Following(HeldOnATimer):
    """Keeps followed requests' reservations at what they hold, and its own at the forecast's headroom."""

    tenant = FORECAST_TENANT
    task_name = "gpu_asgi-vllm-following"

    def __init__(
        self,
        ledger: BudgetLedger,
        engine: Any,
        *,
        block_size: int,
        bytes_per_block: int,
        interval: float = DEFAULT_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
        metrics: GPUMetrics | None = None,
        growth_quantile: float | None = None,
    ) -> None:
        super().__init__(ledger, interval)
        #: ``GPU_ASGI_GROWTH``: below 1, the growth held is this quantile of the running set's,
        #: each answer going on as its route's answers went on (``forecast``); None: all of it.
        self.growth_quantile = growth_quantile
        self.engine = engine
        self.metrics = metrics
        self.block_size = block_size
        self.bytes_per_block = bytes_per_block
        self.clock = clock
        #: Requests followed so far (found in vLLM's progress).
        self.following = 0
        self._followed: dict[str, list[Followed]] = {}
        #: Tokens per second of the fastest request lately: what one may add between readings.
        self._rate = 0.0

    @property
    def forecast(self) -> Reservation | None:
        """The reservation that holds the forecast's headroom (None until the first round)."""
        return self.held

    @staticmethod
    def available(engine: Any) -> bool:
        """Whether ``engine`` (vLLM's ``app.state.engine_client``) shows its requests' progress."""
        states = getattr(getattr(engine, "output_processor", None), "request_states", None)
        return isinstance(states, dict)

    # -- requests in and out ---------------------------------------------------------------

    def enter(self, scope: Scope) -> tuple[Scope, Followed]:
        """The scope to send on (with an ``X-Request-Id`` if it had none) and its follower."""
        request_id = next((v.decode("latin-1") for k, v in scope["headers"] if k.lower() == _HEADER), None)
        if request_id is None:
            request_id = f"gpuasgi-{uuid.uuid4().hex}"
            scope = dict(scope)
            scope["headers"] = [*scope["headers"], (_HEADER, request_id.encode())]
        followed = Followed(request_id, scope.setdefault("state", {}))
        self._followed.setdefault(request_id, []).append(followed)
        return scope, followed

    def leave(self, followed: Followed) -> None:
        same = self._followed.get(followed.request_id, [])
        with contextlib.suppress(ValueError):
            same.remove(followed)
        if not same:
            self._followed.pop(followed.request_id, None)

    # -- the readings -------------------------------------------------------------------------

    def progress(self) -> dict[str, tuple[int, int]]:
        """Request id -> (tokens generated, per sequence, at most; vLLM's states for it), for the
        ids of one prompt (index 0): several prompts in one request are not followed."""
        found: dict[str, tuple[int, int]] = {}
        several: set[str] = set()
        for state in list(self.engine.output_processor.request_states.values()):
            key, index = vllm_key(str(getattr(state, "external_req_id", None) or state.request_id))
            if index:
                several.add(key)
                continue
            tokens = state.detokenizer.num_output_tokens()
            most, count = found.get(key, (0, 0))
            found[key] = (max(most, tokens), count + 1)
        for key in several:
            found.pop(key, None)
        return found

    def resize(self) -> None:
        """One reading: every followed request's reservation and the forecast's, resized."""
        forecast = self.held
        if forecast is None or forecast.released:
            return
        now, progress, rate = self.clock(), self.progress(), 0.0
        lag = math.ceil(self._rate * 3 * self.spacing) + 1
        running: list[Running] = []
        targets: list[tuple[Reservation, int]] = []
        for request_id, same in list(self._followed.items()):
            if len(same) != 1:
                continue  # two requests with one id: neither can be told apart
            followed = same[0]
            admission = followed.state.get(ADMISSION_STATE_KEY)
            if admission is None or admission.reservation.released:
                continue
            reading = progress.get(request_id)
            if reading is None:
                if followed.seen:  # vLLM has finished it: its blocks are free
                    targets.append((admission.reservation, 0))
                continue  # not started yet: it keeps what admission gave it
            tokens, states = reading
            if not followed.seen:
                if states != admission.batch:
                    continue  # not every sequence is there yet
                followed.seen, followed.admitted = True, admission.reservation.nbytes
                admission.endpoint_grows()  # sized here from now on, not by its stream's meter
                if self.growth_quantile is not None:  # pooled: the set may count on its blocks once it ends
                    admission.reservation.hand_over(forecast)
                if not self.following:
                    vllm_logger().info("gpu_asgi follows vLLM's answers as they are generated (first: %s)", request_id)
                self.following += 1
            elif now > followed.at:
                rate = max(rate, (tokens - followed.tokens) / (now - followed.at))
            followed.tokens, followed.at = tokens, now
            request, end = self._forecast(admission, tokens, lag)
            running.append(request)
            self._record_past(followed, request, end)
            targets.append((admission.reservation, blocks_for(request.held, self.block_size) * request.sequences))
        self._rate = max(rate, self._rate * 0.9)
        held, peak = peak_blocks(running, self.block_size, self.growth_quantile)
        targets = [(reservation, n * self.bytes_per_block) for reservation, n in targets]
        targets.append((forecast, (peak - held) * self.bytes_per_block))
        resize_all(targets)

    def _record_past(self, followed: Followed, request: Running, end: int) -> None:
        """Counts in ``gpu_asgi_reservation_grown_bytes`` what an answer past its prediction is now
        forecast (to ``end`` tokens) beyond the peak it was admitted on, as the stream meter
        counts its growth."""
        own = blocks_for(end, self.block_size) * request.sequences * self.bytes_per_block
        past = own - followed.admitted
        if past > followed.past:
            if self.metrics is not None:
                self.metrics.record_growth(past - followed.past)
            followed.past = past

    def _forecast(self, admission: Any, tokens: int, lag: int) -> tuple[Running, int]:
        """A running request as the forecast sees it, and the tokens (prompt included) it is now
        forecast to end at: its predicted length, or a step past where it is once it has run past
        it (as the answer's meter grows a stream). With pooled growth the forecast runs on to the
        request's declared limit, each later step counted with the chance its route's answers
        that got as far went on: an answer within its prediction may still run long, and the
        growth held is the quantile of what the running set may take until any of them could end,
        not only until their predictions (a horizon that short left a block of headroom for a few
        steps ahead only, and bursts preempted)."""
        prompt, limit = admission.prompt_tokens, admission.max_new_tokens
        predicted = admission.reserved_tokens if admission.reserved_tokens is not None else limit
        length = min(limit, max(predicted, tokens + lag + max(16, tokens // 4)))
        going_on = None
        horizon = length
        if self.growth_quantile is not None:
            horizon = limit

            chance: Callable[[int], float] = admission.survival_curve(tokens)

            def going_on(step: int) -> float:
                return chance(tokens + step)
        now = min(tokens + lag, horizon)
        running = Running(prompt + now, prompt + horizon, max(1, horizon - tokens), admission.batch, going_on)
        return running, prompt + length
