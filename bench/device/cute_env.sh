#!/usr/bin/env bash
# Sourced by the CuTeDSL device runs (bench/device/run2x_*.sh) on a machine warm after run4_stage.sh, called with
# carry .device-wheels/2 .device-tools: joins the second half of the wheels to /tmp/wheels, installs them into
# /tmp/site unless a previous call on this machine did, and exports the environment the runs share.
export FFPA_ATTN_CACHE_DIR=/tmp/ffpa_cache PYTHONUNBUFFERED=1
cp .device-wheels/2/* /tmp/wheels/ 2>/dev/null
if [ ! -d /tmp/site/nvidia_cutlass_dsl ]; then
  t_install=$(date +%s)
  bash .device-tools/install_wheels.sh /tmp/wheels > /tmp/install.log 2>&1
  echo "install rc=$? ($(( $(date +%s) - t_install )) s)"
fi
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
