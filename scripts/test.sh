#!/usr/bin/env bash
# The test suite: set up (if needed), then run every test, fault tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
DCP_ATOMIC_EXTRAS=test,s3 bash scripts/bootstrap.sh
exec .venv/bin/python -m pytest "$@"
