#!/usr/bin/env bash
# Print the path of a CPython MINOR (e.g. 3.13) interpreter, building it first if this machine has none.
#
# This machine's Debian (bookworm) ships Python 3.11 only. Debian trixie's source package of python$MINOR is
# reachable through the Debian package registry: it is fetched with `apt-get source`, unpacked without Debian's
# patches (they turn off ensurepip, which `python -m venv` needs, and adapt the layout to Debian's), so what is
# built is upstream CPython, with `./configure && make` (about 10 minutes on 2 cores). The build is kept outside the checkout, keyed by the
# source package's version, in $CPYTHON_CACHE (default ~/.cache/lightning-multids/cpython): a second run on
# the same machine only prints the path. Every message goes to stderr; stdout is the interpreter's path.
set -euo pipefail
minor="${1:?usage: cpython.sh MINOR (e.g. 3.13)}"
cache="${CPYTHON_CACHE:-$HOME/.cache/lightning-multids/cpython}"
found=$(ls -d "$cache/$minor".*/bin/python"$minor" 2>/dev/null | sort -V | tail -1 || true)
check="import ssl, zlib, ctypes, sqlite3, bz2, lzma, ensurepip, venv"
if [ -n "$found" ] && "$found" -c "$check" 2>/dev/null && "$found" -m pip --version >/dev/null 2>&1; then
    echo "$found"
    exit 0
fi
{
    sources=/etc/apt/sources.list.d/trixie-src.sources
    if [ ! -e "$sources" ]; then
        printf 'Types: deb-src\nURIs: http://deb.debian.org/debian\nSuites: trixie\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' >"$sources"
    fi
    apt-get update -qq
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    cd "$work"
    apt-get source -qq --download-only --only-source "python$minor" >/dev/null
    dpkg-source --skip-patches -x python"$minor"_*.dsc upstream >/dev/null
    version=$(cd upstream && dpkg-parsechangelog -S Version | cut -d- -f1)  # e.g. 3.13.5
    prefix="$cache/$version"
    rm -rf "$prefix"
    cd upstream
    ./configure --prefix="$prefix" --quiet >/dev/null
    make -j"$(nproc)" --quiet >/dev/null 2>build.log || { tail -30 build.log; exit 1; }
    make altinstall --quiet >/dev/null 2>>build.log || { tail -30 build.log; exit 1; }
} >&2
"$prefix/bin/python$minor" -c "$check"
"$prefix/bin/python$minor" -m pip --version >/dev/null
echo "$prefix/bin/python$minor"
