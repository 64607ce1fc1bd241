#!/usr/bin/env bash
# Issue 26's GPU measurements in one call (about 7 minutes on an H100/H200), most
# important first: where a round's time goes through Ray and in process (the
# cifar10_pfl cnn and resnet18_gn, one worker, groups auto); sweep throughput of
# 1/2/4/8 concurrent cnn trials on the one GPU; the GPU tests; the cifar10_pfl
# workload's steady clients/s through Ray (30 rounds) and its in-process training
# rate; the server's ceiling. Every step has its own time limit (their sum stays
# under 10 minutes) and prints raw output, also copied to $OUT/<step>.log when OUT
# is set. Run from the repository root with Ray and dp-accounting importable:
#   bash benchmarks/gpu_round_and_sweep.sh
set -u
export RAY_USAGE_STATS_ENABLED=0 PYTHONUNBUFFERED=1
out=${OUT:-/tmp/gpu_round_and_sweep}
mkdir -p "$out"
step() {  # step NAME SECONDS COMMAND...: run with a limit, output to the terminal and a log
  local name=$1 limit=$2
  shift 2
  echo "=== $name (limit ${limit} s) ==="
  local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | grep -v -E "^\(raylet\)|WARNING: All log messages" | tee "$out/$name.log"
  echo "=== $name: rc ${PIPESTATUS[0]}, ${SECONDS}-${t0} = $((SECONDS - t0)) s ==="
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python -c "import torch, ray; print('torch', torch.__version__, 'ray', ray.__version__)"
step phases 170 python benchmarks/round_phases.py --workload cifar10_pfl resnet18_gn \
  --rounds 6 --workers 1
step sweep 140 python benchmarks/sweep_gpu.py --trials 1 2 4 8 --rounds 20
step gputests 100 python -m pytest -q -m gpu -rA -p no:cacheprovider tests
step scaling 60 python benchmarks/gpu_scaling.py --workloads cifar10_pfl --workers-per-gpu 1 \
  --groups auto --rounds 30
step vectorized 45 python benchmarks/gpu_vectorized.py --models cifar10_pfl --groups 1,50 \
  --cohort 50 --repeats 3
step ceiling 35 python benchmarks/server_ceiling.py --rounds 3
