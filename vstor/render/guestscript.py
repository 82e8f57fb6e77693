"""A guest kit (vstor.render.guestkit) as what the guest runs: a POSIX sh
script for root in the guest (busybox's sh is enough), and cloud-init
user-data that installs it and runs it at every boot.

The script's body is fixed text; the kit only sets the variables at its top.
It checks everything before it changes anything: each controller is where
the path leads, an NVMe controller with the host's vendor:device, not in use
in the guest, and (behind a vIOMMU) in an IOMMU group.  Then it loads the
vfio modules, raises the hugepage pool, and moves each controller to
vfio-pci the way the kernel documents (driver_override, unbind,
drivers_probe; never new_id, which takes every device of that id).
"""

from __future__ import annotations

from vstor.render.guestkit import Kit, describe

INSTALLED = "/usr/local/sbin/vstor-guest-kit"

_BODY = r"""
set -u
ROOT=${VSTOR_KIT_ROOT:-}    # tests run the kit on a sysfs/procfs tree under ROOT
SYS=$ROOT/sys
PROC=$ROOT/proc
say() { echo "vstor-guest-kit: $*"; }
die() { echo "vstor-guest-kit: error: $*" >&2; exit 1; }
[ -n "$ROOT" ] || [ "$(id -u)" = 0 ] || die "run this as root in the guest"

# The address at the end of a PCI path (DDDD:BB:SS.F/SS.F...): the guest's
# firmware numbers the bus behind each bridge, so it is read, not guessed.
resolve() {
    dev=${1%%/*}
    rest=${1#"$dev"}
    while [ -n "$rest" ]; do
        rest=${rest#/}
        hop=${rest%%/*}
        rest=${rest#"$hop"}
        f=$SYS/bus/pci/devices/$dev/secondary_bus_number
        [ -r "$f" ] || die "no PCI bridge at $dev in this guest (PCI path $1): is this the guest of domain '$DOMAIN'?"
        bus=$(cat "$f")
        case $bus in '' | *[!0-9]*) die "$f says '$bus', not a bus number" ;; esac
        dev=$(printf '%s:%02x:%s' "${dev%%:*}" "$bus" "$hop")
    done
    echo "$dev"
}

driver_of() { l=$(readlink "$SYS/bus/pci/devices/$1/driver" 2>/dev/null) && echo "${l##*/}"; }

# Refuse before touching anything: not the controller, or in use here.
check() { # BDF VENDOR:DEVICE ('' when the host did not say) TARGET
    d=$SYS/bus/pci/devices/$1
    [ -e "$d" ] || die "$3: no PCI device $1 in this guest"
    class=$(cat "$d/class")
    [ "$class" = 0x010802 ] || die "$3: $1 is not an NVMe controller (class $class), not what vstor passed through"
    if [ -n "$2" ]; then
        ids=$(cat "$d/vendor"):$(cat "$d/device")
        [ "$ids" = "$2" ] || die "$3: $1 is NVMe $ids, not $2 as on the host: not the controller vstor passed through"
    fi
    for ns in "$d"/nvme/nvme*/nvme*n*; do
        [ -e "$ns" ] || continue
        blk=$(echo "${ns##*/}" | sed 's/c[0-9]*n/n/')    # nvme0c0n1, a multipath path, is nvme0n1's
        if cat "$PROC/mounts" "$PROC/swaps" 2>/dev/null | grep -q "^/dev/$blk[p ]"; then
            die "$3: /dev/$blk on $1 is mounted or swap in this guest: stop using it first"
        fi
        for h in "$SYS/class/block/$blk"/holders/* "$SYS/class/block/$blk/$blk"p*/holders/*; do
            [ -e "$h" ] && die "$3: /dev/$blk on $1 is held by ${h##*/}: stop using it first"
        done
    done
    if [ "$MODE" = vfio ] && [ ! -e "$d/iommu_group" ]; then
        [ -n "$(ls "$SYS/class/iommu" 2>/dev/null)" ] || die "$3: $1 has no IOMMU group: the guest kernel's IOMMU is off (nothing in /sys/class/iommu); add intel_iommu=on to its command line and reboot"
        die "$3: $1 has no IOMMU group although the guest has an IOMMU: is this the guest of domain '$DOMAIN'?"
    fi
}

# Loaded, or built into the kernel (a built-in without parameters has no
# /sys/module entry).
loaded() {
    [ -d "$SYS/module/$(echo "$1" | tr - _)" ] ||
        grep -qs "/$1\.ko\$" "$ROOT/lib/modules/$(uname -r)/modules.builtin"
}
need() { # modules, in load order; modprobe when there is one
    for m in "$@"; do
        loaded "$m" && continue
        command -v modprobe >/dev/null 2>&1 || die "module $m is not loaded and there is no modprobe here: load $* in that order"
        modprobe "$m" || die "modprobe $m failed"
    done
}

noiommu() {
    if ! loaded vfio && command -v modprobe >/dev/null 2>&1; then
        modprobe vfio enable_unsafe_noiommu_mode=1 || die "modprobe vfio failed"
    fi
    p=$SYS/module/vfio/parameters/enable_unsafe_noiommu_mode
    [ -e "$p" ] || die "this guest kernel's vfio has no no-IOMMU mode (CONFIG_VFIO_NOIOMMU, off in Debian's kernels): give the domain a vIOMMU (guest='spdk' on the disk, then vstor apply on the host)"
    echo "vstor-guest-kit: WARNING: vfio-pci in no-IOMMU mode is UNSAFE: no DMA isolation, the controller can write anywhere in this guest's memory; the kernel is tainted" >&2
    [ "$(cat "$p")" = Y ] || echo Y > "$p" || die "cannot write $p"
}

hugepages() {
    f=$SYS/devices/system/node/node$NODE/hugepages/hugepages-${PAGE_KIB}kB/nr_hugepages
    # A guest kernel without NUMA has the size's global pool only.
    [ -e "$f" ] || f=$SYS/kernel/mm/hugepages/hugepages-${PAGE_KIB}kB/nr_hugepages
    [ -e "$f" ] || die "this guest kernel has no ${PAGE_KIB} kB hugepages"
    [ "$(cat "$f")" -ge "$HUGEPAGES" ] || echo "$HUGEPAGES" > "$f" || die "cannot write $f"
    have=$(cat "$f")
    [ "$have" -ge "$HUGEPAGES" ] || die "the guest kernel gave $have of $HUGEPAGES hugepages of ${PAGE_KIB} kB (its memory is fragmented): reserve them at boot, hugepages=$HUGEPAGES on its command line"
    if ! grep -q '^[^ ]* [^ ]* hugetlbfs ' "$PROC/mounts"; then
        mkdir -p "$ROOT/dev/hugepages" && mount -t hugetlbfs nodev "$ROOT/dev/hugepages" || die "cannot mount hugetlbfs on /dev/hugepages"
    fi
    say "hugepages: $have x ${PAGE_KIB} kB on node $NODE"
}

bind() { # BDF TARGET
    d=$SYS/bus/pci/devices/$1
    now=$(driver_of "$1")
    if [ "$now" = vfio-pci ]; then say "$2: $1 is on vfio-pci already"; return; fi
    # driver_override also keeps it on vfio-pci when something probes it again.
    echo vfio-pci > "$d/driver_override" || die "$2: cannot write $d/driver_override"
    if [ -n "$now" ]; then echo "$1" > "$d/driver/unbind" || die "$2: cannot unbind $1 from $now"; fi
    echo "$1" > "$SYS/bus/pci/drivers_probe" || die "$2: cannot probe $1"
    now=$(driver_of "$1")
    [ "$now" = vfio-pci ] || die "$2: $1 did not bind to vfio-pci (it has ${now:-no driver}; see dmesg)"
    say "$2: $1 on vfio-pci"
}

found= allowed=
for c in $CONTROLLERS; do
    target=${c%%=*}
    rest=${c#*=}
    path=${rest%%=*}
    rest=${rest#*=}
    ids=${rest%%=*}
    mask=${rest#*=}
    bdf=$(resolve "$path") || exit 1
    check "$bdf" "$ids" "$target"
    found="$found $target=$bdf=$mask"
    allowed="${allowed:+$allowed }$bdf"
done
if [ "$MODE" = noiommu ]; then
    noiommu
    need vfio vfio-pci
else
    need vfio vfio_iommu_type1 vfio-pci
fi
hugepages
for c in $found; do
    target=${c%%=*}
    rest=${c#*=}
    bind "${rest%%=*}" "$target"
    say "$target: SPDK app core mask -m ${rest#*=}"
done
say "SPDK setup.sh: PCI_ALLOWED='$allowed' HUGEMEM=$HUGEMEM HUGENODE=$NODE DRIVER_OVERRIDE=vfio-pci"
"""


def script(kit: Kit) -> str:
    """The kit as one sh script; its header comment says what it does."""
    header = "".join(f"# {line}\n" for line in describe(kit))
    controllers = " ".join(
        f"{','.join(c.targets)}={c.pci_path}={c.vendor + ':' + c.device if c.vendor else ''}"
        f"={c.core_mask}" for c in kit.controllers)
    values = (f"DOMAIN='{_quote(kit.domain)}'\n"
              f"MODE={'noiommu' if kit.noiommu else 'vfio'}\n"
              f"PAGE_KIB={kit.page_kib}\nHUGEPAGES={kit.hugepages}\nHUGEMEM={kit.hugemem_mb}\n"
              f"NODE={kit.node}\n"
              f"# target=PCI path=vendor:device=SPDK core mask, one word per controller\n"
              f"CONTROLLERS='{controllers}'\n")
    return (f"#!/bin/sh\n{header}#\n# Run it as root in the guest (it checks before it changes "
            f"anything, and may be run again).\n\n{values}{_BODY}")


def cloud_config(kit: Kit) -> str:
    """cloud-init user-data: the script installed as INSTALLED, run once
    now (runcmd) and at every later boot (bootcmd, which runs before
    write_files and so finds nothing to run at the first)."""
    body = "".join(f"      {line}\n" if line else "\n" for line in script(kit).splitlines())
    header = "".join(f"# {line}\n" for line in describe(kit)[:1])
    return ("#cloud-config\n" + header +
            "write_files:\n"
            f"  - path: {INSTALLED}\n"
            "    owner: root:root\n"
            "    permissions: '0755'\n"
            "    content: |\n" + body +
            "bootcmd:\n"
            f"  - [sh, -c, 'if [ -x {INSTALLED} ]; then {INSTALLED}; fi']\n"
            "runcmd:\n"
            f"  - [{INSTALLED}]\n")


def _quote(text: str) -> str:
    """Inside sh single quotes (the kit's domain name is one line already)."""
    return text.replace("'", "'\\''")
