#!/usr/bin/env bash
# FUSE passthrough for a Python environment: builds the vendored libfuse (third_party/libfuse,
# >= 3.17.4) into the environment's prefix and installs the vendored pyfuse3 with the
# passthrough change (third_party/pyfuse3) linked to it. Idempotent; offline apart from PyPI
# (meson, ninja, Cython). Needs gcc, pkg-config and the Python headers.
#
#   scripts/install_fuse.sh /opt/ckptfs/bin/python     # then: /opt/ckptfs/bin/pip install .
#
# The library (soname libfuse3.so.4) goes to PREFIX/lib, beside nothing of Debian's
# (libfuse3.so.3 stays); pyfuse3 finds it through an rpath relative to itself.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY=${1:?usage: install_fuse.sh PYTHON [--wheel-dir DIR]}
wheel_dir=""
[ "${2:-}" = "--wheel-dir" ] && wheel_dir=${3:?--wheel-dir needs a directory}

prefix=$("$PY" -c 'import sys; print(sys.prefix)')
version=$(sed -n "s/^ *version: '\([0-9.]*\)',$/\1/p" "$root/third_party/libfuse/meson.build" | head -1)
stamp="$prefix/lib/libfuse3.so.$version"
want_pyfuse3=$(sed -n 's/^version = "\([^"]*\)".*/\1/p' "$root/third_party/pyfuse3/pyproject.toml")

pip_q() {  # pip install, minus the harmless warnings about a missing local index folder
    local out rc=0
    out=$("$PY" -m pip install -q --disable-pip-version-check "$@" 2>&1) || rc=$?
    printf '%s\n' "$out" | grep -vE "it is neither a file nor a directory|^$" >&2 || true
    return $rc
}

if [ ! -e "$stamp" ]; then
    pip_q meson ninja
    bin=$(dirname "$("$PY" -c 'import sys; print(sys.executable)')")
    build=$(mktemp -d)
    trap 'rm -rf "$build"' EXIT
    PATH="$bin:$PATH" meson setup "$build" "$root/third_party/libfuse" --prefix="$prefix" \
        --libdir=lib --buildtype=release -Dutils=false -Dexamples=false -Dtests=false \
        -Denable-io-uring=false -Ddisable-mtab=true >"$build/setup.log" 2>&1 \
        || { cat "$build/setup.log" >&2; echo "install_fuse: meson setup of libfuse failed" >&2; exit 1; }
    PATH="$bin:$PATH" ninja -C "$build" install >"$build/ninja.log" 2>&1 \
        || { cat "$build/ninja.log" >&2; echo "install_fuse: building libfuse failed" >&2; exit 1; }
fi

have_pyfuse3=$("$PY" -c 'import importlib.metadata as m; print(m.version("pyfuse3"))' 2>/dev/null || true)
if [ "$have_pyfuse3" != "$want_pyfuse3" ] || [ -n "$wheel_dir" ] \
        || ! "$PY" -c 'import pyfuse3, sys; sys.exit(not pyfuse3.PASSTHROUGH_SUPPORTED)' 2>/dev/null; then
    # $ORIGIN: pyfuse3's module sits in PREFIX/lib/pythonX.Y/site-packages/pyfuse3/.
    export PKG_CONFIG_PATH="$prefix/lib/pkgconfig" LDFLAGS='-Wl,-rpath,$ORIGIN/../../..'
    src=$(mktemp -d)  # pip builds in the tree it is given: a copy, not third_party/ itself
    cp -a "$root/third_party/pyfuse3/." "$src/"
    wheels=${wheel_dir:-$src/dist}
    "$PY" -m pip wheel -q --disable-pip-version-check --no-deps --wheel-dir "$wheels" "$src" \
        2> >(grep -vE "it is neither a file nor a directory|^$" >&2)
    pip_q --force-reinstall --no-deps "$wheels"/pyfuse3-*.whl
    rm -rf "$src"
    pip_q "trio>=0.15"  # pyfuse3's one dependency
fi
"$PY" -c 'import pyfuse3, sys; sys.exit(not pyfuse3.PASSTHROUGH_SUPPORTED)' \
    || { echo "install_fuse: pyfuse3 was built without passthrough" >&2; exit 1; }
