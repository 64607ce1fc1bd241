#!/usr/bin/env bash
# Issue 26's GPU measurements in one call (about 8 minutes on an H100/H200): where a
# round's time goes through Ray and in process (the cifar10_pfl cnn, resnet18_gn; one worker), sweep
# throughput of 1/2/4/8 concurrent cnn trials on the one GPU, and the server's ceiling.
# Prints raw output only; run from the repository root with Ray and dp-accounting
# installed: bash benchmarks/gpu_round_and_sweep.sh
set -u
export RAY_USAGE_STATS_ENABLED=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python -c "import torch, ray; print('torch', torch.__version__, 'ray', ray.__version__)"
timeout 240 python benchmarks/round_phases.py --workload cifar10_pfl resnet18_gn --rounds 5 --workers 1
timeout 200 python benchmarks/sweep_gpu.py --trials 1 2 4 8 --rounds 20
timeout 60 python benchmarks/server_ceiling.py --rounds 3
