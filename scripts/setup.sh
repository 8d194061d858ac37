#!/usr/bin/env bash
# Set up .venv for ffpa-attn on a fresh machine (idempotent). Reuses a torch that is already installed
# system-wide (e.g. a CUDA build on a GPU box); otherwise installs the CPU torch 2.13.0. Extras: $FFPA_EXTRAS
# (default "ci": tests, bench, and the CuTeDSL / NVRTC packages the CPU compile checks need).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv --system-site-packages .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
if ! python -c "import torch" >/dev/null 2>&1; then
  python -m pip install -q "torch==2.13.0"
fi
python -m pip install -q -e ".[${FFPA_EXTRAS:-ci}]"
python -c "import torch, triton, ffpa_attn; print('ffpa-attn', ffpa_attn.__version__, '| torch', torch.__version__, '| triton', triton.__version__)"
