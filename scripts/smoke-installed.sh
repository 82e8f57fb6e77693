#!/bin/bash
# Every entry point of the INSTALLED vstor package (scripts/ci-package.sh
# runs this between install and purge), from / so that no checkout is
# imported.  Prints each check; exit 1 at the end if any failed.
set -uo pipefail
cd /
# Debian's PATH: `vstor` and `python3` are the package's and Debian's, never a venv's.
export PATH=/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin
failed=0
ok()  { printf '  ok    %s\n' "$*"; }
bad() { printf '  FAIL  %s\n' "$*"; failed=1; }
check() {   # check DESCRIPTION COMMAND...: passes when COMMAND exits 0
    local what=$1; shift
    if out=$("$@" 2>&1); then ok "$what"; else bad "$what: $(printf '%s' "$out" | tail -3)"; fi
}
codes() {   # codes DESCRIPTION "ALLOWED CODES" COMMAND...: the exit code is one of ALLOWED
    local what=$1 allowed=$2; shift 2
    out=$("$@" 2>&1); local rc=$?
    case " $allowed " in *" $rc "*) ok "$what (exit $rc)";; *) bad "$what: exit $rc: $(printf '%s' "$out" | tail -3)";; esac
}
HOOK=/etc/libvirt/hooks/qemu.d/vstor
NS=https://vstor.dev/xmlns/domain/1

echo "== smoke of the installed package"
check "vstor is /usr/bin/vstor" test "$(command -v vstor)" = /usr/bin/vstor -a ! -e /usr/local/bin/vstor
check "vstor --version" sh -c 'vstor --version | grep -qx "vstor [0-9][0-9.]*"'
check "vstor is imported from Debian's dist-packages" sh -c \
    '/usr/bin/python3 -c "import vstor; print(vstor.__file__)" | grep -q "^/usr/lib/python3/dist-packages/vstor/"'
check "qemu.qmp and spdk from the package's private copies" sh -c \
    '/usr/bin/python3 -c "import vstor, qemu.qmp, spdk.rpc.client as c; print(qemu.qmp.__file__, c.__file__)" | grep -q "^/usr/lib/vstor/python/qemu/.* /usr/lib/vstor/python/spdk/"'
# doctor: 0 all good, 1 a check failed (this machine has no IOMMU, no NVMe).
codes "vstor doctor" "0 1" vstor doctor
check "vstor host show" vstor host show
check "vstor status" vstor status
check "vstor gc --dry-run" vstor gc --dry-run
codes "a bad command line is one line, exit 2" "2" vstor no-such-command
check "the libvirt hook is an executable conffile" sh -c \
    "test -x $HOOK && grep -qx $HOOK /var/lib/dpkg/info/vstor.conffiles"
check "the hook runs Debian's python3 on Debian's dist-packages" sh -c \
    "grep -qx 'PYTHON=/usr/bin/python3' $HOOK && grep -qx 'SYSPATH=/usr/lib/python3/dist-packages' $HOOK"
check "doctor calls the package's hook the package's, current (not another version)" sh -c \
    "vstor doctor --json | /usr/bin/python3 -c 'import json,sys; c={x[\"name\"]: x for x in json.load(sys.stdin)}[\"libvirt hook\"]; sys.exit(\"the vstor package\x27s hook\" not in c[\"detail\"] or c[\"status\"] == \"fail\")'"
check "the hook passes a domain that is not vstor's (shell only)" sh -c \
    "echo '<domain><name>other</name></domain>' | env -i PATH=/usr/bin:/bin $HOOK other prepare begin - | grep -c . | grep -qx 0"
check "the hook loads vstor for a vstor domain (release of one it holds nothing for)" sh -c \
    "echo \"<domain xmlns:vstor='$NS'><name>vstor-smoke</name><uuid>6a1d7e80-4c1b-4a8e-9a57-3b1a5a1f0c11</uuid><metadata><vstor:vstor/></metadata></domain>\" | env -i PATH=/usr/bin:/bin $HOOK vstor-smoke release end -"
check "the Proxmox hookscript template" test -x /usr/share/vstor/hooks/proxmox/vstor
check "the Proxmox hookscript ignores a phase it does not handle" \
    /usr/bin/python3 /usr/share/vstor/hooks/proxmox/vstor 100 post-start
check "vstor pve hooks install --help" sh -c 'vstor pve hooks install --help >/dev/null'
check "the migration agent answers a facts request" sh -c \
    "echo '{\"vstor_agent\": 1, \"op\": \"facts\"}' | vstor migrate agent | python3 -c 'import json, sys; a = json.load(sys.stdin); sys.exit(0 if a[\"ok\"] and \"hostnqn\" in a else 1)'"
codes "the migration agent refuses a malformed request with one JSON answer" "2" sh -c \
    "echo '{\"vstor_agent\": 1, \"op\": 1}' | vstor migrate agent | python3 -c 'import json, sys; a = json.load(sys.stdin); sys.exit(a[\"exit_code\"] if not a[\"ok\"] else 0)'"
# Nova is not installed here: the driver cannot load, and says so in one line.
if /usr/bin/python3 -c 'import nova' 2>/dev/null; then
    echo "  skip  the Nova driver's absence: nova is installed for /usr/bin/python3"
else
    check "without Nova, import vstor.nova.driver fails with ModuleNotFoundError" sh -c \
        "/usr/bin/python3 -c 'import vstor.nova.driver' 2>&1 | tail -1 | grep -q '^ModuleNotFoundError: No module named .\(oslo_log\|nova\).'"
    codes "without Nova, vstor nova install-driver refuses in one line" "2" vstor nova install-driver
fi
check "the gc units" test -f /lib/systemd/system/vstor-gc.service -a -f /lib/systemd/system/vstor-gc.timer \
    -a -f /lib/systemd/system/vstor.slice
check "the gc timer is enabled" test -L /etc/systemd/system/timers.target.wants/vstor-gc.timer
check "the metrics units, not enabled" sh -c 'test -f /lib/systemd/system/vstor-metrics.service \
    -a -f /lib/systemd/system/vstor-metrics-textfile.timer \
    -a ! -e /etc/systemd/system/multi-user.target.wants/vstor-metrics.service'
check "the Grafana dashboard" test -f /usr/share/vstor/grafana/vstor-dashboard.json
check "vstor metrics show, by Debian's python3 and python3-prometheus-client" sh -c \
    'vstor metrics show | grep -q "^vstor_gc_releases_total "'
if command -v systemd-analyze >/dev/null; then
    check "systemd-analyze verify" systemd-analyze verify /lib/systemd/system/vstor-gc.service \
        /lib/systemd/system/vstor-gc.timer /lib/systemd/system/vstor.slice \
        /lib/systemd/system/vstor-metrics.service /lib/systemd/system/vstor-metrics-textfile.service \
        /lib/systemd/system/vstor-metrics-textfile.timer
fi
check "man vstor, man vstor.conf" sh -c 'test -f /usr/share/man/man8/vstor.8.gz && test -f /usr/share/man/man5/vstor.conf.5.gz'
check "bash completion" test -f /usr/share/bash-completion/completions/vstor
check "/etc/vstor/vstor.conf is a conffile" grep -qx /etc/vstor/vstor.conf /var/lib/dpkg/info/vstor.conffiles
exit $failed
