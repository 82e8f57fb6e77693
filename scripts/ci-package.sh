#!/bin/bash
# CI's package step (run as root on Debian 12, before the test suite):
#   1. build the Debian package from this tree (scripts/build-deb.sh:
#      dpkg-buildpackage, in a copy),
#   2. install it, with the e2e session lock held (its libvirt hook is live
#      for every libvirtd started meanwhile), and smoke every entry point of
#      the INSTALLED package: /usr/bin/vstor, the libvirt hook, the Proxmox
#      hookscript, the migration agent, the units, man pages, completion,
#      the Nova driver's absence; then the demo against it,
#   3. purge it and show that no file of vstor is left (file lists before
#      install and after purge),
#   4. build the wheel and run tests/test_packaging.py's wheel tests (a fresh
#      venv with Nova: the driver loads as nova-compute loads it, also after
#      Nova is reinstalled over it).
# Exit status: 0, or the first failure with a line saying what failed.
set -euo pipefail
t0=$(date +%s)
cd "$(dirname "$0")/.."
SRC=$PWD
WORK=$(mktemp -d /tmp/vstor-package.XXXXXX)
LOCK=/run/vstor-e2e.lock
trap 'rm -rf "$WORK"' EXIT
step() { printf '\n== [%ss] %s\n' "$(( $(date +%s) - t0 ))" "$*"; }
fail() { echo "ci-package: FAILED: $*" >&2; exit 1; }

step "dpkg-buildpackage -us -uc -b, in a copy of the tree (scripts/build-deb.sh)"
DEB=$(bash scripts/build-deb.sh "$WORK") || fail "the package build (output above)"
echo "built $(basename "$DEB") ($(stat -c %s "$DEB") bytes) in $(( $(date +%s) - t0 ))s"
dpkg-deb -f "$DEB" Package Version Depends Recommends
if command -v lintian >/dev/null; then
    step "lintian (errors fail; warnings are shown)"
    lintian --fail-on error "$DEB" || fail "lintian found errors"
fi

step "the maintainer scripts never stop, restart or reload what a running domain's disk runs in"
# Every qemu-storage-daemon lives in a scope of vstor.slice: stopping or
# restarting the slice stops them all (docs/install.md, debian/rules).  No
# dh_installsystemd snippet acts on the slice or the gc service, and what
# runs at an upgrade (preinst, prerm) never names the slice; postrm's own
# stop at a removal acts only on a slice that runs no process.
mkdir "$WORK/control"
dpkg-deb -e "$DEB" "$WORK/control"
if { grep -n "deb-systemd-invoke.*\(vstor\.slice\|vstor-gc\.service\)" "$WORK"/control/*inst \
         "$WORK"/control/*rm 2>/dev/null
     grep -n "vstor\.slice" "$WORK"/control/preinst "$WORK"/control/prerm 2>/dev/null; } \
        | grep -v '^\([^:]*:\)\?[0-9]*:[[:space:]]*#'; then
    fail "a maintainer script acts on vstor.slice or vstor-gc.service at an upgrade (lines above)"
fi

# What the package needs, installed before the 'before' file list, so that
# the lists differ by vstor alone.
step "the package's dependencies"
DEBIAN_FRONTEND=noninteractive apt-get satisfy -y -q --no-install-recommends \
    "$(dpkg-deb -f "$DEB" Depends | sed 's/\${[^}]*}//g')" >/dev/null

# Other daemons' pidfiles in /run come and go on their own (virtlogd exits
# when idle), so they are left out; vstor's own pidfiles live in /run/vstor.
# So is the marker /run/systemd/systemd-units-load, which systemd-analyze
# verify (the smoke's check of vstor's units) leaves, whatever units it
# verifies.
snapshot() {
    find /etc /usr /lib /var /opt /run -xdev \
        -path /var/lib/dpkg -prune -o -path /var/log -prune -o -path /var/cache -prune \
        -o -path /var/lib/apt -prune -o -path /var/tmp -prune -o -path /run/user -prune \
        -o -path /var/lib/libvirt -prune -o -path /run/libvirt -prune \
        -o -path '/run/*.pid' -prune -o -path /run/systemd/systemd-units-load -prune \
        -o -print 2>/dev/null | sort
}

# Held from install to purge: the e2e tests (tests/e2e) take the same lock
# before they start a libvirtd, which would otherwise run this hook too.
exec 9>"$LOCK"
step "waiting for the e2e session lock ($LOCK)"
flock -w 1800 9 || fail "another e2e session held $LOCK for 30 minutes"
# What an e2e session killed half way left (its hooks, its daemons) is
# undone first: such a hook at the package's conffile path made dpkg ask
# whether to keep it, and fail without a terminal.
"$(sh scripts/python.sh)" tests/e2e/libvirtd.py || fail "could not undo what a dead e2e session left"
# So is a container of tests/systemd whose session died: its libvirtd would
# pass for the machine's.
VSTOR_E2E_LOCK_HELD=1 "$(sh scripts/python.sh)" tests/systemd/harness.py --reap \
    || fail "could not undo what a dead systemd test session left"
if pgrep -x libvirtd >/dev/null && [ -e /run/libvirtd.pid ]; then
    fail "a libvirtd runs already (pid $(cat /run/libvirtd.pid)): it would not see the package's hook; stop it first"
fi
snapshot >"$WORK/before"

step "apt-get install ./$(basename "$DEB")"
DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$DEB" >"$WORK/install.log" 2>&1 \
    || { cat "$WORK/install.log"; fail "apt-get install"; }
dpkg -L vstor >"$WORK/owned"
echo "installed: $(wc -l <"$WORK/owned") paths"

purge() {
    step "apt-get purge vstor"
    DEBIAN_FRONTEND=noninteractive apt-get purge -y -q vstor >"$WORK/purge.log" 2>&1 \
        || { cat "$WORK/purge.log"; echo "ci-package: apt-get purge failed" >&2; return 1; }
}
smoke_failed=""
bash "$SRC/scripts/smoke-installed.sh" || smoke_failed=1
if [ -z "$smoke_failed" ]; then
    step "the demo against the installed package (scripts/demo.py --installed)"
    PY=$(sh scripts/python.sh)
    case $PY in /*) ;; */*) PY=$SRC/$PY ;; esac     # .venv/bin/python3, relative to the checkout
    (cd / && VSTOR_E2E_LOCK_HELD=1 "$PY" "$SRC/scripts/demo.py" --installed) \
        || smoke_failed=1
fi
if [ -z "$smoke_failed" ]; then
    # A record in the state directory: vstor holds backends for that domain
    # and nothing would release them without vstor, so removal is refused.
    step "apt-get remove is refused while vstor holds backends"
    mkdir -p /run/vstor/state/domains
    echo '{"format": 1, "key": "vstor-held", "domain": "vstor-held", "uuid": null, "status": "prepared", "holding": {}, "steps": [], "updated": 0}' \
        >/run/vstor/state/domains/vstor-held.json
    if DEBIAN_FRONTEND=noninteractive apt-get remove -y -q vstor >"$WORK/refused.log" 2>&1; then
        cat "$WORK/refused.log"; echo "ci-package: apt-get remove went ahead although vstor held a domain" >&2
        smoke_failed=1
    elif ! grep -q "refusing to remove vstor: it holds backends for: vstor-held" "$WORK/refused.log" \
            || ! dpkg-query -W -f='${Status}' vstor | grep -q "install ok installed"; then
        cat "$WORK/refused.log"; echo "ci-package: the refusal did not say why, or vstor is not installed any more" >&2
        smoke_failed=1
    else
        grep "vstor: " "$WORK/refused.log" | head -2
    fi
    # An upgrade (here the same version again: dpkg runs the same prerm
    # upgrade / postinst configure) goes ahead while vstor holds a domain.
    step "an upgrade while vstor holds backends goes ahead and keeps the record"
    if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -q --reinstall --no-install-recommends "$DEB" \
            >"$WORK/upgrade.log" 2>&1 || [ ! -f /run/vstor/state/domains/vstor-held.json ]; then
        cat "$WORK/upgrade.log"; echo "ci-package: the upgrade failed or lost the record" >&2
        smoke_failed=1
    fi
    rm -f /run/vstor/state/domains/vstor-held.json
fi
if [ -z "$smoke_failed" ]; then
    # remove (not purge) keeps the conffiles: the hook then refuses a vstor
    # domain in one line naming apt, and lets every other domain be.
    step "apt-get remove: the hook left behind refuses vstor domains only"
    DEBIAN_FRONTEND=noninteractive apt-get remove -y -q vstor >"$WORK/remove.log" 2>&1 \
        || { cat "$WORK/remove.log"; smoke_failed=1; }
    HOOK=/etc/libvirt/hooks/qemu.d/vstor
    said=$(echo "<domain xmlns:vstor='https://vstor.dev/xmlns/domain/1'><name>x</name></domain>" \
           | env -i PATH=/usr/bin:/bin "$HOOK" x prepare begin - 2>&1) && smoke_failed=1
    echo "$said"
    echo "$said" | grep -q "cannot load vstor.*install the vstor package again" || smoke_failed=1
    echo "<domain><name>y</name></domain>" | env -i PATH=/usr/bin:/bin "$HOOK" y prepare begin - || smoke_failed=1
fi
purge || smoke_failed=1
[ -z "$smoke_failed" ] || fail "the installed package (output above)"

step "nothing of vstor is left"
snapshot >"$WORK/after"
flock -u 9
if dpkg-query -W -f='${Status}\n' vstor 2>/dev/null | grep -qv "not-installed"; then
    dpkg-query -W -f='${Status}\n' vstor
    fail "dpkg still knows vstor"
fi
comm -13 "$WORK/before" "$WORK/after" >"$WORK/new"
comm -23 "$WORK/before" "$WORK/after" >"$WORK/gone"
left=$(grep -c . "$WORK/new" || true)
if [ "$left" != 0 ]; then
    echo "paths that were not there before the install:"; cat "$WORK/new"
    fail "$left paths left after purge"
fi
left_owned=$(while read -r p; do [ -e "$p" ] && [ ! -d "$p" ] && echo "$p"; done <"$WORK/owned" || true)
[ -z "$left_owned" ] || { echo "$left_owned"; fail "files of the package still exist"; }
echo "after purge: no path that was not there before ($(wc -l <"$WORK/after") paths compared)"
if [ -s "$WORK/gone" ]; then
    echo "paths that existed before and are gone (dpkg removes a directory the package shared once it is empty):"
    cat "$WORK/gone"
    grep -qv '^/etc/libvirt/hooks' "$WORK/gone" && fail "purge removed paths that were there before"
fi

step "the wheel, with the nova extra, in a fresh venv with Nova (tests/test_packaging.py)"
PY=$(sh scripts/python.sh)
VSTOR_PACKAGE_TESTS=1 "$PY" -m pytest -q -p no:cacheprovider tests/test_packaging.py
echo "ci-package: passed in $(( $(date +%s) - t0 ))s"
