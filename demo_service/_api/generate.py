"""``POST /v1/generate``: the seed's schema, ``{prompt, max_new_tokens}`` in, text and usage out."""

# No `from __future__ import annotations`: the body type is built per app (it declares its cap).
import time
from typing import Annotated

from fastapi import APIRouter, Depends, Request

from gpu_asgi import Admission, gpu_admission, gpu_bound

from .._batching.device_run import Sampling
from .._model.prompts import encode_all
from .._service import DemoService, complete, new_id
from .responses import error_responses
from .schemas import AdmissionInfo, GenerateResponse, request_models, usage


def generate_router(service: DemoService) -> APIRouter:
    router = APIRouter(tags=["generate"])
    settings = service.settings
    bodies = request_models(max_new_tokens_cap=settings.max_new_tokens_cap, vocab_size=service.vocab_size)

    @router.post("/v1/generate", response_model=GenerateResponse, responses=error_responses(openai=False))
    @gpu_bound(
        prompt="prompt",
        max_tokens_fields=("max_new_tokens",),
        default_max_new_tokens=settings.default_max_new_tokens,
        max_new_tokens_cap=settings.max_new_tokens_cap,
        batch_field=None,
    )
    async def generate(
        body: bodies.generate,  # type: ignore[name-defined]  # a class built per app
        request: Request,
        admission: Annotated[Admission, Depends(gpu_admission)],
    ) -> GenerateResponse:
        """Generate from raw text (no chat template). ``temperature`` 0, the default, is greedy."""
        (prompt,) = await encode_all(service.encode, [body.prompt])
        sampling = Sampling(body.temperature, body.top_p)
        generation = service.submit(admission, [prompt], sampling=sampling, stop=body.stops)
        (sequence,) = await complete(request, admission, generation)
        return GenerateResponse(
            id=new_id("gen"),
            created=int(time.time()),
            model=service.model_name,
            text=sequence.text.text,
            finish_reason=sequence.finish_reason or "length",
            usage=usage(generation.prompt_tokens, generation.completion_tokens),
            admission=AdmissionInfo(
                device=admission.device,
                estimated_bytes=admission.estimated_bytes,
                queue_wait_seconds=round(admission.reservation.waited, 6),
                batch_size=generation.batch_rows,
            ),
        )

    return router
