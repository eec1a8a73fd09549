#!/usr/bin/env bash
# Everything a session with a GPU should run, in one device call (see the device tool's README):
#   run(command="bash benchmarks/gpu_session.sh", timeout_s=600)
# The device image already has torch, transformers, accelerate, safetensors, pytest and
# hypothesis; nothing needs carrying. SmolLM2's GGUF cannot travel (98 MB > 64 MiB), so the CUDA
# tests use a seeded checkpoint of its shape there. Logs and result JSON come back in $OUT.
set -uo pipefail
out=${OUT:-/tmp/offload-gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -m pytest -m cuda tests/cuda -q -p no:cacheprovider 2>&1 | tee "$out/cuda-tests.log"
python3 benchmarks/prefetch_step.py --device cuda --shape llama-3-8b --seq 1 512 4096 --step 2 2>&1 | tee "$out/prefetch-step.log"
cp benchmarks/results/*-cuda-*.json "$out/" 2>/dev/null
exit 0
