#!/usr/bin/env bash
# Idempotent setup on Debian: FUSE packages, a venv in .venv, ckptfs with its test extras, torch.
# Run by scripts/demo.sh and scripts/test.sh; safe to run again and again. `--tests` also
# installs what the test suite builds pjdfstest with (autotools, make; openssl for its names).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
for_tests=0
[ "${1:-}" = "--tests" ] && for_tests=1

PY=${PYTHON:-python3}
need_apt=()
packages=(fuse3 pkg-config)
[ $for_tests -eq 1 ] && packages+=(autoconf automake make openssl)
for pkg in "${packages[@]}"; do
    dpkg -s "$pkg" >/dev/null 2>&1 || need_apt+=("$pkg")
done
# libfuse and pyfuse3 build from source (scripts/install_fuse.sh): a compiler, the Python headers.
command -v gcc >/dev/null || need_apt+=(gcc)
"$PY" -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
    || need_apt+=(python3-dev)
"$PY" -c 'import ensurepip' 2>/dev/null || need_apt+=(python3-venv)
if [ ${#need_apt[@]} -gt 0 ]; then
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
pip_q() {  # pip install, minus the harmless warnings about a missing local index folder
    local out rc=0
    out=$(.venv/bin/python -m pip install -q --disable-pip-version-check "$@" 2>&1) || rc=$?
    printf '%s\n' "$out" | grep -vE "it is neither a file nor a directory|^$" >&2 || true
    return $rc
}
# torch: the exact CPU build on this machine's disk; never a bare 'torch' (that pulls CUDA).
if ! .venv/bin/python -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
    pip_q "torch==2.13.0"
fi
# libfuse >= 3.17.4 and pyfuse3 with FUSE passthrough, from third_party/ (Debian 12 has 3.14).
bash scripts/install_fuse.sh .venv/bin/python
pip_q -e ".[test]"
.venv/bin/python -c 'import ckptfs, pyfuse3, torch' || { echo "setup failed: the venv is incomplete" >&2; exit 1; }
