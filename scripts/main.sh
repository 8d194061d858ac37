#!/usr/bin/env bash
# The main job: set up, then `python -m ffpa_attn` (self-check; on a GPU also the comparison benchmark).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m ffpa_attn "$@"
