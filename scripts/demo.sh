#!/usr/bin/env bash
# The demo: setup (idempotent), a local SeaweedFS S3, a mount, an unmodified torch training loop
# that saves with torch.save and resumes from the latest checkpoint, then cleanup.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
exec .venv/bin/python examples/demo.py "$@"
