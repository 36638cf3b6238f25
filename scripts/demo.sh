#!/usr/bin/env bash
# The main job: set up (if needed), then run the crash-and-resume demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/dcp-atomic demo "$@"
