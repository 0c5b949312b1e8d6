"""What the endpoints share: the loaded model, the batcher, and the request lifecycle around them.

An endpoint turns its body into token ids, ``submit``s them with the admission the middleware made,
and either awaits :func:`complete` (a JSON answer) or streams with :class:`EventStream`. Both keep
the request's reservation as gpu_asgi expects: held while the device works for the request, shrunk
to zero once the batch has left the device, released by the middleware when the response ends.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from gpu_asgi import Admission, Ledger, Lifecycle

from ._batching.batcher import Batcher
from ._batching.device_run import Sampling
from ._batching.jobs import Generation, SequenceState
from ._model.load import LoadedModel
from ._model.prompts import encoder
from ._settings import DemoSettings
from ._startup import logger, step


@dataclass(slots=True)
class DemoService:
    """One per app: built by ``create_app``, shared by every endpoint."""

    settings: DemoSettings
    loaded: LoadedModel
    ledger: Ledger
    batcher: Batcher
    model_name: str
    created: int = field(default_factory=lambda: int(time.time()))
    encode: Callable[[str], list[int]] = field(init=False)

    def __post_init__(self) -> None:
        self.encode = encoder(self.loaded.tokenizer)

    @property
    def vocab_size(self) -> int:
        return int(self.loaded.model.config.vocab_size)

    def submit(
        self,
        admission: Admission,
        prompts: list[list[int]],
        *,
        n: int = 1,
        sampling: Sampling,
        stop: tuple[str, ...] = (),
        stream: bool = False,
    ) -> Generation:
        """Queue the request for a batch with exactly what gpu_asgi admitted (``max_new_tokens``, bytes,
        and with learned lengths the tokens those bytes cover: the batcher grows past them itself)."""
        admission.endpoint_grows()
        return self.batcher.submit(
            prompts,
            max_new_tokens=admission.max_new_tokens,
            n=n,
            sampling=sampling,
            stop=stop,
            reserved_bytes=admission.estimated_bytes,
            stream=stream,
            reserved_tokens=admission.reserved_tokens,
            reservation=admission.reservation,
        )


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


async def _abandon(generation: Generation, result: asyncio.Future[list[SequenceState]]) -> None:
    """Drop a generation whose client left: its sequences leave the batch at the next step, and
    this returns once the batch is off the device (its rows stay in the batch's KV cache until
    then), so the bytes go back only after that."""
    generation.cancel()
    result.cancel()
    await wait_for_device(generation)


async def complete(request: Request, admission: Admission, generation: Generation) -> list[SequenceState]:
    """The finished sequences; cancels the generation if the client disconnects first.

    Returns once the batch has left the device, then gives the request's bytes back early
    (``shrink(0)``): the answer is on the host and only has to be sent.
    """
    result = asyncio.ensure_future(generation.result())
    left = asyncio.ensure_future(_disconnect(request.receive))
    try:
        await asyncio.wait((result, left), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # gpu_asgi cancels the endpoint when its client leaves
        await _abandon(generation, result)
        raise
    finally:
        left.cancel()
    if not result.done():
        await _abandon(generation, result)
        raise ClientGone
    sequences = result.result()
    admission.reservation.shrink(0)
    return sequences


async def _disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStream(StreamingResponse):
    """Server-sent events for one generation; the generation is cancelled if the stream stops early.

    The event iterator sends ``data: [DONE]`` when the request's sequences end and then waits for its
    batch to leave the device before the response ends, so the middleware keeps the reservation
    exactly as long as the device holds the request's memory.
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], generation: Generation) -> None:
        super().__init__(events, headers={"cache-control": "no-cache", "x-accel-buffering": "no"})
        self._events = events
        self._generation = generation

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._generation.cancel()  # a no-op when it ran to the end
            aclose = getattr(self._events, "aclose", None)
            if aclose is not None:
                await aclose()
            # A client that left mid-stream: the response ends (and the middleware releases the
            # reservation) only once its batch has left the device.
            await wait_for_device(self._generation)


def sse(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


async def wait_for_device(generation: Generation) -> None:
    """Wait until the batch holding ``generation`` has left the device, through cancellations.

    Starlette cancels a stream when its client disconnects, and anyio re-delivers that
    cancellation on every loop iteration: each one is absorbed until the device is done, and
    re-raised after, so the request's bytes are never released while the batch still uses them.
    """
    cancelled = False
    while not generation.device_done.done():
        try:
            await asyncio.wait((generation.device_done,))
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError


async def hold_until_device_done(admission: Admission, generation: Generation) -> None:
    """After the last event: wait for the batch to leave the device, then give the bytes back."""
    await asyncio.wait((generation.device_done,))  # a failure was already sent as an event
    admission.reservation.shrink(0)


#: The warm-up: a short prompt, a few new tokens, greedy.
WARM_UP_PROMPT = "Hello"
WARM_UP_TOKENS = 4


async def warm_up(service: DemoService, lifecycle: Lifecycle) -> None:
    """One real generation through the batcher and the device, then ``lifecycle.mark_ready()``.

    Until then ``/health/ready`` answers 503: the first request does not pay for the first
    kernels, allocator growth or lazy imports, and a load balancer sends none before.
    """
    ids = service.loaded.tokenizer(WARM_UP_PROMPT)["input_ids"]
    with step("Warm-up generation (readiness waits for it)"):
        await service.batcher.warm_up(ids, WARM_UP_TOKENS)
    lifecycle.mark_ready()
    logger.info("Ready: the model is loaded and one generation has run; /health/ready answers 200")
