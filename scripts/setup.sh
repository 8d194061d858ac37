#!/usr/bin/env bash
# Set up .venv for ffpa-attn on a fresh machine (idempotent). Reuses a torch that is already installed
# system-wide (e.g. a CUDA build on a GPU box); otherwise installs the CPU torch 2.13.0. Installs
# scripts/requirements-ci.txt (tests, bench, and the CuTeDSL / NVRTC packages the CPU compile checks need) under
# scripts/constraints.txt; $FFPA_EXTRAS (e.g. "test,bench") installs those extras of the package instead.
#
# Offline first: pip installs from what the environment already has (--no-index --no-build-isolation) when that
# satisfies every requirement, so a machine without a package index (GPU hosts) needs none; otherwise the ordinary
# install from the index runs. If that fails too (no index), it says what is missing, installs the checkout alone
# (or, where setuptools cannot, puts it on the path with a .pth file) and goes on: tests of a missing package skip
# or fail by name. FFPA_REQUIRE_NETWORK=1 (CI) makes a failed install an error instead.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
say() { echo "setup: $*"; }
if [ ! -x .venv/bin/python ]; then
  say "creating .venv (with the system's site packages, so an installed torch is reused)"
  "$PY" -m venv --system-site-packages .venv
  # a python that is itself a virtual environment (a GPU host's torch often lives in one): --system-site-packages
  # reaches its base interpreter's packages only, so its own site-packages go on .venv's path through a .pth file
  parent=$("$PY" -c 'import site, sys; print("\n".join(site.getsitepackages()) if sys.prefix != sys.base_prefix else "")')
  if [ -n "$parent" ]; then
    say "$PY is a virtual environment: its packages stay visible in .venv"
    echo "$parent" >"$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/ffpa_parent_env.pth"
  fi
fi
# shellcheck disable=SC1091
. .venv/bin/activate
if ! python -c "import torch" >/dev/null 2>&1; then
  say "no torch importable: installing torch 2.13.0"
  python -m pip install -q "torch==2.13.0"  # the local CPU wheel of this machine class
fi
# the public ffpa-attn package (or this one installed under that former name) writes the same ffpa_attn folder:
# remove it from this environment before installing ours (pip does not know the two collide)
if python -m pip show --quiet ffpa-attn >/dev/null 2>&1; then
  say "uninstalling the distribution ffpa-attn (it installs the same ffpa_attn package as ffpa-attn-kernels)"
  python -m pip uninstall -q -y ffpa-attn || true
fi
if [ -n "${FFPA_EXTRAS:-}" ]; then
  what=(-e ".[${FFPA_EXTRAS}]")
else
  what=(-r scripts/requirements-ci.txt)
fi
pth="$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/ffpa_attn_checkout.pth"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
say "installing ffpa-attn-kernels (editable) and ${what[*]} from what is installed (no index)"
if python -m pip install -q --no-index --no-build-isolation -c scripts/constraints.txt "${what[@]}" 2>"$log"; then
  rm -f "$pth"
else
  say "what is installed does not do: $(grep -m 1 -i 'error' "$log" | sed 's/^ *//' || true)"
  say "installing from the package index (on a fresh machine pip downloads the test, bench and CuTeDSL packages)"
  if python -m pip install -q -c scripts/constraints.txt "${what[@]}"; then
    rm -f "$pth"
  elif [ "${FFPA_REQUIRE_NETWORK:-0}" = 1 ]; then
    say "the install failed (FFPA_REQUIRE_NETWORK=1)"
    exit 1
  else
    say "no package index: going on with the packages installed"
    if ! python -m pip install -q --no-index --no-build-isolation --no-deps -e . 2>"$log"; then
      say "setuptools cannot install the checkout offline: $(pwd) goes on the path instead ($pth)"
      pwd >"$pth"
    fi
  fi
fi
python -c "import torch, triton, ffpa_attn; print(ffpa_attn.__distribution__, ffpa_attn.__version__, '| torch', torch.__version__, '| triton', triton.__version__, '|', ffpa_attn.__path__[0])"
