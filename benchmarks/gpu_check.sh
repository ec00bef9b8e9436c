#!/usr/bin/env bash
# The prepared device check for one NVIDIA GPU (H100 / H200): prints ONE table, in under 8 minutes.
#   bash benchmarks/gpu_check.sh            # from the repository root or anywhere
# Rows and tolerances: benchmarks/gpu_check.py. A copy of the output: $GPU_CHECK_LOG (/tmp/gpu_check.log).
#
# It runs from the source tree, so the GPU machine needs the package's dependencies
# (`pip install -e .` after JAX for CUDA). On a machine that cannot reach PyPI, put wheels of the
# missing pure-Python ones in .whl/ beside this repository's files and they are installed first,
# e.g. beartype, which a CUDA image with JAX, equinox and jaxtyping may lack:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl beartype==0.23.1
set -o pipefail
cd "$(dirname "$0")/.." || exit 2
PY=${PYTHON:-$(command -v python3 || command -v python)}
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/gpu_check_site .whl/*.whl || exit 2
    export PYTHONPATH="/tmp/gpu_check_site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# Every module the rows import, before any GPU time is spent: one line naming what is missing.
# bench.py imports most of them inside its functions (the optimizer's optax among them), so
# they are named here one by one (tests/test_gpu_check.py checks the list against both scripts).
"$PY" -c "import olmo3.attention, olmo3.model, olmo3.splash_gpu, olmo3.splash, olmo3.optim, olmo3.schedules, \
olmo3.sharding, olmo3.metrics, olmo3.logs, olmo3.cluster, olmo3.runtime, olmo3.cli, benchmarks.bench, benchmarks.gpu_check" || {
    echo "gpu_check: the imports above failed; install the package's dependencies (pip install -e .) or put their wheels in .whl/" >&2
    exit 2; }
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
# 455 s + the start-up above (~10 s) + the table: under 8 minutes. SIGTERM stops the part that is
# running and prints the table of the rows that finished; -k: SIGKILL 10 s later if anything hangs,
# so even then the whole check ends inside 8 minutes.
timeout -k 10 455 "$PY" benchmarks/gpu_check.py "$@" 2>&1 | tee "${GPU_CHECK_LOG:-/tmp/gpu_check.log}"
