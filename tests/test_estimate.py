"""Estimators, budget and calibration fit; the KV formula against a real Qwen2 cache."""

from __future__ import annotations

import random
import subprocess
import sys
import weakref
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpu_asgi._estimate.analytic import AnalyticEstimator
from gpu_asgi._estimate.contract import Estimator, budget_bytes
from gpu_asgi._estimate.linear import LinearEstimator, calibrate, cuda_peak_measurer, fit_linear

GIB = 1024**3
# Qwen2-1.5B's config.json, trimmed to what the estimator reads.
QWEN2_1_5B: dict[str, Any] = {
    "num_hidden_layers": 28, "hidden_size": 1536, "num_attention_heads": 12, "num_key_value_heads": 2,
    "intermediate_size": 8960, "vocab_size": 151936, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
}


def tiny_qwen2(dtype: Any, **overrides: Any) -> Any:
    """A 3-layer Qwen2 with grouped-query attention (4 heads, 2 KV heads), built locally."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    shape = {"num_hidden_layers": 3, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
             "intermediate_size": 128, "vocab_size": 1000}
    config = transformers.Qwen2Config(**{**shape, **overrides})
    return transformers.Qwen2ForCausalLM(config).to(dtype).eval()


def cache_bytes(cache: Any) -> int:
    """Bytes held by every key/value tensor of a transformers 5 `DynamicCache`."""
    # Iterating the cache yields (keys, values, sliding_window) triples in transformers 5,
    # so read the layers directly; count storages, which is what the allocator holds.
    return sum(t.untyped_storage().nbytes() for layer in cache.layers for t in (layer.keys, layer.values))


# -- LinearEstimator and the budget ------------------------------------------------


def test_linear_estimator_math_and_batch_scaling() -> None:
    est = LinearEstimator(bytes_per_token=100, fixed_bytes=1_000)
    assert isinstance(est, Estimator)
    assert est.estimate(10, 5) == 1_000 + 100 * 15
    assert est.estimate(10, 5, batch=3) == 3 * est.estimate(10, 5)
    assert est.estimate(0, 0) == 1_000
    assert LinearEstimator(bytes_per_token=7).estimate(3, 0) == 21


@pytest.mark.parametrize("args", [(-1, 0, 1), (0, -1, 1), (1, 1, 0)])
def test_linear_estimator_rejects_bad_arguments(args: tuple[int, int, int]) -> None:
    with pytest.raises(ValueError):
        LinearEstimator(bytes_per_token=1).estimate(*args)
    with pytest.raises(ValueError):
        LinearEstimator(bytes_per_token=-1)


def test_budget_takes_fixed_costs_off_once() -> None:
    assert budget_bytes(24 * GIB) == int(24 * GIB * 0.9)
    assert budget_bytes(24 * GIB, utilization=1.0, weights_bytes=3 * GIB, runtime_overhead_bytes=GIB) == 20 * GIB
    assert budget_bytes(1_000, utilization=0.5, weights_bytes=100) == 400


@pytest.mark.parametrize("utilization", [0.0, -0.1, 1.01, 2.0])
def test_budget_rejects_utilization_outside_unit_interval(utilization: float) -> None:
    with pytest.raises(ValueError, match="utilization"):
        budget_bytes(24 * GIB, utilization=utilization)


def test_budget_rejects_no_room_left() -> None:
    with pytest.raises(ValueError, match="no budget left"):
        budget_bytes(24 * GIB, weights_bytes=20 * GIB, runtime_overhead_bytes=2 * GIB)
    with pytest.raises(ValueError, match="no budget left"):
        budget_bytes(10, utilization=0.9, weights_bytes=9)


# -- fitting and calibration -------------------------------------------------------


def test_fit_linear_recovers_a_clean_line_to_the_byte() -> None:
    samples = [(tokens, 4_096 + 28_672 * tokens) for tokens in (48, 160, 544, 2080)]
    assert fit_linear(samples) == LinearEstimator(bytes_per_token=28_672, fixed_bytes=4_096)


def test_fit_linear_covers_noisy_samples_and_applies_margin() -> None:
    rng = random.Random(7)
    samples = [(t, 10_000_000 + 30_000 * t + rng.randint(-2_000_000, 2_000_000)) for t in range(16, 4_096, 97)]
    fitted = fit_linear(samples)
    assert 29_000 <= fitted.bytes_per_token <= 31_000
    assert all(fitted.estimate(t, 0) >= peak for t, peak in samples)
    widened = fit_linear(samples, margin=0.1)
    assert widened.bytes_per_token == pytest.approx(fitted.bytes_per_token * 1.1, abs=1)
    assert widened.fixed_bytes == pytest.approx(fitted.fixed_bytes * 1.1, abs=1)


@given(st.lists(st.tuples(st.integers(0, 100_000), st.integers(0, 10**11)), min_size=2)
       .filter(lambda s: len({t for t, _ in s}) >= 2),
       st.floats(0, 1))
def test_fit_linear_never_undershoots_a_sample(samples: list[tuple[int, int]], margin: float) -> None:
    fitted = fit_linear(samples, margin=margin)
    assert fitted.bytes_per_token >= 0 and fitted.fixed_bytes >= 0
    assert all(fitted.estimate(t, 0) >= peak for t, peak in samples)


def test_fit_linear_rejects_degenerate_input() -> None:
    with pytest.raises(ValueError, match="distinct"):
        fit_linear([(100, 1_000), (100, 2_000)])
    with pytest.raises(ValueError, match="distinct"):
        fit_linear([])
    with pytest.raises(ValueError, match="margin"):
        fit_linear([(1, 1), (2, 2)], margin=-0.1)


def test_calibrate_measures_each_length_and_fits() -> None:
    calls: list[tuple[int, int]] = []

    def measure(prompt_tokens: int, max_new_tokens: int) -> int:
        calls.append((prompt_tokens, max_new_tokens))
        return 1_000_000 + 20_000 * (prompt_tokens + max_new_tokens)

    assert calibrate(measure, margin=0.0) == LinearEstimator(bytes_per_token=20_000, fixed_bytes=1_000_000)
    assert calls == [(16, 32), (128, 32), (512, 32), (2048, 32)]
    padded = calibrate(measure, prompt_lengths=(8, 64), max_new_tokens=4)
    assert padded == LinearEstimator(bytes_per_token=21_000, fixed_bytes=1_050_000)


def test_cuda_peak_measurer_refuses_without_cuda() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        cuda_peak_measurer(torch.nn.Linear(2, 2))


def test_module_imports_without_torch_or_transformers() -> None:
    root = Path(__file__).resolve().parents[1]
    code = (
        "import sys; sys.modules['torch'] = sys.modules['transformers'] = None\n"
        "from gpu_asgi._estimate.analytic import AnalyticEstimator\nfrom gpu_asgi._estimate.linear import LinearEstimator\n"
        "cfg = {'num_hidden_layers': 2, 'hidden_size': 8, 'num_attention_heads': 2,"
        " 'intermediate_size': 16, 'vocab_size': 10, 'torch_dtype': 'bfloat16'}\n"
        "assert AnalyticEstimator.from_config(cfg).kv_cache_bytes(1) == 2 * 2 * 2 * 4 * 2\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


# -- AnalyticEstimator -------------------------------------------------------------


def test_from_config_reads_dict_fields_dtype_and_head_dim() -> None:
    est = AnalyticEstimator.from_config(QWEN2_1_5B)
    assert (est.num_layers, est.num_kv_heads, est.head_dim, est.dtype_bytes) == (28, 2, 128, 2)
    # 2 x 28 layers x 2 KV heads x 128 x 2 bytes: Qwen2-1.5B's well-known 28 KiB per token.
    assert est.kv_cache_bytes(1) == 28_672
    assert AnalyticEstimator.from_config({**QWEN2_1_5B, "torch_dtype": "float32"}).dtype_bytes == 4
    assert AnalyticEstimator.from_config({**QWEN2_1_5B, "torch_dtype": None, "dtype": "torch.float32"}).dtype_bytes == 4
    assert AnalyticEstimator.from_config({**QWEN2_1_5B, "torch_dtype": None}).dtype_bytes == 2
    assert AnalyticEstimator.from_config(QWEN2_1_5B, dtype="float32").dtype_bytes == 4
    assert AnalyticEstimator.from_config({**QWEN2_1_5B, "head_dim": 256}).head_dim == 256
    no_gqa = {k: v for k, v in QWEN2_1_5B.items() if k != "num_key_value_heads"}
    assert AnalyticEstimator.from_config(no_gqa).num_kv_heads == 12
    assert AnalyticEstimator.from_config({"text_config": QWEN2_1_5B}) == est
    with pytest.raises(ValueError, match="unknown dtype"):
        AnalyticEstimator.from_config(QWEN2_1_5B, dtype="float7")


def test_from_config_accepts_config_object_and_its_dict() -> None:
    torch = pytest.importorskip("torch")
    config = tiny_qwen2(torch.float32).config
    from_object = AnalyticEstimator.from_config(config, dtype=torch.bfloat16)
    assert from_object == AnalyticEstimator.from_config(config.to_dict(), dtype="bfloat16")
    assert (from_object.num_layers, from_object.num_kv_heads, from_object.head_dim) == (3, 2, 16)
    assert AnalyticEstimator.from_config(config, dtype=torch.float32).dtype_bytes == 4


def test_estimate_is_kv_plus_the_worst_moment_and_scales_with_batch() -> None:
    est = AnalyticEstimator.from_config(QWEN2_1_5B)
    assert isinstance(est, Estimator)
    for prompt, new in [(1, 1), (20, 4_000), (4_000, 20), (512, 512)]:
        tail = est.decode_workspace_bytes(prompt + new) + est.logits_bytes()
        assert est.estimate(prompt, new) == est.kv_cache_bytes(prompt + new) + max(est.prefill_workspace_bytes(prompt), tail)
        assert est.estimate(prompt, new, batch=4) > 4 * est.estimate(prompt, new)  # padding mask
        unpadded = AnalyticEstimator.from_config(QWEN2_1_5B, padding=False)
        assert unpadded.estimate(prompt, new, batch=4) == 4 * unpadded.estimate(prompt, new) == 4 * est.estimate(prompt, new)
    assert est.estimate(2_000, 10) > est.estimate(1_000, 10) > est.estimate(1_000, 5)
    eager = AnalyticEstimator.from_config(QWEN2_1_5B, attention="eager")
    assert est.estimate(4_000, 20) < eager.estimate(4_000, 20)
    assert eager.kv_cache_bytes(4_020) == est.kv_cache_bytes(4_020)


def test_estimate_never_includes_the_weights() -> None:
    c = QWEN2_1_5B
    h, layers, vocab = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    head_dim = h // c["num_attention_heads"]
    per_layer = 2 * h * h + 2 * h * c["num_key_value_heads"] * head_dim + 3 * h * c["intermediate_size"]
    weights_bytes = 2 * (vocab * h + layers * per_layer)  # ~1.5 B parameters in bfloat16
    assert weights_bytes > 3 * 10**9
    est = AnalyticEstimator.from_config(c)
    assert est.estimate(1, 1) < weights_bytes / 100
    assert est.estimate(0, 1) < 16 * 2**20
    # A 24 GB card holds many short requests once the weights come off the budget, once.
    assert budget_bytes(24 * GIB, weights_bytes=weights_bytes) // est.estimate(128, 128) > 100


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16", "float16"])
def test_kv_bytes_equal_measured_cache_after_prefill(dtype_name: str) -> None:
    torch = pytest.importorskip("torch")
    dtype = getattr(torch, dtype_name)
    model = tiny_qwen2(dtype)
    est = AnalyticEstimator.from_config(model.config, dtype=dtype)
    for batch in (1, 2):
        for prompt in (1, 7, 64, 300):
            ids = torch.randint(0, model.config.vocab_size, (batch, prompt))
            with torch.inference_mode():
                cache = model(input_ids=ids, use_cache=True).cache
            assert cache.get_seq_length() == prompt
            assert cache_bytes(cache) == est.kv_cache_bytes(prompt, batch), (dtype_name, batch, prompt)


def test_kv_bytes_follow_an_explicit_head_dim() -> None:
    torch = pytest.importorskip("torch")
    model = tiny_qwen2(torch.float16, head_dim=48)  # not hidden_size // heads
    est = AnalyticEstimator.from_config(model.config, dtype=torch.float16)
    assert est.head_dim == 48
    with torch.inference_mode():
        cache = model(input_ids=torch.zeros((2, 9), dtype=torch.long), use_cache=True).cache
    assert cache_bytes(cache) == est.kv_cache_bytes(9, batch=2)


@pytest.mark.parametrize("batch", [1, 2])
def test_generate_ends_with_the_cache_the_estimate_covers(batch: int) -> None:
    torch = pytest.importorskip("torch")
    model = tiny_qwen2(torch.bfloat16)
    est = AnalyticEstimator.from_config(model.config, dtype=torch.bfloat16)
    prompt, new = 11, 6
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt))
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
            do_sample=False, pad_token_id=0, return_dict_in_generate=True,
        )
    assert out.sequences.shape == (batch, prompt + new)
    # The last sampled token is never fed back, so its K/V are never computed.
    cached = out.cache.get_seq_length()
    assert cached in (prompt + new - 1, prompt + new)
    assert cache_bytes(out.cache) == est.kv_cache_bytes(cached, batch)
    assert est.kv_cache_bytes(prompt + new, batch) <= est.estimate(prompt, new, batch)


def make_peak_tracker() -> Any:
    """A dispatch mode that counts bytes of tensors created under it, alive at once."""
    torch = pytest.importorskip("torch")
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class PeakTracker(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.live: dict[int, int] = {}
            self.current = self.peak = 0

        def _freed(self, key: int) -> None:
            self.current -= self.live.pop(key)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            for tensor in tree_leaves(out):
                if isinstance(tensor, torch.Tensor) and id(storage := tensor.untyped_storage()) not in self.live:
                    # torch keeps one Python object per live storage, so its finalizer marks the free.
                    self.live[id(storage)] = storage.nbytes()
                    self.current += storage.nbytes()
                    weakref.finalize(storage, self._freed, id(storage))
                    self.peak = max(self.peak, self.current)
            return out

    return PeakTracker()


@pytest.mark.parametrize(
    ("dtype_name", "prompt", "new", "batch"),
    [("float32", 300, 4, 1), ("bfloat16", 600, 2, 2), ("float16", 3, 200, 1), ("bfloat16", 1, 1, 3)],
)
def test_estimate_covers_the_measured_peak_of_eager_generate(
    dtype_name: str, prompt: int, new: int, batch: int
) -> None:
    torch = pytest.importorskip("torch")
    dtype = getattr(torch, dtype_name)
    # Eager attention materializes the T x T scores: the worst case the model describes.
    model = tiny_qwen2(dtype, attn_implementation="eager")
    est = AnalyticEstimator.from_config(model.config, dtype=dtype)
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt))
    mask = torch.ones_like(ids)
    with torch.inference_mode(), make_peak_tracker() as tracker:
        model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, pad_token_id=0,
            do_sample=True, top_k=50, top_p=0.9, temperature=0.7,
        )
    assert tracker.peak > est.kv_cache_bytes(prompt + new - 1, batch)
    assert tracker.peak <= est.estimate(prompt, new, batch) <= 4 * tracker.peak


# -- how the model runs: attention, decoding, logits -------------------------------


def test_from_config_follows_the_attention_the_model_was_loaded_with() -> None:
    torch = pytest.importorskip("torch")
    assert AnalyticEstimator.from_config(QWEN2_1_5B).attention == "sdpa"  # transformers' default
    assert AnalyticEstimator.from_config(tiny_qwen2(torch.float32).config).attention == "sdpa"
    assert AnalyticEstimator.from_config(tiny_qwen2(torch.float32, attn_implementation="eager").config).attention == "eager"
    for name, kind in [("flash_attention_2", "flash"), ("sdpa", "sdpa"), ("eager", "eager"), ("my_kernel", "eager")]:
        assert AnalyticEstimator.from_config({**QWEN2_1_5B, "_attn_implementation": name}).attention == kind
    assert AnalyticEstimator.from_config({**QWEN2_1_5B, "attn_implementation": "eager"}, attention="sdpa").attention == "sdpa"
    with pytest.raises(ValueError, match="attention"):
        AnalyticEstimator.from_config(QWEN2_1_5B, attention="fast")
    with pytest.raises(ValueError, match="logits"):
        AnalyticEstimator.from_config(QWEN2_1_5B, logits="some")


def test_only_eager_attention_pays_for_the_prompt_squared_scores() -> None:
    sdpa, eager, flash = (AnalyticEstimator.from_config(QWEN2_1_5B, attention=a) for a in ("sdpa", "eager", "flash"))
    # Doubling a long prompt: eager's prefill grows ~4x (scores), SDPA's ~2x (linear terms).
    assert eager.prefill_workspace_bytes(8_192) > 3.5 * eager.prefill_workspace_bytes(4_096)
    assert sdpa.prefill_workspace_bytes(8_192) < 2.1 * sdpa.prefill_workspace_bytes(4_096)
    assert flash.estimate(4_096, 64) <= sdpa.estimate(4_096, 64) < eager.estimate(4_096, 64) / 3


def test_greedy_decoding_needs_fewer_vocab_buffers_than_sampling() -> None:
    sampling = AnalyticEstimator.from_config(QWEN2_1_5B)
    greedy = AnalyticEstimator.from_config(QWEN2_1_5B, sampling=False)
    vocab = QWEN2_1_5B["vocab_size"]
    assert sampling.logits_bytes() - greedy.logits_bytes() == vocab * 4 * (sampling.sampling_buffers - 2)
    assert greedy.estimate(16, 64) < sampling.estimate(16, 64) / 2  # vocab buffers dominate short requests
    # Per request, the argument wins over the estimator's default.
    assert sampling.estimate(16, 64, sampling=False) == greedy.estimate(16, 64)
    assert greedy.estimate(16, 64, 2, sampling=True) == sampling.estimate(16, 64, 2)


def test_all_position_logits_grow_with_the_prompt() -> None:
    last = AnalyticEstimator.from_config(QWEN2_1_5B)
    every = AnalyticEstimator.from_config(QWEN2_1_5B, logits="all", sampling=False)
    vocab = QWEN2_1_5B["vocab_size"]
    assert every.estimate(1_000, 0) >= vocab * 1_000 * 2 > 2 * last.estimate(1_000, 0)
    assert every.estimate(1_000, 0, batch=3) == 3 * every.estimate(1_000, 0)


@pytest.mark.parametrize(
    ("attention", "dtype_name", "prompt", "batch", "mode"),
    [("sdpa", "float32", 200, 1, "greedy"), ("eager", "bfloat16", 300, 2, "greedy"),
     ("sdpa", "bfloat16", 64, 2, "sample"), ("sdpa", "float32", 128, 2, "forward")],
)
def test_estimate_covers_the_profiled_cpu_peak(attention: str, dtype_name: str, prompt: int, batch: int, mode: str) -> None:
    """What tests/benchmarks/bench_peak_memory.py measures, on a tiny Qwen2 with a real-sized vocabulary."""
    torch = pytest.importorskip("torch")
    bench = pytest.importorskip("tests.benchmarks.bench_peak_memory")
    model = tiny_qwen2(getattr(torch, dtype_name), vocab_size=32_000, intermediate_size=256,
                       attn_implementation=attention)
    case = bench.Case("tiny", dtype_name, attention, prompt, batch, mode)
    bench.request(model, case, "cpu")()  # lazy set-up on the first call is not per request
    peak = bench.cpu_peak_bytes(bench.request(model, case, "cpu"))
    estimate = bench.estimate_bytes(model, case)
    assert peak > 0
    assert peak <= estimate <= 2 * peak, (peak, estimate)


def test_padded_batches_pay_for_the_sdpa_mask() -> None:
    sdpa = AnalyticEstimator.from_config(QWEN2_1_5B)
    unpadded = AnalyticEstimator.from_config(QWEN2_1_5B, padding=False)
    assert sdpa.prefill_workspace_bytes(1_000) == unpadded.prefill_workspace_bytes(1_000)  # one row: no padding
    assert sdpa.prefill_workspace_bytes(1_000, 3) - unpadded.prefill_workspace_bytes(1_000, 3) == 3 * 1_000**2 * (1 + 2)
    boolean = AnalyticEstimator.from_config(QWEN2_1_5B, additive_mask=False)  # CPU: the mask stays boolean
    assert boolean.prefill_workspace_bytes(1_000, 3) - unpadded.prefill_workspace_bytes(1_000, 3) == 3 * 1_000**2
    for attention in ("eager", "flash"):  # eager always counts its mask; flash kernels take none
        a, b = (AnalyticEstimator.from_config(QWEN2_1_5B, attention=attention, padding=p) for p in (True, False))
        assert a.estimate(1_000, 10, 3) == b.estimate(1_000, 10, 3)


def test_a_left_padded_batch_allocates_the_mask_the_estimate_counts() -> None:
    torch = pytest.importorskip("torch")
    bench = pytest.importorskip("tests.benchmarks.bench_peak_memory")
    model = tiny_qwen2(torch.float32, vocab_size=32_000, intermediate_size=256)
    prompt, batch = 512, 2
    peaks = {}
    for padded in (False, True):
        case = bench.Case("tiny", "float32", "sdpa", prompt, batch, "greedy", padded=padded)
        bench.request(model, case, "cpu")()
        peaks[padded] = bench.cpu_peak_bytes(bench.request(model, case, "cpu"))
        assert peaks[padded] <= bench.estimate_bytes(model, case) <= 2 * peaks[padded]
    # The CPU kernel takes the boolean prompt x prompt mask per row as it is (plus a few small buffers).
    extra = peaks[True] - peaks[False]
    assert batch * prompt * prompt <= extra <= 1.1 * batch * prompt * prompt
    mask_term = AnalyticEstimator.from_config(model.config, dtype=torch.float32, additive_mask=False)
    no_mask = AnalyticEstimator.from_config(model.config, dtype=torch.float32, padding=False)
    assert mask_term.estimate(prompt, 8, batch) - no_mask.estimate(prompt, 8, batch) == batch * prompt * prompt


async def test_the_middleware_estimates_a_greedy_request_as_greedy() -> None:
    # The body says how it decodes (temperature 0 / do_sample false): the estimate follows it,
    # and a request that does not say gets the estimator's default (sampling).
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from gpu_asgi import GPUAdmissionMiddleware, Ledger, gpu_bound

    from ._asgi import Words, client

    estimator = AnalyticEstimator.from_config(QWEN2_1_5B)

    @gpu_bound()
    async def generate(request: Request) -> JSONResponse:
        await request.body()
        admission = request.state.gpu_admission
        return JSONResponse({"bytes": admission.estimated_bytes, "sampling": admission.sampling})

    app = Starlette(routes=[Route("/generate", generate, methods=["POST"])])
    app.add_middleware(GPUAdmissionMiddleware, ledger=Ledger({"cpu": 1 << 40}), estimator=estimator, token_counter=Words())
    async with client(app) as http:
        answers = [
            (await http.post("/generate", json={"prompt": "a b c", "max_new_tokens": 8, **fields})).json()
            for fields in ({}, {"temperature": 0}, {"do_sample": False}, {"temperature": 0.7})
        ]
    sampled, greedy = estimator.estimate(3, 8), estimator.estimate(3, 8, sampling=False)
    assert greedy < sampled
    assert answers == [
        {"bytes": sampled, "sampling": None},
        {"bytes": greedy, "sampling": False},
        {"bytes": greedy, "sampling": False},
        {"bytes": sampled, "sampling": True},
    ]


def test_an_estimator_of_the_first_documented_shape_is_wrapped_and_not_passed_sampling() -> None:
    from gpu_asgi import CalibratedEstimator, GPUAdmissionMiddleware, Ledger, PeakCalibration, RouteSpec

    class Old:  # estimate(prompt_tokens, max_new_tokens, batch): no sampling=
        def estimate(self, prompt_tokens: int, max_new_tokens: int, batch: int = 1) -> int:
            return 7 * batch * (prompt_tokens + max_new_tokens)

    class Flexible:
        def estimate(self, prompt_tokens: int, max_new_tokens: int, batch: int = 1, **options: Any) -> int:
            return 1

    middleware = GPUAdmissionMiddleware(lambda *a: None, ledger=Ledger({"cpu": 10}), estimator=Old())  # type: ignore[arg-type]
    assert middleware.estimator.estimate(2, 3, 2, sampling=True) == 70
    spec = RouteSpec(estimator=Old())  # type: ignore[arg-type]
    assert spec.estimator is not None and spec.estimator.estimate(1, 1, sampling=False) == 14
    calibrated = CalibratedEstimator(Old(), PeakCalibration())  # type: ignore[arg-type]
    assert calibrated.estimate(1, 1, sampling=None) == 14
    with pytest.raises(TypeError, match="not an Estimator"):
        RouteSpec(estimator=object())  # type: ignore[arg-type]
    flexible, linear = Flexible(), LinearEstimator(bytes_per_token=1)
    assert RouteSpec(estimator=flexible).estimator is flexible  # taken as it is: it accepts sampling=
    assert RouteSpec(estimator=linear).estimator is linear
