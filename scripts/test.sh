#!/usr/bin/env bash
# The test suite: set up (if needed), then run every test, fault tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
# The fault tests need two bindfs FUSE mounts (NFS-like stale clients), tmpfs, and a FAT volume through fusefat
# (a filesystem without hard links); install them when we can.
if [ "$(id -u)" = 0 ] && ! { command -v bindfs && command -v fusefat && command -v mkfs.vfat; } >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bindfs fuse3 fusefat dosfstools) >/dev/null
fi
DCP_ATOMIC_EXTRAS=test,s3 bash scripts/bootstrap.sh
# torchtitan's own pins would downgrade fsspec below what s3fs needs; its checkpointer needs only torch and tyro,
# its ParallelDims (the mesh-name tests build torchtitan's own meshes) spmd-types.
if ! .venv/bin/python -c 'import torchtitan, spmd_types' 2>/dev/null; then
    if ! log=$(.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps torchtitan==0.3.0 spmd-types==0.3.1 2>&1); then
        echo "$log" >&2
        exit 1
    fi
fi
# The layers' import directions ([tool.importlinter] in pyproject.toml): a wrong-way import fails the run here.
if ! log=$(.venv/bin/lint-imports 2>&1); then
    echo "$log" >&2
    exit 1
fi
# The documentation site (mkdocs.yml), built strictly: a broken link, a page left out of the navigation or an API
# reference that no longer resolves fails the run here (never with --quiet: it hides the warnings from --strict).
site=$(mktemp -d)
if ! log=$(NO_MKDOCS_2_WARNING=1 .venv/bin/python -m mkdocs build --strict -d "$site" 2>&1); then
    rm -rf "$site"
    echo "$log" >&2
    exit 1
fi
rm -rf "$site"
# Parallel workers (pytest-xdist): the suite mostly waits (timeouts, liveness, servers), so more workers than
# cores pay off; every test is isolated in its ports (tests/ports.py), directories and mounts.
exec .venv/bin/python -m pytest -n "${DCP_ATOMIC_TEST_WORKERS:-4}" "$@"
