#!/usr/bin/env bash
# Device run 4 (H200): stage the first half of the CuTeDSL wheels (carry .device-wheels/1) and print the
# environment; run 5 follows on the warm machine.
set -u
mkdir -p /tmp/wheels && cp .device-wheels/1/* /tmp/wheels/ && ls /tmp/wheels
python3 -m ffpa_attn info
