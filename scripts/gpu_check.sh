#!/usr/bin/env bash
# GPU check: one verdict line per step, for the lent GPU machine's single call.
#
#   bash scripts/gpu_check.sh          # from anywhere; results in $OUT (default: a new /tmp folder)
#
# Steps, each in a process of its own with its own timeout (the smoke and the rule checks first,
# so that a timeout still leaves a verdict on what matters most):
#   gate    nvidia-smi, Python, torch and CUDA versions; "FAIL gate: no CUDA device" and exit 1 at once without CUDA
#   smoke   scripts/gpu_smoke.py: the platform's riskiest paths against eager (60 s)
#   rules   tests/platforms/test_cuda_double.py -m cuda: the CPU double's rules on this GPU and torch
#   cuda    tests/gpu/test_cuda.py -m cuda
#   memory  tests/capture/test_memory.py -m cuda
#   kvhf    tests/kv/test_kv.py tests/attention/test_attention.py tests/hf/test_hf.py tests/spec/test_spec.py tests/ubatch/test_ubatch.py tests/ubatch/test_ubatch_cuda.py -m cuda
#   twins   tests/platforms/test_sim_rules.py tests/core/test_inputs.py -m cuda: the simulator's rules, on a real graph
#   example examples/hf_generate.py --arch llama --check, then examples/spec_decode.py --check
#   nccl    with 2+ GPUs only: tensor_parallel.py and moe_dbo.py --check, bench_dbo.py on NCCL
#   attnbench  benchmarks/bench_attention.py --device cuda --quick: decode step and memory vs max_model_len (90 s)
#   hfbench    benchmarks/bench_hf_throughput.py --device cuda --quick: decode tokens/s of HFEngine FULL graphs vs
#              transformers' generate_batch vs generate (120 s); both tables go to steps.log only
#   servebench benchmarks/bench_serving.py --device cuda --quick: time to first token, lazy_capture vs up-front
#              capture, and decode tokens/s after capture_idle vs a full capture (150 s); tables to steps.log
#   bench   benchmarks/run.py --cuda (what time is left), written to $OUT/benchmarks.md
# Each step prints "PASS|FAIL|TIMEOUT <step> (<seconds> s)"; a table of them ends the run and
# $OUT/summary.txt; the exit status is 1 if any step did not pass. Files under $OUT (8 at most):
# summary.txt, steps.log (every step's output, appended as it runs), junit_<step>.xml for the
# five pytest steps, benchmarks.md. Wheels in .whl/ (e.g. expecttest) are installed first, offline.
# The whole run stays under GPU_CHECK_SECONDS (default 450).
set -u
cd "$(dirname "$0")/.."
ROOT="$PWD"
PY="${PYTHON:-python3}"
OUT="${OUT:-$(mktemp -d /tmp/gpu_check.XXXXXX)}"
mkdir -p "$OUT"
TOTAL="${GPU_CHECK_SECONDS:-450}"
START=$(date +%s)
SUMMARY="$OUT/summary.txt"
LOG="$OUT/steps.log"
: >"$SUMMARY"
: >"$LOG"
export PYTHONPATH="$ROOT/src:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
say() { echo "$*" | tee -a "$SUMMARY"; }
left() { echo $(( TOTAL - ($(date +%s) - START) )); }

# ---- gate: versions, and no CUDA means no verdict worth having
say "== gpu_check $(date -u '+%Y-%m-%d %H:%M UTC'), results in $OUT"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | sed 's/^/nvidia-smi: /' | tee -a "$SUMMARY"
else
  say "nvidia-smi: not found"
fi
GATE=$(timeout 60 "$PY" - 2>&1 <<'EOF'
import sys
import torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("gpu", torch.cuda.get_device_name(), "| count", torch.cuda.device_count())
sys.exit(0 if torch.cuda.is_available() else 3)
EOF
)
GATE_RC=$?
say "$GATE"
if [ "${GPU_CHECK_DRY_RUN:-0}" = 1 ]; then  # to check this script's own machinery on a CPU: every verdict is void
  say "DRY RUN: gate bypassed without CUDA; the verdicts below say nothing about a GPU"
elif [ "$GATE_RC" != 0 ]; then
  say "FAIL gate: no CUDA device"
  exit 1
fi
say "PASS gate ($(( $(date +%s) - START )) s)"

if ls .whl/*.whl >/dev/null 2>&1; then  # carried wheels (expecttest...), installed without the network
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/gpu_check_site .whl/*.whl >>"$LOG" 2>&1 \
    && export PYTHONPATH="$PYTHONPATH:/tmp/gpu_check_site"
fi

VERDICTS=()
FAILED=0
# step NAME LIMIT_S COMMAND...: run with a timeout (the smaller of LIMIT_S and what is left),
# its output appended to steps.log as it runs, one verdict line
step() {
  local name="$1" limit="$2" budget rc t0 verdict
  shift 2
  budget=$(left)
  budget=$(( budget - 10 ))
  [ "$budget" -lt "$limit" ] && limit="$budget"
  if [ "$limit" -lt 15 ]; then
    verdict="TIMEOUT $name (0 s, no time left)"
    FAILED=1
  else
    echo "===== $name (limit $limit s): $*" >>"$LOG"
    t0=$(date +%s)
    timeout -k 10 "$limit" "$@" >>"$LOG" 2>&1
    rc=$?
    if [ "$rc" = 0 ]; then verdict="PASS"; elif [ "$rc" = 124 ] || [ "$rc" = 137 ]; then verdict="TIMEOUT"; else verdict="FAIL"; fi
    [ "$rc" = 0 ] || FAILED=1
    verdict="$verdict $name ($(( $(date +%s) - t0 )) s)"
    echo "===== $verdict (exit status $rc)" >>"$LOG"
  fi
  VERDICTS+=("$verdict")
  say "$verdict"
}
pytest_step() {  # pytest_step NAME LIMIT_S FILES...: -m cuda, faulthandler dumps a hung test's stacks
  local name="$1" limit="$2"
  shift 2
  step "$name" "$limit" "$PY" -m pytest -m cuda -q -rfEs -p no:cacheprovider -o "faulthandler_timeout=$(( limit - 5 ))" \
    --junitxml="$OUT/junit_$name.xml" "$@"
}

step smoke 60 "$PY" scripts/gpu_smoke.py
pytest_step rules 60 tests/platforms/test_cuda_double.py
pytest_step cuda 120 tests/gpu/test_cuda.py
pytest_step memory 40 tests/capture/test_memory.py
pytest_step kvhf 90 tests/kv/test_kv.py tests/attention/test_attention.py tests/hf/test_hf.py tests/spec/test_spec.py tests/ubatch/test_ubatch.py tests/ubatch/test_ubatch_cuda.py
pytest_step twins 40 tests/platforms/test_sim_rules.py tests/core/test_inputs.py
step example 45 "$PY" examples/hf_generate.py --arch llama --check
step spec 45 "$PY" examples/spec_decode.py --arch llama --num-speculative-tokens 2 --check
if "$PY" -c "import sys, torch; sys.exit(torch.cuda.device_count() < 2)" 2>/dev/null; then
  step nccl 150 bash -c "'$PY' -m torch.distributed.run --standalone --nproc-per-node 2 examples/tensor_parallel.py --check --steps 8 \
    && '$PY' -m torch.distributed.run --standalone --nproc-per-node 2 examples/moe_dbo.py --check --steps 8 \
    && '$PY' benchmarks/bench_dbo.py --quick --backend nccl"
else
  say "     nccl: not run (needs 2+ GPUs)"
fi
step attnbench 90 "$PY" -m benchmarks.bench_attention --device cuda --quick
step hfbench 120 "$PY" -m benchmarks.bench_hf_throughput --device cuda --quick
step servebench 150 "$PY" -m benchmarks.bench_serving --device cuda --quick
BENCH=$(( $(left) - 20 ))
step bench "$BENCH" "$PY" benchmarks/run.py --cuda --budget "$(( BENCH > 60 ? BENCH - 40 : 20 ))" --out "$OUT/benchmarks.md"

say "== verdicts ($(( $(date +%s) - START )) s in all)"
for v in "${VERDICTS[@]}"; do say "  $v"; done
exit "$FAILED"
