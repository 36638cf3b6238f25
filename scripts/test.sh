#!/usr/bin/env bash
# The test suite: set up (if needed), then run every test, fault tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
# The fault tests need two bindfs FUSE mounts (NFS-like stale clients) and tmpfs; install them when we can.
if [ "$(id -u)" = 0 ] && ! command -v bindfs >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bindfs fuse3) >/dev/null
fi
DCP_ATOMIC_EXTRAS=test,s3 bash scripts/bootstrap.sh
# torchtitan's own pins would downgrade fsspec below what s3fs needs; its checkpointer needs only torch and tyro.
if ! .venv/bin/python -c 'import torchtitan' 2>/dev/null; then
    if ! log=$(.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps torchtitan==0.3.0 2>&1); then
        echo "$log" >&2
        exit 1
    fi
fi
exec .venv/bin/python -m pytest "$@"
