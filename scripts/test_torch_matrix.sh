#!/usr/bin/env bash
# The suite's core files (the two tiers included) on a second torch (2.14.1 by default), plus the cross-version
# save/load test both ways.
# Builds the second venv on first use (TORCH_MATRIX_VENV, default /work/venv214; the 2.14.1 wheel is a CUDA build
# and runs on the CPU), sets up .venv (torch 2.13.0) through scripts/bootstrap.sh if needed, then runs one file
# at a time (the machine is small).  Extra arguments go to every pytest run.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION=${TORCH_MATRIX_TORCH:-2.14.1}
VENV=${TORCH_MATRIX_VENV:-/work/venv214}
PY=${PYTHON:-python3}

quiet_pip() {  # $1: venv; the rest: pip arguments.  Quiet unless it fails.
    local venv=$1 log
    shift
    log=$(mktemp)
    if ! "$venv/bin/python" -m pip install -q --disable-pip-version-check "$@" >"$log" 2>&1; then
        cat "$log" >&2
        rm -f "$log"
        echo "test_torch_matrix: pip install $* failed" >&2
        exit 1
    fi
    rm -f "$log"
}

if ! .venv/bin/python -c 'import dcp_atomic, pytest' 2>/dev/null; then  # the other side of the cross-version test
    DCP_ATOMIC_EXTRAS=test bash scripts/bootstrap.sh
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
    quiet_pip "$VENV" "torch==$TORCH_VERSION"
fi
"$VENV/bin/python" -c 'import dcp_atomic' 2>/dev/null || quiet_pip "$VENV" -e ".[test]"
for optional in "torchtitan==0.3.0" tyro spmd-types; do  # tests/test_mesh_names.py reads torchtitan's own meshes
    name=${optional%%=*}
    "$VENV/bin/python" -c "import ${name//-/_}" 2>/dev/null || quiet_pip "$VENV" --no-deps "$optional"
done
"$VENV/bin/python" -c 'import dcp_atomic, torch; print(f"dcp_atomic {dcp_atomic.__version__} with torch {torch.__version__} in '"$VENV"'")'

status=0
for file in test_torch_versions test_mesh_names test_single_process test_formats test_reshard test_checkpoint_id \
            test_worlds test_manager test_tiers test_tier_worlds; do  # the two tiers: world 4 as 2 nodes, world 6 as 3
    echo "== torch $TORCH_VERSION: tests/$file.py"
    rc=0
    DCP_ATOMIC_OTHER_PYTHON="$PWD/.venv/bin/python" "$VENV/bin/python" -m pytest "tests/$file.py" -q \
        -p no:cacheprovider "$@" || rc=$?
    [ "$rc" = 0 ] || [ "$rc" = 5 ] || status=1  # 5: a -k filter left nothing to run in this file
done
exit $status
