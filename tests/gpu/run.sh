#!/usr/bin/env bash
# The GPU checks in one call, for a machine with a CUDA device and no network:
#
#     bash tests/gpu/run.sh        # from anywhere; results in $OUT (default reports/gpu/)
#
# The machine's python3 (3.12) has torch, transformers, tokenizers, tiktoken, nvidia-ml-py, httpx and
# the rest of tests/gpu/wheels.txt's header; everything else the demo and gpu_asgi need comes as
# wheels carried in .gpu-wheels/ (made by tests/gpu/download_wheels.sh), installed into /tmp/site.
# Then, each step under its own timeout so that one hang cannot eat the others:
#   (a) tests/gpu/check_gpu.py without the demo      -> $OUT/check_gpu.json
#   (c) tests/gpu/check_gpu.py --only imports,demo   -> $OUT/check_demo.json, $OUT/demo.log
#   (b) tests.benchmarks.bench_peak_memory --device cuda, with no case started after the time left
#                                                     -> $OUT/bench_peak_memory.json
# Everything printed is also in $OUT/run.log. The whole run stays under 7 minutes: BUDGET seconds
# for the steps, then a summary. GPU_CHECK_DEVICE=cpu is the dry run on a machine without a GPU
# (there, GPU_CHECK_INSTALL=0 skips the wheels when python3 is a venv that has them all already).
set -uo pipefail  # no -e: a failed step must not stop the others
cd "$(dirname "$0")/../.."
OUT=${OUT:-reports/gpu}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
BUDGET=${GPU_CHECK_BUDGET:-390}
SITE=${GPU_CHECK_SITE:-/tmp/site}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
export OUT SITE

STEPS=()
step() {  # step NAME SECONDS COMMAND...: run it under a timeout, note its exit status
    local name=$1 limit=$2 start=$SECONDS rc
    shift 2
    echo "=== $name (at ${SECONDS} s, limit ${limit} s)"
    if declare -F "$1" >/dev/null; then  # a function of this script: in a bash of its own
        timeout -k 5 "$limit" bash -c "$(declare -f "$1"); $1"
    else
        timeout -k 5 "$limit" "$@"
    fi
    rc=$?
    [ "$rc" -eq 124 ] && echo "=== $name: TIMED OUT after $limit s"
    echo "=== $name: exit $rc after $((SECONDS - start)) s"
    STEPS+=("$name=$rc")
}

install_wheels() {
    rm -rf "$SITE"
    if ! python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$SITE" .gpu-wheels/*.whl; then
        echo "pip install failed: unpacking the wheels instead"
        python3 - "$SITE" .gpu-wheels/*.whl <<'EOF'
import sys, zipfile
for wheel in sys.argv[2:]:
    zipfile.ZipFile(wheel).extractall(sys.argv[1])
EOF
    fi
    # pydantic needs typing-extensions >= 4.16: if the machine's is older, the carried one goes first.
    if ! PYTHONPATH="$SITE" python3 -c '
import importlib.metadata as m, sys
from packaging.version import Version
sys.exit(Version(m.version("typing_extensions")) < Version("4.16.0"))'; then
        echo "typing-extensions older than 4.16.0 (or absent): installing the carried one"
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$SITE" .gpu-wheels/fallback/*.whl \
            || python3 -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' \
                "$SITE" .gpu-wheels/fallback/*.whl
    fi
    ls "$SITE" | grep -c 'dist-info$' | sed 's/^/dist-infos in site: /'
}

environment() {
    python3 - <<'EOF'
import platform, sys, time
started = time.perf_counter()
import torch, transformers
print(f"python {sys.version.split()[0]} ({sys.executable}) on {platform.platform()}")
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}), "
      f"transformers {transformers.__version__}; imported in {time.perf_counter() - started:.1f} s")
if torch.cuda.is_available():
    props = torch.cuda.get_device_properties(0)
    free, total = torch.cuda.mem_get_info(0)
    print(f"cuda:0 {props.name}, capability {props.major}.{props.minor}, {props.multi_processor_count} SMs, "
          f"{total / 2**20:.0f} MiB total, {free / 2**20:.0f} MiB free; {torch.cuda.device_count()} device(s)")
else:
    print("torch sees no CUDA device")
EOF
}

summary() {
    python3 - "$OUT" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for name in ("check_gpu.json", "check_demo.json"):
    path = out / name
    if not path.exists():
        print(f"{name}: missing")
        continue
    report = json.loads(path.read_text())
    checks = report.get("checks", {})
    print(f"{name}: {report.get('device_name')} ({report.get('mode')}), finished {report.get('finished')}: "
          + ", ".join(f"{k} {v.get('status')} ({v.get('seconds')} s)" for k, v in checks.items()))
    peaks = checks.get("peaks", {}).get("shapes", [])
    if peaks:
        print("  peaks (estimate/peak): " + ", ".join(f"{s['prompt']}+{s['new']}: {s['ratio']}" for s in peaks))
    calibrated = checks.get("calibrate", {})
    if "bytes_per_token" in calibrated:
        print(f"  calibrate: {calibrated['bytes_per_token']} B/token + {calibrated['fixed_bytes']} B fixed")
    measured = checks.get("run_measured", {})
    if "allocate_and_drop_peak_bytes" in measured:
        print(f"  run_measured: 256 MiB -> {measured['allocate_and_drop_peak_bytes']} B, idle -> "
              f"{measured['idle_peak_bytes']} B")
    demo = checks.get("demo", {})
    if demo:
        print(f"  demo: ready {demo.get('ready_seconds')} s, budget {demo.get('budget_bytes')} B "
              f"(expected {demo.get('expected_budget_bytes')}), concurrent {demo.get('concurrent', {}).get('seconds')} s, "
              f"exit {demo.get('exit_code')} in {demo.get('shutdown_seconds')} s")
    for failure in report.get("failures", []):
        print(f"  FAIL {failure[:400]}")
bench = out / "bench_peak_memory.json"
if bench.exists():
    report = json.loads(bench.read_text())
    cases = report.get("cases", [])
    bad = [c for c in cases if not c.get("within_bars")]
    print(f"bench_peak_memory.json: {len(cases)} cases, {len(bad)} outside the bars, complete {report.get('complete')}, "
          f"{len(report.get('skipped_for_time', []))} skipped for time, {report.get('wall_seconds')} s")
    for c in bad[:12]:
        print(f"  outside: {c['shape']} {c['dtype']} {c['attention']} prompt {c['prompt']} batch {c['batch']} "
              f"{c['mode']}{' padded' if c.get('padded') else ''}: peak {c['peak_bytes']} estimate {c['estimate_bytes']} "
              f"ratio {c['ratio']:.3f}")
else:
    print("bench_peak_memory.json: missing")
EOF
}

main() {
    echo "run.sh: $(date -u +%FT%TZ), device $DEVICE, OUT=$OUT, budget ${BUDGET} s"
    if [ "${GPU_CHECK_INSTALL:-1}" = 1 ]; then
        step "install wheels" 45 install_wheels
    else
        echo "=== install wheels: skipped (GPU_CHECK_INSTALL=0: python3's own packages)"
    fi
    export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 \
        TOKENIZERS_PARALLELISM=false
    if [ "$DEVICE" = cuda ]; then
        step "nvidia-smi" 10 nvidia-smi
    fi
    step "versions" 40 environment
    step "(a) check_gpu" 100 python3 tests/gpu/check_gpu.py --skip demo --json "$OUT/check_gpu.json"
    step "(c) demo" 120 python3 tests/gpu/check_gpu.py --only imports,demo --json "$OUT/check_demo.json" \
        --demo-log "$OUT/demo.log"
    local left=$((BUDGET - SECONDS - 5)) args=(--device "$DEVICE")
    [ "$DEVICE" = cpu ] && args+=(--quick)
    [ "$left" -gt 200 ] && left=200
    if [ "$left" -ge 45 ]; then
        step "(b) bench_peak_memory" "$left" python3 tests/gpu/bench_peak.py --deadline $((left - 35)) \
            --out "$OUT/bench_peak_memory.json" -- "${args[@]}"
    else
        echo "=== (b) bench_peak_memory: skipped, only $left s left"
        STEPS+=("(b) bench_peak_memory=skipped")
    fi
    echo "=== summary (at ${SECONDS} s)"
    timeout -k 5 20 bash -c "$(declare -f summary); summary"
    printf '%s\n' "${STEPS[@]}"
    ls -l "$OUT"
    echo "run.sh: done in ${SECONDS} s"
    local entry
    for entry in "${STEPS[@]}"; do
        [ "${entry##*=}" = 0 ] || return 1
    done
}

main 2>&1 | tee "$OUT/run.log"
exit "${PIPESTATUS[0]}"
