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

pip_install() {  # quiet unless it fails; drops this machine's harmless "Location ... is ignored" lines
    local log
    log=$(mktemp)
    if ! "$VPY" -m pip install -q --disable-pip-version-check "$@" >"$log" 2>&1; then
        cat "$log" >&2
        rm -f "$log"
        echo "bootstrap: pip install $* failed" >&2
        exit 1
    fi
    grep -v -e "is ignored: it is neither" -e "does not provide the extra" "$log" || true
    rm -f "$log"
}

# the installed version from its metadata (importing torch takes seconds; the last line below imports it once)
if ! "$VPY" -c 'import sys; from importlib.metadata import version; sys.exit(version("torch").split("+")[0] != "2.13.0")' 2>/dev/null; then
    pip_install torch==2.13.0
fi
EXTRAS=${DCP_ATOMIC_EXTRAS:-}
pip_install -e ".${EXTRAS:+[$EXTRAS]}"
"$VPY" -c 'import dcp_atomic, torch; print(f"dcp_atomic {dcp_atomic.__version__} with torch {torch.__version__} in .venv")'
