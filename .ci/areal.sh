#!/usr/bin/env bash
# CI step: AReaL's rollout engine over the fabric (transport.areal) against the real
# areal package from PyPI. Its own venv, so the base install stays light: areal 1.0.x
# pins torch<2.11 and pulls agent frameworks, so it is installed without its dependency
# tree, after the `areal` extra (the packages its rollout modules import).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
VENV=${AREAL_VENV:-.venv-areal}

[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/pip" install -c constraints.txt -e '.[test,areal]'
"$VENV/bin/pip" install -c constraints.txt --no-deps areal==1.0.4
# A broken install must fail here, not turn the tests into skips.
"$VENV/bin/python" -c "
import areal, areal.api.io_struct, areal.api.engine_api, areal.api.workflow_api
import areal.workflow.rlvr, areal.infra.remote_inf_engine, torch
print('areal', areal.__version__, 'beside torch', torch.__version__)
"
"$VENV/bin/python" -m pytest tests/transport/areal/test_areal.py -q
