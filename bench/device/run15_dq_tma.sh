#!/usr/bin/env bash
# Device run 15 (H200, warm after run4_stage.sh; carry .device-wheels/2 .device-tools): installs the CuTeDSL
# wheels, then validates the CuTeDSL backward's dq_mode "tma" (the fix of ec1571c, docs/cute_bwd_dq_tma.md)
# with run11 (smoke per dQ mode, pytest -k backward incl. the other-mode tests, explore A/B, memcheck).
set -u
export FFPA_ATTN_CACHE_DIR=/tmp/ffpa_cache PYTHONUNBUFFERED=1
cp .device-wheels/2/* /tmp/wheels/ 2>/dev/null
t0=$(date +%s)
bash .device-tools/install_wheels.sh /tmp/wheels > /tmp/install.log 2>&1; echo "install rc=$? ($(( $(date +%s) - t0 )) s)"
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
bash bench/device/run11_cute_bwd.sh
