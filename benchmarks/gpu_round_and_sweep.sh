#!/usr/bin/env bash
# Issue 26's GPU measurements in one call (about 8 minutes on an H100/H200), most
# important first: the seeded noise draw (block streams against torch's generator) on
# the host's CPU; where a round's time goes through Ray and in process (the cifar10_pfl
# cnn and resnet18_gn, one worker, groups auto) with the checkpoint and row written
# behind the next round (dpfl run's path) and in line (a Tune trial's path); the
# evaluation beside the next round's training, on and off (cifar10_pfl, every round
# evaluated); sweep throughput of 1/2/4/8 concurrent cnn trials on the one GPU; the
# GPU tests; the server's ceiling; the cifar10_pfl workload's steady clients/s through
# Ray. Every step has its own time limit (their sum stays under 9 minutes) and prints
# raw output, also copied to $OUT/<step>.log when OUT is set. Run from the repository
# root with Ray and dp-accounting importable:
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
  timeout "$limit" "$@" 2>&1 | grep -v -E "^\(raylet\)|WARNING: All log messages|authentication|core_worker.cc" | tee "$out/$name.log"
  echo "=== $name: rc ${PIPESTATUS[0]}, $((SECONDS - t0)) s ==="
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python -c "import torch, ray, os; print('torch', torch.__version__, 'ray', ray.__version__, 'cores', os.cpu_count())"
step noise 30 python - <<'PY'
import time, torch
from engine.privacy import rng
d = 11_173_962
def best(fn, n=3):
    ts = []
    for _ in range(n):
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
    return min(ts)
g = lambda: torch.randn(d, generator=rng.torch_gen(0, rng.NOISE, 1), dtype=torch.float64)
print(f"d = {d:,} float64 normals: torch CPU generator {best(g):.3f} s")
for k in (1, 2, 4, 8):
    s = rng.SeededStream(0, (rng.NOISE, 1))
    print(f"  block streams, {k} thread(s): {best(lambda: s.standard_normal(d, threads=k)):.3f} s")
print("NOISE_THREADS here:", rng.NOISE_THREADS)
PY
step phases 150 python -m benchmarks.round_phases --workload cifar10_pfl resnet18_gn \
  --rounds 6 --workers 1 --writes background sync
step eval_overlap 90 python -m benchmarks.eval_overlap --workload cifar10_pfl --workers 1 \
  --rounds 12 --every 1 --pairs 2
step sweep 130 python -m benchmarks.sweep_gpu --trials 1 2 4 8 --rounds 60
step gputests 60 python -m pytest -q -m gpu -rA -p no:cacheprovider tests
step ceiling 35 python -m benchmarks.server_ceiling --rounds 3
step scaling 50 python -m benchmarks.gpu_scaling --workloads cifar10_pfl --workers-per-gpu 1 \
  --groups auto --rounds 30
