#!/usr/bin/env bash
# The test command: set up (scripts/setup.sh), then run the whole suite. Without a GPU the Triton kernels
# run under TRITON_INTERPRET=1 and tests marked `gpu` are skipped; with a GPU everything runs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if ! .venv/bin/python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  export TRITON_INTERPRET=1
fi
exec .venv/bin/python -m pytest -q -n "${FFPA_TEST_WORKERS:-2}" tests "$@"
