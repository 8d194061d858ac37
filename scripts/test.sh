#!/usr/bin/env bash
# The test command: set up (scripts/setup.sh), then run the whole suite. Without a GPU the Triton kernels
# run under TRITON_INTERPRET=1 and tests marked `gpu` are skipped; with a GPU everything runs.
# Workers: FFPA_TEST_WORKERS, else scripts/xdist_workers.py (2 on a CPU; from the GPU's free memory on a GPU);
# tests marked xdist_group run on one worker each group (--dist loadgroup): the memory-heavy model tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if ! .venv/bin/python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  export TRITON_INTERPRET=1
fi
workers=$(.venv/bin/python scripts/xdist_workers.py)
echo "test: pytest with $workers xdist workers (FFPA_TEST_WORKERS overrides)"
exec .venv/bin/python -m pytest -q -n "$workers" --dist loadgroup tests "$@"
