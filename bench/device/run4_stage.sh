#!/usr/bin/env bash
# Device run 4 (H200): stage the first half of the CuTeDSL wheels (carry .device-wheels/1 .devcache/upstream) and print the
# environment; run 5 follows on the warm machine.
set -u
mkdir -p /tmp/wheels && cp .device-wheels/1/* /tmp/wheels/ && ls /tmp/wheels
# the public ffpa-attn 0.2.4 (unpacked wheel, carry .devcache/upstream) for run 5
[ -d .devcache/upstream/ffpa_attn ] && rm -rf /tmp/upstream && cp -r .devcache/upstream /tmp/upstream && echo "upstream staged"
python3 -m ffpa_attn info
