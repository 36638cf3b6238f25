#!/usr/bin/env bash
# Set up .venv from a clean clone: torch first (the CPU wheel pinned here; a bare
# "torch" or an open range would pull a multi-GB CUDA build), then the package.
# Idempotent: a second run only checks what is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
VPY=.venv/bin/python
if ! "$VPY" -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
    "$VPY" -m pip install -q --disable-pip-version-check torch==2.13.0
fi
EXTRAS=${DCP_ATOMIC_EXTRAS:-}
"$VPY" -m pip install -q --disable-pip-version-check -e ".${EXTRAS:+[$EXTRAS]}" 2>&1 | grep -v "is ignored: it is neither" || true
"$VPY" -c 'import dcp_atomic, torch; print(f"dcp_atomic {dcp_atomic.__version__} with torch {torch.__version__} in .venv")'
