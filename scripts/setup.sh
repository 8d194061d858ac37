#!/usr/bin/env bash
# Set up .venv for ffpa-attn on a fresh machine (idempotent). Reuses a torch that is already installed
# system-wide (e.g. a CUDA build on a GPU box); otherwise installs the CPU torch 2.13.0. Installs
# scripts/requirements-ci.txt (tests, bench, and the CuTeDSL / NVRTC packages the CPU compile checks need) under
# scripts/constraints.txt; $FFPA_EXTRAS (e.g. "test,bench") installs those extras of the package instead.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv --system-site-packages .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
if ! python -c "import torch" >/dev/null 2>&1; then
  python -m pip install -q "torch==2.13.0"  # the local CPU wheel of this machine class
fi
# the public ffpa-attn package (or this one installed under that former name) writes the same ffpa_attn folder:
# remove it from this environment before installing ours (pip does not know the two collide)
if python -m pip show --quiet ffpa-attn >/dev/null 2>&1; then
  echo "setup: uninstalling the distribution ffpa-attn (it installs the same ffpa_attn package as ffpa-attn-kernels)"
  python -m pip uninstall -q -y ffpa-attn || true
fi
if [ -n "${FFPA_EXTRAS:-}" ]; then
  python -m pip install -q -c scripts/constraints.txt -e ".[${FFPA_EXTRAS}]"
else
  python -m pip install -q -c scripts/constraints.txt -r scripts/requirements-ci.txt
fi
python -c "import torch, triton, ffpa_attn; print(ffpa_attn.__distribution__, ffpa_attn.__version__, '| torch', torch.__version__, '| triton', triton.__version__)"
