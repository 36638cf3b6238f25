#!/usr/bin/env bash
# The torch matrix: the suite's core files (the two tiers included) on a second torch, plus the cross-version
# save/load test both ways against .venv (torch 2.13.0, what CI runs).  The command that runs it:
#     bash scripts/test_torch_matrix.sh                                    # torch 2.14.1 in /work/venv214
#     TORCH_MATRIX_TORCH=2.15.0 TORCH_MATRIX_VENV=/work/venv215 bash scripts/test_torch_matrix.sh
# Green on 2.14.1 and 2.15.0 (143 tests each; 5.5-16 minutes a torch on 2 cores, plus a multi-GB venv build on
# first use): too slow for .ci/run, which runs scripts/test.sh on .venv's 2.13.0 only.  The last line sums pytest's counts: "torch matrix V: ...; green in Ns".
# Builds the second venv on first use (the 2.14.1 and 2.15.0 wheels are CUDA builds and run on the CPU; 2.15.0
# comes from PyPI, past this machine's pip cap, which the second venv's pip calls lift with PIP_CONSTRAINT=/dev/null),
# sets up .venv through scripts/bootstrap.sh if needed, then runs one file at a time (the machine is small).
# Extra arguments go to every pytest run.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION=${TORCH_MATRIX_TORCH:-2.14.1}
VENV=${TORCH_MATRIX_VENV:-/work/venv214}
PY=${PYTHON:-python3}

quiet_pip() {  # $1: venv; the rest: pip arguments.  Quiet unless it fails.
    local venv=$1 log
    shift
    log=$(mktemp)
    # PIP_CONSTRAINT=/dev/null replaces a pip.conf "constraint" (this machine caps torch at 2.14.1) for this call
    # only (an empty PIP_CONSTRAINT would not); the calls that could move torch pin the requested one.
    if ! PIP_CONSTRAINT=/dev/null "$venv/bin/python" -m pip install -q --disable-pip-version-check "$@" >"$log" 2>&1; then
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
"$VENV/bin/python" -c 'import dcp_atomic' 2>/dev/null || quiet_pip "$VENV" -e ".[test]" "torch==$TORCH_VERSION"
for optional in "torchtitan==0.3.0" tyro spmd-types; do  # tests/format/test_mesh_names.py reads torchtitan's own meshes
    name=${optional%%=*}
    "$VENV/bin/python" -c "import ${name//-/_}" 2>/dev/null || quiet_pip "$VENV" --no-deps "$optional"
done
"$VENV/bin/python" -c 'import dcp_atomic, torch; print(f"dcp_atomic {dcp_atomic.__version__} with torch {torch.__version__} in '"$VENV"'")'

status=0
start=$SECONDS
out=$(mktemp)
trap 'rm -f "$out"' EXIT
for file in guards/test_torch_versions guards/test_internals format/test_mesh_names manager/test_single_process \
            format/test_formats dcp/test_reshard dcp/test_checkpoint_id faults/test_worlds manager/test_manager \
            tiers/test_tiers tiers/test_tier_worlds; do  # the two tiers: world 4 as 2 nodes, world 6 as 3
    echo "== torch $TORCH_VERSION: tests/$file.py"
    rc=0
    DCP_ATOMIC_OTHER_PYTHON="$PWD/.venv/bin/python" "$VENV/bin/python" -m pytest "tests/$file.py" -q \
        -p no:cacheprovider "$@" | tee -a "$out" || rc=$?
    [ "$rc" = 0 ] || [ "$rc" = 5 ] || status=1  # 5: a -k filter left nothing to run in this file
done
# One summary line: pytest's own counts (its last line per file) summed over the files, and the wall time.
counts=$(grep -E '^(=+ )?[0-9]+ [a-z]+.* in [0-9.]+s( \([0-9:]+\))?( =+)?$' "$out" |
         grep -oE '[0-9]+ (passed|failed|errors?|skipped|xfailed|xpassed|deselected)' |
         awk '{sub(/^errors$/, "error", $2); n[$2] += $1} END {for (k in n) printf "%s%d %s", (i++ ? ", " : ""), n[k], k}')
echo "torch matrix $TORCH_VERSION: ${counts:-nothing ran}; $([ $status = 0 ] && echo green || echo FAILED) in $((SECONDS - start))s"
exit $status
