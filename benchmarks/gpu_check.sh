#!/usr/bin/env bash
# The prepared device check for one NVIDIA GPU (H100 / H200): prints ONE table, in under 8 minutes.
#   bash benchmarks/gpu_check.sh            # from the repository root or anywhere
# Rows and tolerances: benchmarks/gpu_check.py. A copy of the output: $GPU_CHECK_LOG (/tmp/gpu_check.log).
set -o pipefail
cd "$(dirname "$0")/.." || exit 2
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" timeout 475 python benchmarks/gpu_check.py "$@" 2>&1 | tee "${GPU_CHECK_LOG:-/tmp/gpu_check.log}"
