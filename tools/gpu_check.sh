#!/usr/bin/env bash
# GPU smoke check of every mode and shard level on CUDA tensors (see tools/gpu_check.py).
# Runs from the checkout without installing parlay; installs nothing.
#   tools/gpu_check.sh [--cpu] [--only TEXT]
# Exit status: 0 nothing failed (or no CUDA device without --cpu), 1 a check failed.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" tools/gpu_check.py "$@"
