#!/usr/bin/env bash
# GPU check: the CUDA-marked tests and the CUDA benchmarks, results into docs/benchmarks.md.
#
#   bash scripts/gpu_check.sh [DOC]        # from anywhere; DOC defaults to docs/benchmarks.md
#
# For a CUDA machine with torch (2.11+) and pytest already installed: installs nothing from
# the network (the package itself goes in with pip --no-deps --no-build-isolation, else
# PYTHONPATH=src), and needs no expecttest (only the -m cuda tests of tests/test_cuda_double.py,
# test_cuda.py, test_memory.py, test_kv.py and test_hf.py run; test_hf.py and the HF example need
# transformers and say so when it is missing).
# Everything is bounded by `timeout` to finish within 8 minutes (GPU_CHECK_SECONDS).
# It rewrites the GPU section of DOC (date, torch, GPU, test summary, tables). When $OUT is
# set (the device runner's output folder), DOC and the logs are copied there too.
set -u
cd "$(dirname "$0")/.."
ROOT="$PWD"
PY="${PYTHON:-python}"
DOC="${1:-docs/benchmarks.md}"
TOTAL="${GPU_CHECK_SECONDS:-480}"
LOGS="$(mktemp -d /tmp/gpu_check.XXXXXX)"
START=$(date +%s)
left() { echo $(( TOTAL - ($(date +%s) - START) )); }
upto() { local l; l=$(left); [ "$l" -lt "$1" ] && echo $(( l > 10 ? l : 10 )) || echo "$1"; }  # a step's timeout: N s, or what is left
export PYTHONPATH="$ROOT/src:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

echo "== gpu_check: $(date -u '+%Y-%m-%d %H:%M UTC'), logs in $LOGS"
"$PY" - <<'EOF' 2>&1 | tee "$LOGS/env.log"
import sys, torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("gpu", torch.cuda.get_device_name(), "| count", torch.cuda.device_count())
EOF

echo "== install (no network, no deps)"
if timeout 90 "$PY" -m pip install --no-deps --no-build-isolation --no-index -e . >"$LOGS/pip.log" 2>&1; then
  echo "installed editable (entry point registered)"
else
  echo "pip install -e . failed (see $LOGS/pip.log); running from PYTHONPATH=src"
fi

echo "== CUDA tests (-m cuda: the CPU double's rules on this GPU, tests/test_cuda.py, graph memory, KV cache, HF)"
TEST_RC=0
if "$PY" -c "import pytest" 2>/dev/null; then
  # The rule checks leave the allocator as CUDA does after a failure: a process of their own.
  timeout -k 10 60 "$PY" -m pytest -m cuda -q -rfEs -p no:cacheprovider tests/test_cuda_double.py \
    2>&1 | tee "$LOGS/cuda_tests.log"
  RULES_RC=${PIPESTATUS[0]}
  timeout -k 10 "$(( $(left) / 3 ))" "$PY" -m pytest -m cuda -q -rfEs -p no:cacheprovider tests/test_cuda.py \
    2>&1 | tee -a "$LOGS/cuda_tests.log"
  TEST_RC=${PIPESTATUS[0]}
  [ "$TEST_RC" = 124 ] && echo "CUDA tests: killed by timeout" | tee -a "$LOGS/cuda_tests.log"
  # graph memory on the GPU, then the paged KV cache and the HF adapter (a step each, own timeout)
  timeout -k 10 "$(upto 60)" "$PY" -m pytest -m cuda -q -rfEs -p no:cacheprovider tests/test_memory.py \
    2>&1 | tee -a "$LOGS/cuda_tests.log"
  MEM_RC=${PIPESTATUS[0]}
  timeout -k 10 "$(upto 180)" "$PY" -m pytest -m cuda -q -rfEs -p no:cacheprovider tests/test_kv.py tests/test_hf.py tests/test_spec.py tests/test_ubatch.py \
    2>&1 | tee -a "$LOGS/cuda_tests.log"
  KVHF_RC=${PIPESTATUS[0]}
  for rc in $RULES_RC $MEM_RC $KVHF_RC; do [ "$TEST_RC" = 0 ] && TEST_RC=$rc; done
else
  TEST_RC=127
  echo "pytest is not installed: CUDA tests not run" | tee "$LOGS/cuda_tests.log"
fi
echo "pytest exit status $TEST_RC" >>"$LOGS/cuda_tests.log"

echo "== HF example on the GPU (greedy tokens checked against model.generate)"
timeout -k 10 "$(upto 90)" "$PY" examples/hf_generate.py --arch llama --check 2>&1 | tee "$LOGS/example.log"
EXAMPLE_RC=${PIPESTATUS[0]}
[ "$EXAMPLE_RC" = 124 ] && echo "example: killed by timeout" | tee -a "$LOGS/example.log"
[ "$TEST_RC" = 0 ] && TEST_RC=$EXAMPLE_RC
echo "== speculative decoding example on the GPU (target FULL verify graphs, drafter PIECEWISE)"
timeout -k 10 "$(upto 90)" "$PY" examples/spec_decode.py --arch llama --num-speculative-tokens 2 --check 2>&1 | tee -a "$LOGS/example.log"
SPEC_RC=${PIPESTATUS[0]}
[ "$TEST_RC" = 0 ] && TEST_RC=$SPEC_RC

if "$PY" -c "import sys, torch; sys.exit(torch.cuda.device_count() < 2)" 2>/dev/null; then echo "== tensor parallel example (NCCL, 2 GPUs)"; timeout -k 10 150 "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 examples/tensor_parallel.py --check --steps 8 2>&1 | tee "$LOGS/tp.log" ${OUT:+"$OUT/tp.log"}; echo "tensor parallel example exit status ${PIPESTATUS[0]}"; else echo "== tensor parallel example: skipped (needs >= 2 GPUs)"; fi

if "$PY" -c "import sys, torch; sys.exit(torch.cuda.device_count() < 2)" 2>/dev/null; then echo "== micro-batching: MoE example and step time (NCCL, 2 GPUs)"; timeout -k 10 150 "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 examples/moe_dbo.py --check --steps 8 2>&1 | tee "$LOGS/moe_dbo.log" ${OUT:+"$OUT/moe_dbo.log"}; echo "MoE micro-batching example exit status ${PIPESTATUS[0]}"; timeout -k 10 "$(upto 120)" "$PY" benchmarks/bench_dbo.py --quick --backend nccl 2>&1 | tee "$LOGS/bench_dbo.log" ${OUT:+"$OUT/bench_dbo.log"}; else echo "== micro-batching on NCCL: skipped (needs >= 2 GPUs)"; fi

echo "== CUDA benchmarks ($(left) s left)"
BUDGET=$(( $(left) - 30 ))
BENCH_RC=0
if [ "$BUDGET" -gt 60 ]; then
  # --budget cuts the timed loops short; `timeout` is the hard stop (the doc is rewritten
  # after each part, so a kill keeps the parts already measured).
  timeout -k 10 "$BUDGET" "$PY" benchmarks/run.py --cuda --budget "$(( BUDGET - 60 ))" --out "$DOC" \
    --pytest-log "$LOGS/cuda_tests.log" 2>&1 | tee "$LOGS/bench.log"
  BENCH_RC=${PIPESTATUS[0]}
  [ "$BENCH_RC" = 124 ] && echo "benchmarks: killed by timeout after ${BUDGET}s" | tee -a "$LOGS/bench.log"
else
  echo "no time left for the benchmarks" | tee "$LOGS/bench.log"
fi

[ "$(left)" -gt 60 ] && timeout -k 10 "$(( $(left) - 30 ))" "$PY" benchmarks/bench_memory.py --cuda --quick 2>&1 | tee -a "$LOGS/bench.log"  # graph memory: ladder vs largest, estimate (issue 11)

if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then
  cp "$DOC" "$OUT/benchmarks.md" 2>/dev/null
  for f in env pip cuda_tests example bench; do cp "$LOGS/$f.log" "$OUT/$f.log" 2>/dev/null; done
fi
echo "== done in $(( $(date +%s) - START )) s: tests rc=$TEST_RC, benchmarks rc=$BENCH_RC; results in $DOC"
[ "$TEST_RC" = 0 ] && [ "$BENCH_RC" = 0 ]
