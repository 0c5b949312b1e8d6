"""The device side of a batch: left-pad the prompts, run ONE ``generate``, hand each step's tokens out.

Runs on the device executor's thread (``torch.inference_mode()`` is set there). Each decoding step's
new tokens, one per row, go to ``on_step`` (the batcher forwards them to the event loop), so
streaming and batching share one ``generate`` call. Rows stop on their own: at their own
``max_new_tokens``, or when the event loop flags them in ``halted`` (a stop string, a client that
left); ``generate`` itself stops when every row has. The returned value is nothing: the tokens were
already delivered, step by step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from gpu_asgi import gpu_phase

from .._model.load import LoadedModel

#: Temperatures below this are greedy: dividing the logits by a tinier one overflows them to inf,
#: and sampling from the resulting NaN probabilities fails (a schema-driven test found 6e-55).
GREEDY_BELOW_TEMPERATURE = 1e-5


@dataclass(frozen=True, slots=True)
class Sampling:
    """Per-request sampling parameters; requests share a batch only when these are equal."""

    temperature: float = 0.0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @property
    def key(self) -> tuple[float, float]:
        """Batches group by this: every greedy request is alike, whatever its top_p."""
        return (0.0, 1.0) if self.greedy else (self.temperature, self.top_p)

    def generate_kwargs(self) -> dict[str, Any]:
        if self.greedy:
            return {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
        return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p, "top_k": None}


@dataclass(slots=True)
class BatchPlan:
    """What one ``generate`` call runs: rows of prompt ids, each with its own token limit."""

    prompts: list[list[int]]
    max_new_tokens: list[int]
    sampling: Sampling
    #: Set by the event loop (a plain list of bools: reads and writes are atomic under the GIL).
    halted: list[bool] = field(default_factory=list)
    #: Learned lengths: the steps the batch's bytes cover (None: all of them) and, called on the
    #: device thread before a step past them, what makes room for more (it blocks until the bytes
    #: are held) and returns the steps covered then; no more than it was given: the batch stops.
    covered: int | None = None
    grow: Callable[[int], int] | None = None

    def __post_init__(self) -> None:
        if not self.prompts or len(self.prompts) != len(self.max_new_tokens):
            raise ValueError("a batch needs one max_new_tokens per prompt, and at least one prompt")
        if not self.halted:
            self.halted = [False] * len(self.prompts)

    @property
    def width(self) -> int:
        """Padded prompt length."""
        return max(map(len, self.prompts))


class _StepStreamer(BaseStreamer):
    """Receives ``generate``'s tokens: first the prompt (skipped), then one tensor per step."""

    def __init__(self, on_step: Callable[[list[int]], None]) -> None:
        self._on_step = on_step
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self._on_step(value.reshape(-1).tolist())

    def end(self) -> None:
        pass


class _RowStopper(StoppingCriteria):
    """Per-row stop: the row's own ``max_new_tokens``, or a flag raised by the event loop; and the
    whole batch's, when it may not grow past the steps its bytes cover."""

    def __init__(self, plan: BatchPlan) -> None:
        self._plan = plan
        self._width = plan.width
        self._limits = plan.max_new_tokens
        self._halted = plan.halted

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
        produced = input_ids.shape[1] - self._width
        done = [halted or produced >= limit for halted, limit in zip(self._halted, self._limits)]
        plan = self._plan
        # Called before the next step's forward pass, which is what allocates: grow first, or stop.
        if plan.covered is not None and produced >= plan.covered and not all(done) and plan.grow is not None:
            plan.covered = plan.grow(produced)
            if plan.covered <= produced:
                done = [True] * len(done)
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)  # type: ignore[return-value]


def pad_left(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ids and attention mask, left-padded to the longest prompt."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        if prompt:
            ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            mask[row, width - len(prompt) :] = 1
    return ids, mask


def run_batch(loaded: LoadedModel, plan: BatchPlan, on_step: Callable[[list[int]], None]) -> int:
    """Run ``plan`` in one ``generate``; returns the number of decoding steps taken."""
    tokenizer = loaded.tokenizer
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids, mask = pad_left(plan.prompts, pad_id)
    with gpu_phase("host_to_device", bytes=ids.nbytes + mask.nbytes):
        ids = ids.to(loaded.device)
        mask = mask.to(loaded.device)
    with gpu_phase(
        "generate",
        batch=len(plan.prompts),
        tokens_in=int(mask.sum()),
        max_new_tokens=max(plan.max_new_tokens),
        model=loaded.name,
    ) as phase:
        out = loaded.model.generate(  # type: ignore[operator]
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max(plan.max_new_tokens),
            pad_token_id=pad_id,
            streamer=_StepStreamer(on_step),
            stopping_criteria=StoppingCriteriaList([_RowStopper(plan)]),
            **plan.sampling.generate_kwargs(),
        )
        steps = out.shape[1] - ids.shape[1]
        phase.set(tokens_out=steps * len(plan.prompts))
    return int(steps)
