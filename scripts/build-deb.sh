#!/bin/bash
# Builds vstor's Debian package from this tree into OUTDIR (run as root on
# Debian 12): its build dependencies, the vendored wheels (debian/vendor.txt,
# fetched into debian/vendor/), then dpkg-buildpackage -us -uc -b in a copy
# of the tree, so the checkout is left as it was.
#   scripts/build-deb.sh OUTDIR [VERSION-SUFFIX]
# VERSION-SUFFIX (e.g. +upgrade1) is appended to debian/changelog's version
# in the copy: a newer build of the same tree, for an upgrade test
# (tests/systemd).  Prints the path of the .deb as its last line; the build
# log is OUTDIR/build.log.  Used by scripts/ci-package.sh and tests/systemd.
set -euo pipefail
[ $# -ge 1 ] && [ $# -le 2 ] || { echo "usage: scripts/build-deb.sh OUTDIR [VERSION-SUFFIX]" >&2; exit 2; }
OUT=$1
SUFFIX=${2:-}
case $SUFFIX in
    ''|[+~.]*) ;;
    *) echo "build-deb: VERSION-SUFFIX must start with +, ~ or . (got '$SUFFIX')" >&2; exit 2 ;;
esac
case $SUFFIX in *[!A-Za-z0-9.+~]*)
    echo "build-deb: VERSION-SUFFIX may hold only A-Za-z0-9.+~ (got '$SUFFIX')" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/.."
SRC=$PWD
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
# Debian's tools with Debian's python3 (pybuild), never a pyenv or venv one.
DEBPATH=/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin

BUILD_DEPS="debhelper dh-python python3-all python3-setuptools python3-wheel pybuild-plugin-pyproject
            bash-completion python3-lxml python3-build python3-installer lintian"
missing=""
for p in $BUILD_DEPS; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
    echo "build-deb: installing build dependencies:$missing" >&2
    apt-get update -q >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $missing >&2
fi

# The vendored wheels (debian/vendor.txt), into the checkout's debian/vendor
# (ignored by git), where a later build finds them again.
mkdir -p debian/vendor
grep -v '^#' debian/vendor.txt | while read -r wheel sum; do
    if [ ! -f "debian/vendor/$wheel" ] \
            || ! echo "$sum  debian/vendor/$wheel" | sha256sum -c --quiet - >/dev/null 2>&1; then
        name=${wheel%%-*}; rest=${wheel#*-}; version=${rest%%-*}
        python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary :all: \
            -d debian/vendor "${name//_/.}==$version" >&2
    fi
done

WORK=$(mktemp -d "$OUT/.build.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
mkdir "$WORK/src"
tar -C "$SRC" --exclude=./.git --exclude=./.venv --exclude=./.nova-venv --exclude='*/__pycache__' \
    --exclude=./build --exclude=./dist --exclude='*.egg-info' --exclude=./.pybuild -cf - . | tar -C "$WORK/src" -xf -
if [ -n "$SUFFIX" ]; then
    # Only the first line's version: what dpkg-parsechangelog reads.
    sed -i '1s/^\(vstor (\)\([^)]*\)\()\)/\1\2'"$SUFFIX"'\3/' "$WORK/src/debian/changelog"
fi
version=$(cd "$WORK/src" && dpkg-parsechangelog -S Version)
(cd "$WORK/src" && env PATH=$DEBPATH dpkg-buildpackage -us -uc -b >"$OUT/build.log" 2>&1) \
    || { tail -40 "$OUT/build.log" >&2; echo "build-deb: dpkg-buildpackage failed (log: $OUT/build.log)" >&2; exit 1; }
deb=$WORK/vstor_${version}_all.deb
[ -f "$deb" ] || { echo "build-deb: no $(basename "$deb") after the build" >&2; exit 1; }
mv "$deb" "$OUT/"
echo "$OUT/$(basename "$deb")"
