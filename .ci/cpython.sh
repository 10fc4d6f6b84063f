#!/usr/bin/env bash
# Print the path of a CPython MINOR (e.g. 3.13) interpreter: python$MINOR from PATH when it is a usable one
# (venv, ensurepip and the usual extension modules), else one built here once.
#
# This machine's Debian (bookworm) ships Python 3.11 only. Debian trixie's source package of python$MINOR is
# reachable through the Debian package registry; trixie has python3.13 only, so 3.13 is the one minor this script
# can build. It is fetched with `apt-get source` (as root: it adds a deb-src entry for trixie and runs
# `apt-get update`), unpacked without Debian's patches (they turn off ensurepip, which `python -m venv` needs, and
# adapt the layout to Debian's), so what is built is upstream CPython, with `./configure && make` (10-15 minutes on
# 2 cores). The build is kept outside the checkout, keyed by the source package's version, in $CPYTHON_CACHE
# (default ~/.cache/lightning-multids/cpython): a second run on the same machine only prints the path. Every
# message goes to stderr; stdout is the path. A failure exits non-zero with nothing on stdout.
set -euo pipefail
minor="${1:?usage: cpython.sh MINOR (e.g. 3.13)}"
cache="${CPYTHON_CACHE:-$HOME/.cache/lightning-multids/cpython}"
check="import sys, ssl, zlib, ctypes, sqlite3, bz2, lzma, ensurepip, venv; assert sys.version_info[:2] == (${minor/./, })"
usable() { [ -n "$1" ] && "$1" -c "$check" 2>/dev/null; }
for candidate in "$(command -v "python$minor" || true)" \
    "$(ls -d "$cache/$minor".*/bin/python"$minor" 2>/dev/null | sort -V | tail -1 || true)"; do
    if usable "$candidate"; then
        "$candidate" -c "import sys; print(sys.executable)"
        exit 0
    fi
done
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
"$prefix/bin/python$minor" -c "$check" >&2
echo "$prefix/bin/python$minor"
