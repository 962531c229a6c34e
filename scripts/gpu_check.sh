#!/usr/bin/env bash
# GPU check: one verdict line per step, for the lent GPU machine's single call.
#
#   bash scripts/gpu_check.sh --plan   # any machine, first: setup, backend by name, each step's budget and tests
#   bash scripts/gpu_check.sh          # on the GPU: the gate, then every step; results in $OUT
#
# The steps, their order and their budgets are in scripts/gpu_steps.py (how to add one is there);
# the runner is scripts/gpu_check.py (what the gate sets up, the environment it reads, the files
# it leaves in $OUT). The whole run stays under GPU_CHECK_SECONDS (default 480); the exit status
# is 1 unless every step passed (for --plan: unless the plan fits and every pytest step has tests).
set -u
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" scripts/gpu_check.py "$@"
