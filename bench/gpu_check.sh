#!/usr/bin/env bash
# One prepared device check, for a session that is lent a GPU machine (see README,
# "Benchmarks"): the CUDA tests and the GPU weight-update benchmark, results under $OUT.
#
#   here, once:        bash bench/gpu_check.sh --fetch     (wheels the device lacks -> .whl/)
#   on the device:     device run, carry [".whl"], command "bash bench/gpu_check.sh",
#                      timeout_s 400 (the script stays under 6 minutes); then commit
#                      $OUT's files to bench/results/gpu/.
#
# The device's python3 (3.12) holds torch with CUDA, numpy, pillow, safetensors, rich,
# xxhash and pytest; msgspec and pyzmq travel as wheels. Nothing can be fetched there.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--fetch" ]; then
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
    exec python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl msgspec==0.23.0 pyzmq==27.3.0
fi
OUT=${OUT:-/tmp/fastio-gpu}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
{
    nvidia-smi -L
    python3 -c "import torch, msgspec, zmq; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'msgspec', msgspec.__version__, 'pyzmq', zmq.__version__)"
} 2>&1 | tee "$OUT/device.txt"
# CUDA tests (150 s at most): the codec's device tensors, weight updates between CUDA
# tensors, the ipc path over CUDA IPC, pinned staging, and the process-group path on one
# GPU (two ranks on one device refused; the gloo test stays on gloo).
timeout 150 python3 -m pytest -q -p no:cacheprovider -k "cuda or one_gpu or gloo_broadcast" \
    tests/fastio/test_cuda.py tests/transport/weights/drivers/test_publish.py \
    tests/transport/weights/routes/test_ipc.py tests/transport/weights/test_dist.py \
    2>&1 | tee "$OUT/cuda-tests.log"
tests_rc=${PIPESTATUS[0]}
# The GPU suite (bench.weights.gpu_suite: ipc with 1 and 2 workers, pinned staging, floors,
# raw CUDA IPC baseline; 184 MiB, 1 GiB, 8 GiB), 190 s at most: no new size starts after
# 130 s. Rows: $OUT/weights-gpu.jsonl (commit it to bench/results/gpu/).
timeout 190 python3 -m bench.weights --gpu-only --out "$OUT" --budget 130 2>&1 | tee "$OUT/gpu-weights.log"
echo "cuda tests rc=$tests_rc, gpu bench rc=${PIPESTATUS[0]}" | tee -a "$OUT/device.txt"
