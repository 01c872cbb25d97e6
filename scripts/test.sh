#!/usr/bin/env bash
# The whole test suite: setup (idempotent), then pytest against a real SeaweedFS and real FUSE mounts.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh --tests
[ "$(id -u)" -eq 0 ] || echo "note: some tests need root (tmpfs mounts, other users); run as root" >&2
exec .venv/bin/python -m pytest -q -p no:cacheprovider tests "$@"
