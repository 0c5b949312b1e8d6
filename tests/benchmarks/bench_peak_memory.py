"""Measured peak memory of Qwen2 requests against ``AnalyticEstimator``.

    nice -n 10 python -m tests.benchmarks.bench_peak_memory [--quick] [--layers 2] [--device cpu]

Qwen2-0.5B and Qwen2-1.5B shapes from their published ``config.json`` (written inline below; no
hub access), random weights, built with transformers' own Qwen2 classes at reduced depth: every
term but the KV cache is one layer's (layers run one after another), and the KV term is exact
per layer, so depth only scales the part already known exactly. For each case: the peak bytes
above the weights, the estimate of ``AnalyticEstimator.from_config(model.config, ...)``, and
their ratio. Bars (CPU): the estimate is never below the peak, and at most 1.25x above it when
the peak is over 16 MiB per sequence. Writes ``reports/bench_peak_memory.json``.

How the peak is measured:
- CPU: ``torch.profiler`` with ``profile_memory=True`` records every allocator event; the peak
  is the highest running sum (the weights were allocated before, so they are not in it).
- CUDA (untested: no GPU here): a warm-up call first (cuBLAS workspaces and kernels are fixed
  costs, not per request), then ``reset_peak_memory_stats`` and ``max_memory_allocated`` and
  ``max_memory_reserved`` minus what was allocated/reserved before. float16 is measured too.
- Both: the SDPA backend PyTorch picks for the prefill's shapes is recorded (on the CPU, its
  flash kernel).
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
import transformers

from gpu_asgi import AnalyticEstimator

from ._report import table, write_report

MiB = 1 << 20
NEW_TOKENS = 8
#: The bar on the ratio applies to requests whose peak is at least this, per sequence.
BAR_MIN_BYTES_PER_SEQUENCE = 16 * MiB
MAX_RATIO = 1.25

# Published config.json fields of Qwen/Qwen2-0.5B and Qwen/Qwen2-1.5B that shape memory.
QWEN2_SHAPES: dict[str, dict[str, Any]] = {
    "qwen2-0.5b": {
        "hidden_size": 896, "intermediate_size": 4864, "num_attention_heads": 14, "num_key_value_heads": 2,
        "num_hidden_layers": 24, "vocab_size": 151936, "tie_word_embeddings": True,
        "max_position_embeddings": 131072, "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6,
    },
    "qwen2-1.5b": {
        "hidden_size": 1536, "intermediate_size": 8960, "num_attention_heads": 12, "num_key_value_heads": 2,
        "num_hidden_layers": 28, "vocab_size": 151936, "tie_word_embeddings": True,
        "max_position_embeddings": 131072, "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6,
    },
}
SAMPLING = {"do_sample": True, "temperature": 0.7, "top_k": 50, "top_p": 0.9}


@dataclass(frozen=True, slots=True)
class Case:
    shape: str
    dtype: str
    attention: str
    prompt: int
    batch: int
    #: "greedy" or "sample" for ``generate``; "forward" is one plain forward keeping all logits.
    mode: str
    #: Rows after the first are shorter by an eighth, left-padded (a dynamic batch).
    padded: bool = False


def build_model(shape: str, dtype: str, attention: str, layers: int, device: str) -> Any:
    """A Qwen2 of the published shape with random weights and ``layers`` layers."""
    torch.manual_seed(0)
    fields = {**QWEN2_SHAPES[shape], "num_hidden_layers": layers}
    config = transformers.Qwen2Config(attn_implementation=attention, **fields)
    return transformers.Qwen2ForCausalLM(config).to(device=device, dtype=getattr(torch, dtype)).eval()


def request(model: Any, case: Case, device: str) -> Callable[[], None]:
    """The call whose peak is measured: ``generate`` (8 new tokens) or a plain forward."""
    generator = torch.Generator().manual_seed(case.prompt)
    ids = torch.randint(0, model.config.vocab_size, (case.batch, case.prompt), generator=generator).to(device)
    mask = torch.ones_like(ids)
    if case.padded:
        mask[1:, : case.prompt // 8] = 0

    def call() -> None:
        with torch.inference_mode():
            if case.mode == "forward":
                model(input_ids=ids, attention_mask=mask, use_cache=False)
                return
            decoding = SAMPLING if case.mode == "sample" else {"do_sample": False}
            model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                pad_token_id=0, **decoding,
            )

    return call


def cpu_peak_bytes(call: Callable[[], None]) -> int:
    """Highest running sum of the CPU allocator's events during ``call``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        call()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]  # type: ignore[union-attr]
    events.sort(key=lambda e: e.start_ns())
    current = peak = 0
    for event in events:
        current += event.nbytes()
        peak = max(peak, current)
    return peak


def cuda_peak_bytes(call: Callable[[], None], device: str) -> tuple[int, int]:
    """(allocated, reserved) peak above what was held before ``call``; warm up first."""
    torch.cuda.synchronize(device)
    allocated, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
    torch.cuda.reset_peak_memory_stats(device)
    call()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - allocated, torch.cuda.max_memory_reserved(device) - reserved)


def sdpa_backend(model: Any, case: Case, device: str) -> str:
    """The backend PyTorch's SDPA dispatcher picks for this prefill's shapes (no mask: no padding)."""
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    q = torch.empty(case.batch, config.num_attention_heads, case.prompt, head_dim, device=device, dtype=model.dtype)
    k = torch.empty(case.batch, config.num_key_value_heads, case.prompt, head_dim, device=device, dtype=model.dtype)
    try:
        choice = torch._fused_sdp_choice(q, k, k, is_causal=True, enable_gqa=True)  # type: ignore[attr-defined]
        return str(torch.nn.attention.SDPBackend(choice).name)
    except (AttributeError, RuntimeError, TypeError, ValueError) as exc:  # private API: record, never fail
        return f"unknown ({type(exc).__name__})"


def estimate_bytes(model: Any, case: Case) -> int:
    estimator = AnalyticEstimator.from_config(
        model.config, dtype=model.dtype, logits="all" if case.mode == "forward" else "last",
        padding=case.padded, additive_mask=model.device.type == "cuda",  # the CPU kernel takes the boolean mask
    )
    new = 0 if case.mode == "forward" else NEW_TOKENS
    return estimator.estimate(case.prompt, new, case.batch, sampling=case.mode == "sample")


def measure(model: Any, case: Case, device: str) -> dict[str, Any]:
    """One case: peak, estimate, ratio (and on CUDA the reserved peak and the SDPA backend)."""
    call = request(model, case, device)
    result: dict[str, Any] = asdict(case)
    started = time.perf_counter()
    if device.startswith("cuda"):
        call()  # warm-up: kernels, cuBLAS workspace and allocator pools are fixed costs
        peak, reserved = cuda_peak_bytes(call, device)
        result["reserved_bytes"] = reserved
    else:
        peak = cpu_peak_bytes(call)
    if case.attention == "sdpa":
        result["sdpa_backend"] = sdpa_backend(model, case, device)
    estimate = estimate_bytes(model, case)
    result.update(peak_bytes=peak, estimate_bytes=estimate, ratio=estimate / peak if peak else float("inf"),
                  seconds=round(time.perf_counter() - started, 2))
    result["within_bars"] = estimate >= peak and (
        peak < BAR_MIN_BYTES_PER_SEQUENCE * case.batch or estimate <= MAX_RATIO * peak
    )
    return result


def cases(quick: bool, dtypes: tuple[str, ...]) -> Iterator[Case]:
    """The grid. Batch 4 and plain forward stop at 1,024 tokens: 4,096 of either needs >10 GB.
    Padded batches (batch 2) only for SDPA, the one attention whose mask depends on padding."""
    shapes = ("qwen2-0.5b",) if quick else tuple(QWEN2_SHAPES)
    prompts = (16, 1024) if quick else (16, 256, 1024, 4096)
    for shape, dtype, attention in itertools.product(shapes, dtypes, ("sdpa", "eager")):
        for prompt in prompts:
            yield Case(shape, dtype, attention, prompt, 1, "greedy")
            if prompt <= 256 or not quick:
                yield Case(shape, dtype, attention, prompt, 1, "sample")
            if prompt <= 1024:
                yield Case(shape, dtype, attention, prompt, 4, "greedy")
                if not quick and attention == "sdpa":
                    yield Case(shape, dtype, attention, prompt, 1, "forward")
            if prompt >= 1024 and attention == "sdpa":
                yield Case(shape, dtype, attention, prompt, 2, "greedy", padded=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small subset (0.5B shape, two prompt lengths)")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers built (default 2)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = str(args.device)
    dtypes = ("float32", "bfloat16", "float16") if device.startswith("cuda") else ("float32", "bfloat16")
    rows, results = [], []
    model, built = None, None
    for case in cases(args.quick, dtypes):
        key = (case.shape, case.dtype, case.attention)
        if key != built:
            model = None  # drop the previous model before building the next
            model = build_model(*key, layers=args.layers, device=device)
            request(model, Case(*key, 4, 1, "greedy"), device)()  # first call's lazy set-up is not per request
            built = key
        result = measure(model, case, device)
        results.append(result)
        mode = f"{case.mode}, padded" if case.padded else case.mode
        rows.append([case.shape, case.dtype, case.attention, case.prompt, case.batch, mode,
                     f"{result['peak_bytes'] / MiB:.1f}", f"{result['estimate_bytes'] / MiB:.1f}",
                     f"{result['ratio']:.2f}", "ok" if result["within_bars"] else "FAIL"])
        print(table(rows[-1:], ["shape", "dtype", "attention", "prompt", "batch", "mode",
                                "peak MiB", "estimate MiB", "ratio", "bars"]).splitlines()[-1], flush=True)
    print()
    print(table(rows, ["shape", "dtype", "attention", "prompt", "batch", "mode",
                       "peak MiB", "estimate MiB", "ratio", "bars"]))
    failed = [r for r in results if not r["within_bars"]]
    settings = {"device": device, "layers": args.layers, "new_tokens": NEW_TOKENS, "torch": torch.__version__,
                "transformers": transformers.__version__, "quick": args.quick}
    path = write_report("bench_peak_memory", {"settings": settings, "cases": results, "failed": len(failed)})
    print(f"\n{len(results) - len(failed)}/{len(results)} cases within the bars; report: {path}")


if __name__ == "__main__":
    main()
