#!/usr/bin/env bash
# Fills .gpu-wheels/ (git-ignored; carried to the GPU machine, which has no network) with the wheels
# of tests/gpu/wheels.txt for CPython 3.12 on manylinux x86-64, and .gpu-wheels/fallback/ with
# typing-extensions, which run.sh installs only if the machine's own is older than pydantic needs.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
rm -rf .gpu-wheels
mkdir -p .gpu-wheels/fallback
download() {
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 "$@" 2> >(grep -v '^WARNING: Location' >&2)
}
download -d .gpu-wheels -r tests/gpu/wheels.txt
download -d .gpu-wheels/fallback typing-extensions==4.16.0
ls -l .gpu-wheels .gpu-wheels/fallback
du -sh .gpu-wheels
