#!/bin/sh
# Installs what vstor needs on Debian 12 (run as root): libvirt, QEMU,
# qemu-storage-daemon, the headers libvirt-python builds against, and vstor
# itself with its test dependencies (systemd-nspawn and mmdebstrap: the
# systemd container of tests/systemd; getfacl, the judge of the ACL entries
# confined daemons get; prometheus: promtool and a real Prometheus judge
# vstor's metrics, python3-prometheus-client for Debian's python3).  Safe to
# run again.
set -eu
cd "$(dirname "$0")/.."

PKGS="libvirt-daemon-system libvirt-clients libvirt-dev pkg-config gcc python3-dev python3-venv
      qemu-system-x86 qemu-system-common qemu-utils libxml2-utils
      busybox-static cpio kmod xz-utils tcpdump arping iproute2 util-linux groff-base man-db
      systemd-container mmdebstrap acl libseccomp2 prometheus python3-prometheus-client"

missing=""
for p in $PKGS; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
    echo "vstor: installing Debian packages:$missing"
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $missing
fi

# Proxmox VE's real qemu-server judges the configs `vstor pve` writes
# (tests/pve/oracle.py): its Perl packages, by its own installer, run where
# it is (../shared/pve/oracle; never copied into this project).
PVE_ORACLE=../shared/pve/oracle
if [ -x "$PVE_ORACLE/install-deps.sh" ]; then
    "$PVE_ORACLE/install-deps.sh"
elif [ -n "${CI:-}" ]; then
    echo "vstor: $PVE_ORACLE/install-deps.sh is missing: CI needs ../shared/pve" >&2
    exit 1
fi

PY=$(sh scripts/python.sh)
if [ "$PY" = ".venv/bin/python3" ] && [ ! -x .venv/bin/python3 ]; then
    # Debian's own python3 refuses system-wide pip installs (PEP 668):
    # vstor and its test dependencies go into a virtual environment here.
    echo "vstor: creating .venv (${PYTHON:-python3} is externally managed)"
    ${PYTHON:-python3} -m venv .venv
fi
echo "vstor: installing the vstor package ($PY)"
$PY -m pip install -q --disable-pip-version-check -e ".[test]"

# Nova's own code judges vstor's Nova support in the tests (its PCI and
# extra-spec parsers, its libvirt config classes): nova from PyPI in a
# virtual environment of its own, with vstor beside it.
NOVA_VERSION=34.0.0
if ! .nova-venv/bin/python3 -c "import nova, sys; sys.exit(0 if __import__('importlib.metadata').metadata.version('nova') == '$NOVA_VERSION' else 1)" 2>/dev/null; then
    echo "vstor: installing nova $NOVA_VERSION into .nova-venv (about a minute)"
    rm -rf .nova-venv
    ${PYTHON:-python3} -m venv .nova-venv
    .nova-venv/bin/python3 -m pip install -q --disable-pip-version-check "nova==$NOVA_VERSION"
fi
.nova-venv/bin/python3 -m pip install -q --disable-pip-version-check --no-deps -e .

# avocado-vt runs vstor's lab acceptance tests (tests/avocado, an avocado-vt
# test provider); CI runs its no-hardware cases through the real `avocado
# run` (tests/e2e/test_avocado.py). Its offline bootstrap checks for nc besides
# tcpdump and arping. tests/avocado/install.py registers the provider in
# avocado-vt's test-providers.d and bootstraps only when that is not done yet.
AVOCADO_VERSION=113.0
dpkg-query -W -f='${Status}' netcat-openbsd 2>/dev/null | grep -q "ok installed" || {
    echo "vstor: installing Debian package netcat-openbsd (avocado-vt's bootstrap needs nc)"
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends netcat-openbsd
}
if ! $PY -c "import sys; from importlib.metadata import version as v
sys.exit(0 if v('avocado-framework') == v('avocado-framework-plugin-vt') == '$AVOCADO_VERSION' else 1)" 2>/dev/null; then
    echo "vstor: installing avocado-framework and avocado-framework-plugin-vt $AVOCADO_VERSION ($PY)"
    $PY -m pip install -q --disable-pip-version-check \
        "avocado-framework==$AVOCADO_VERSION" "avocado-framework-plugin-vt==$AVOCADO_VERSION"
fi
$PY tests/avocado/install.py
