"""What the load test sends: prompts from a mixed length distribution, as request bodies per endpoint.

Prompts are built from a fixed word list with a seeded RNG, so a run is repeatable. Lengths are in
words (about 1.3 Qwen tokens each for this list). The default mix is mostly short chat turns with a
tail of long documents, the shape that makes a count-based limit either waste the GPU or run out of
memory, and that byte-based admission handles.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

ENDPOINTS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "generate": "/v1/generate",
}

_WORDS = (  # a paragraph reads better than a list of words
    "the memory budget of a graphics card is shared by every request that runs on it and each one "
    "needs room for its key value cache which grows with the prompt and with every generated token "
    "so a short question and a long document do not cost the same the server admits requests by "
    "bytes queues those that do not fit yet and answers with retry after when the queue is full "
    "model weights stay resident while activations come and go during prefill and decoding batches "
    "of sequences share one forward pass left padding aligns them and each keeps its own reservation"
).split()


@dataclass(frozen=True, slots=True)
class LengthClass:
    """Prompts of ``min_words``..``max_words`` words asking for ``max_tokens`` new tokens, drawn with ``weight``."""

    name: str
    weight: float
    min_words: int
    max_words: int
    max_tokens: int


DEFAULT_MIX = (
    LengthClass("short", 0.6, 8, 40, 48),
    LengthClass("medium", 0.3, 120, 300, 64),
    LengthClass("long", 0.1, 600, 1000, 96),
)


def parse_mix(text: str) -> tuple[LengthClass, ...]:
    """``"short:0.6,medium:0.3,long:0.1"``: weights for the default classes (others keep theirs)."""
    classes = {c.name: c for c in DEFAULT_MIX}
    weights: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, weight = item.partition(":")
        if name not in classes or not weight:
            raise ValueError(f"bad mix item {item!r}: use name:weight with names {', '.join(classes)}")
        weights[name] = float(weight)
    mix = tuple(
        LengthClass(c.name, weights[c.name], c.min_words, c.max_words, c.max_tokens)
        for c in DEFAULT_MIX
        if c.name in weights
    )
    if not mix or sum(c.weight for c in mix) <= 0:
        raise ValueError("the mix needs at least one class with a positive weight")
    return mix


@dataclass(frozen=True, slots=True)
class Job:
    index: int
    length_class: str
    words: int
    body: Mapping[str, Any]


def make_jobs(
    count: int,
    *,
    endpoint: str = "chat",
    mix: Sequence[LengthClass] = DEFAULT_MIX,
    max_tokens: int | None = None,
    stream: bool = False,
    model: str | None = None,
    seed: int = 0,
) -> list[Job]:
    """``count`` request bodies for ``endpoint``; ``max_tokens`` overrides the classes' own."""
    if endpoint not in ENDPOINTS:
        raise ValueError(f"endpoint must be one of {', '.join(ENDPOINTS)}")
    rng = random.Random(seed)
    jobs = []
    for index in range(count):
        length_class = rng.choices(mix, weights=[c.weight for c in mix])[0]
        words = rng.randint(length_class.min_words, length_class.max_words)
        prompt = " ".join(rng.choice(_WORDS) for _ in range(words))
        tokens = max_tokens if max_tokens is not None else length_class.max_tokens
        jobs.append(Job(index, length_class.name, words, _body(endpoint, prompt, tokens, stream, model)))
    return jobs


def _body(endpoint: str, prompt: str, max_tokens: int, stream: bool, model: str | None) -> dict[str, Any]:
    if endpoint == "generate":
        return {"prompt": prompt, "max_new_tokens": max_tokens}
    body: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": f"Summarise this: {prompt}"}]
    else:
        body["prompt"] = prompt
    if model is not None:
        body["model"] = model
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body
