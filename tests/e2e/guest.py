"""A tiny test guest: a Debian kernel and a busybox initramfs, built once from
Debian packages and cached ($VSTOR_TEST_CACHE, default /var/cache/vstor-tests).

The guest reads its job from the kernel command line, so one initramfs serves
every test (see `job()`):

    vstor.job=write-verify|verify|read|script  vstor.dev=vda[,vdb]  vstor.seed=0..2**31-1
    vstor.size=BYTES  vstor.timeout=SECONDS  vstor.hold=SECONDS  vstor.topo=0|1

It waits for each /dev/<dev> to be a block device, holds for `hold` seconds
(time for a test to act on the running domain), then per device:
write-verify writes expected_pattern(seed, size), syncs, drops caches and reads
it back; verify reads and compares with the pattern; read only reports the
checksum of the first `size` bytes.  Markers on the serial console, one per line:

    VSTOR-GUEST: START uptime=S
    VSTOR-GUEST: READY dev=vda
    VSTOR-GUEST: DISK dev=vda pci=0000:ff:00.0 numa_node=0 label=L   (with vstor.topo=1)
    VSTOR-GUEST: NODE node=0 cpus=0-1                                 (with vstor.topo=1)
    VSTOR-GUEST: HOLD seconds=N
    VSTOR-GUEST: wrote sha256=HEX dev=vda
    VSTOR-GUEST: read sha256=HEX dev=vda
    VSTOR-GUEST: AWAIT-UNPLUG dev=vdb, GONE dev=vdb    (with vstor.unplug=vdb)
    VSTOR-GUEST: DONE uptime=S        or    VSTOR-GUEST: FAIL reason

then it powers off.

vstor.topo=1 (job(topology=True)) reports, once every device is there, where
each disk's PCI device is (the guest kernel's numa_node for it, -1: none) and
the label the host put in the block just after the job's region (see
label_disk(): guests name disks in probe order, so only the label tells which
backing file a vdX is), then each guest node's CPUs.

vstor.job=script (see script_job()) runs the sh script the host put on the
disk and reports what it printed (`OUT line`, then `SCRIPT rc=N`).

vstor.job=loop (see loop_job()) writes records without pause until the host
tells it to stop through the disk itself (stop_loop()), e.g. across a live
migration, printing `LOOP n=N uptime=S` every 10 rounds; then it verifies the
whole region like write-verify does (loop_expected() is what the file must hold).
"""

from __future__ import annotations

import fcntl
import gzip
import hashlib
import lzma
import os
import re
import shutil
import stat
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape, quoteattr

# insmod order matters: each module after the ones it needs ("Unknown symbol"
# otherwise).  Debian ships no modules.dep, so the order is spelled out and
# checked against `modinfo -F depends` at build time.  nvme-core needs t10-pi,
# whose CRC helpers look up crypto algorithms: the generic ones are loaded
# first so no request_module (there is no modprobe in the guest) is needed.
MODULES = (
    "virtio_ring", "virtio", "virtio_pci_legacy_dev", "virtio_pci_modern_dev",
    "virtio_pci", "virtio_blk",
    "crct10dif_common", "crct10dif_generic", "crc-t10dif", "crc64",
    "crc64_rocksoft_generic", "crc64-rocksoft", "t10-pi", "nvme-core", "nvme",
    # vfio-pci for the guest-kit test (Debian's 6.1: no iommufd; vfio_virqfd
    # is still a module of its own).
    "irqbypass", "vfio", "vfio_virqfd", "vfio_iommu_type1", "vfio-pci-core", "vfio-pci",
)
RECORD = 32         # bytes per pattern record, see expected_pattern()
MARKER = "VSTOR-GUEST: "

# The pattern generator is shared verbatim by the guest (busybox awk) and, in
# Python, by expected_pattern().  MINSTD keeps every product below 2**53, so
# awk's doubles compute it exactly.
PATTERN_AWK = r"""BEGIN { x = seed % 2147483646 + 1
  for (r = 0; r < n; r++) { x = (x * 48271) % 2147483647; printf "%08x:%011d:%010d\n", x, r, seed } }"""
# What the loop job's region holds after n >= blocks rounds (see loop_expected()):
# block b, the record of the last round k < n with k % blocks == b.
LOOP_AWK = r"""BEGIN { for (b = 0; b < nb; b++) { k = b + nb * int((n - 1 - b) / nb)
  printf "%-511s\n", "vstor seed=" seed " n=" k } }"""
LOOP_BLOCK = 512
LOOP_STOP = b"STOP"

INIT = r"""#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
# Markers go through the kernel log: printk writes the console synchronously,
# so nothing is lost to the UART buffer when poweroff -f follows at once.
say() { echo "<2>VSTOR-GUEST: $*" > /dev/kmsg || echo "VSTOR-GUEST: $*"; }
uptime_s() { cut -d' ' -f1 /proc/uptime; }
fail() { say "FAIL $*"; poweroff -f; sleep 60; }
say "START uptime=$(uptime_s)"

for m in @MODULES@; do
    insmod /lib/modules/$m.ko 2>/tmp/err || fail "insmod $m: $(cat /tmp/err)"
done

job= seed=0 size=1048576 devs=vda timeout=60 hold=0 unplug= linger=0 topo=0
for arg in $(cat /proc/cmdline); do
    case $arg in
    vstor.job=*) job=${arg#*=} ;;
    vstor.seed=*) seed=${arg#*=} ;;
    vstor.size=*) size=${arg#*=} ;;
    vstor.dev=*) devs=$(echo ${arg#*=} | tr , ' ') ;;
    vstor.timeout=*) timeout=${arg#*=} ;;
    vstor.hold=*) hold=${arg#*=} ;;
    vstor.unplug=*) unplug=${arg#*=} ;;
    vstor.linger=*) linger=${arg#*=} ;;
    vstor.topo=*) topo=${arg#*=} ;;
    esac
done
case $job in write-verify|verify|read|loop|script) ;; *) fail "unknown job '$job'" ;; esac

# A missing /dev/vda would silently become a plain file on devtmpfs: wait for
# a real block device.
for dev in $devs; do
    n=0
    while [ ! -b /dev/$dev ]; do
        [ $n -ge $((timeout * 10)) ] && fail "no block device /dev/$dev after ${timeout}s"
        usleep 100000; n=$((n + 1))
    done
    have=$(blockdev --getsize64 /dev/$dev)
    [ "$have" -ge "$size" ] || fail "/dev/$dev has $have bytes, job needs $size"
    say "READY dev=$dev"
done
# topo: the disk's PCI device is the first directory named like a PCI
# address up from its block device's (virtio: virtioN's parent; NVMe: the
# parent of nvme/nvmeN, which has a numa_node of its own).
if [ "$topo" = 1 ]; then
    X=[0-9a-f]
    for dev in $devs; do
        pci=$(readlink -f /sys/block/$dev/device)
        while [ "$pci" != /sys ]; do
            case ${pci##*/} in $X$X$X$X:$X$X:$X$X.[0-7]) break ;; esac
            pci=${pci%/*}
        done
        label=$(dd if=/dev/$dev bs=512 skip=$((size / 512)) count=1 2>/dev/null | head -n 1 | tr -cd 'A-Za-z0-9._-')
        say "DISK dev=$dev pci=${pci##*/} numa_node=$(cat $pci/numa_node 2>/dev/null || echo none) label=${label:-none}"
    done
    for node in /sys/devices/system/node/node[0-9]*; do
        say "NODE node=${node##*/node} cpus=$(cat $node/cpulist)"
    done
fi
if [ "$hold" -gt 0 ]; then say "HOLD seconds=$hold"; sleep $hold; fi

# loop: write 512-byte records "vstor seed=S n=N" (space-padded, newline-ended)
# to block N % blocks of the first `size` bytes, each with fsync, and read it
# back from the device, until the host writes STOP into the block just after
# them (honoured once every block was written) or `timeout` seconds of uptime
# pass.  Then the whole region is read back and compared with what the last
# writes must have left.
loop() {
    dev=${devs%% *} nb=$((size / 512)) n=0
    [ $nb -ge 1 ] || fail "loop: vstor.size must be at least 512"
    [ "$(blockdev --getsize64 /dev/$dev)" -ge $(( (nb + 1) * 512 )) ] || fail "loop: /dev/$dev has no block after the region"
    say "LOOP START blocks=$nb uptime=$(uptime_s)"
    while :; do
        b=$((n % nb))
        printf '%-511s\n' "vstor seed=$seed n=$n" > /tmp/rec
        dd if=/tmp/rec of=/dev/$dev bs=512 seek=$b count=1 conv=notrunc,fsync 2>/tmp/err || fail "loop: write n=$n: $(cat /tmp/err)"
        blockdev --flushbufs /dev/$dev; echo 3 > /proc/sys/vm/drop_caches
        dd if=/dev/$dev of=/tmp/back bs=512 skip=$b count=1 2>/tmp/err || fail "loop: read n=$n: $(cat /tmp/err)"
        cmp -s /tmp/rec /tmp/back || fail "loop: block $b reads back '$(head -c 40 /tmp/back)' after writing n=$n"
        n=$((n + 1))
        [ $((n % 10)) -eq 0 ] && say "LOOP n=$n uptime=$(uptime_s)"
        [ $n -ge $nb ] && [ "$(dd if=/dev/$dev bs=512 skip=$nb count=1 2>/dev/null | head -c 4)" = STOP ] && break
        up=$(uptime_s)
        [ ${up%.*} -lt $timeout ] || fail "loop: no STOP after ${timeout}s of uptime (n=$n)"
    done
    say "LOOP STOP rounds=$n uptime=$(uptime_s)"
    awk -v seed=$seed -v nb=$nb -v n=$n '@LOOP@' > /tmp/pattern
    want=$(sha256sum < /tmp/pattern | cut -d' ' -f1)
    say "wrote sha256=$want dev=$dev rounds=$n"
    sync; blockdev --flushbufs /dev/$dev; echo 3 > /proc/sys/vm/drop_caches
    head -c $((nb * 512)) /dev/$dev > /tmp/got
    got=$(sha256sum < /tmp/got | cut -d' ' -f1)
    say "read sha256=$got dev=$dev"
    [ "$got" = "$want" ] || fail "/dev/$dev: read $got, expected $want: $(cmp /tmp/pattern /tmp/got 2>&1)"
    say "DONE uptime=$(uptime_s)"
    poweroff -f
    sleep 60
}
[ $job = loop ] && loop

# script: run the sh script the host wrote on the first disk (padded with
# newlines to whole sectors); each line it prints becomes an OUT marker.
script() {
    dev=${devs%% *}
    cat /dev/$dev > /tmp/job.sh 2>/tmp/err || fail "script: read /dev/$dev: $(cat /tmp/err)"
    sh /tmp/job.sh > /tmp/out 2>&1
    rc=$?
    while IFS= read -r line; do say "OUT $line"; done < /tmp/out
    say "SCRIPT rc=$rc"
    say "DONE uptime=$(uptime_s)"
    poweroff -f
    sleep 60
}
[ $job = script ] && script

pattern() {
    awk -v seed=$seed -v n=$(( (size + @RECORD@ - 1) / @RECORD@ )) '@PATTERN@' | head -c $size
}
readback() {
    sync; blockdev --flushbufs /dev/$1; echo 3 > /proc/sys/vm/drop_caches
    head -c $size /dev/$1 | sha256sum | cut -d' ' -f1
}

[ $job = read ] || { pattern > /tmp/pattern; want=$(sha256sum < /tmp/pattern | cut -d' ' -f1); }
for dev in $devs; do
    if [ $job = write-verify ]; then
        dd if=/tmp/pattern of=/dev/$dev bs=65536 conv=fsync 2>/tmp/err || fail "write /dev/$dev: $(cat /tmp/err)"
        say "wrote sha256=$want dev=$dev"
    fi
    got=$(readback $dev)
    say "read sha256=$got dev=$dev"
    [ $job = read ] || [ "$got" = "$want" ] || fail "/dev/$dev: read $got, expected $want"
done
# unplug: the host takes the device away (hot-unplug); wait until it is gone.
if [ -n "$unplug" ]; then
    say "AWAIT-UNPLUG dev=$unplug"
    n=0
    while [ -b /dev/$unplug ]; do
        [ $n -ge $((timeout * 10)) ] && fail "/dev/$unplug still there after ${timeout}s"
        usleep 100000; n=$((n + 1))
    done
    say "GONE dev=$unplug"
    # The host still has to release the disk's backend and record it.
    [ "$linger" -gt 0 ] && sleep $linger
fi
say "DONE uptime=$(uptime_s)"
poweroff -f
"""


@dataclass(frozen=True)
class Guest:
    kernel: Path
    initrd: Path


def cache_dir() -> Path:
    return Path(os.environ.get("VSTOR_TEST_CACHE", "/var/cache/vstor-tests"))


def expected_pattern(seed: int, size: int) -> bytes:
    """Exactly the bytes the guest writes for (seed, size): 32-byte records
    'xxxxxxxx:rrrrrrrrrrr:ssssssssss\\n' (MINSTD state, record, seed)."""
    if not 0 <= seed < 2**31:
        raise ValueError("seed must be in 0..2**31-1 (busybox awk prints it as an int)")
    x = seed % 2147483646 + 1
    records = []
    for r in range(-(-size // RECORD)):
        x = x * 48271 % 2147483647
        records.append(b"%08x:%011d:%010d\n" % (x, r, seed))
    return b"".join(records)[:size]


def job(kind: str, dev: str = "vda", seed: int = 1234, size: int = 1 << 20,
        timeout: int = 60, hold: int = 0, unplug: str = "", topology: bool = False) -> str:
    """The kernel command line words for one guest job; `dev` may list several
    devices separated by commas (each waited for: one may be hot-plugged);
    `unplug`: a device the job then waits to see go (AWAIT-UNPLUG, GONE);
    `topology`: report DISK and NODE lines (see parse_console()), each disk's
    label read from the block at byte `size` (see label_disk())."""
    if kind not in ("write-verify", "verify", "read"):
        raise ValueError(f"unknown guest job {kind!r}")
    expected_pattern(seed, 0)   # validates the seed
    if topology and size % 512:
        raise ValueError("with topology, size must be a multiple of 512 (the label block follows it)")
    return (f"vstor.job={kind} vstor.dev={dev} vstor.seed={seed} vstor.size={size}"
            f" vstor.timeout={timeout} vstor.hold={hold}"
            + (f" vstor.unplug={unplug} vstor.linger=20" if unplug else "")
            + (" vstor.topo=1" if topology else ""))


def label_disk(path: str | os.PathLike, size: int, label: str) -> None:
    """Write `label` into the block at byte `size` of the disk file `path`, where
    a topology job (job(topology=True)) reads it back as its DISK line's label."""
    if not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", label) or size % 512:
        raise ValueError("a label is 1-64 of A-Za-z0-9._- at a multiple of 512 bytes")
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, (label + "\n").encode().ljust(512, b"\n"), size)
        os.fsync(fd)
    finally:
        os.close(fd)


def cpulist(text: str) -> set[int]:
    """A kernel cpulist ('0-3,8') as a set of CPU numbers."""
    out: set[int] = set()
    for part in text.split(","):
        if part:
            lo, _, hi = part.partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
    return out


def loop_job(dev: str = "vda", seed: int = 1234, size: int = 32 << 10, timeout: int = 300) -> str:
    """The kernel command line words for the loop job: records written and read
    back without pause until the host writes LOOP_STOP at byte `size` of the
    disk (see stop_loop()) or `timeout` seconds of guest uptime pass.  `size`
    is a multiple of LOOP_BLOCK; the disk needs one block more."""
    expected_pattern(seed, 0)   # validates the seed
    if size <= 0 or size % LOOP_BLOCK:
        raise ValueError(f"size must be a positive multiple of {LOOP_BLOCK}")
    return (f"vstor.job=loop vstor.dev={dev} vstor.seed={seed} vstor.size={size}"
            f" vstor.timeout={timeout} vstor.hold=0")


def script_job(dev: str = "vda", timeout: int = 120) -> str:
    """The kernel command line words for the script job: the guest runs the
    sh script on `dev` (see script_disk()) and reports its output as
    `OUT line` markers, then `SCRIPT rc=N` (see script_output())."""
    return f"vstor.job=script vstor.dev={dev} vstor.size=512 vstor.timeout={timeout} vstor.hold=0"


def script_disk(path: str | os.PathLike, text: str) -> None:
    """A raw disk holding `text`, padded with newlines to whole sectors."""
    data = text.encode()
    Path(path).write_bytes(data + b"\n" * (-len(data) % 512 or 512))


def script_output(text: str) -> tuple[list[str], int | None]:
    """The script job's output lines and exit code (None: it did not finish)."""
    lines, rc = [], None
    for body in parse_console(text)["markers"]:
        word, _, rest = body.partition(" ")
        if word == "OUT":
            lines.append(rest)
        elif word == "SCRIPT" and rest.startswith("rc="):
            rc = int(rest[3:])
    return lines, rc


def loop_record(seed: int, n: int) -> bytes:
    """The block the loop job writes in round n (to block n % blocks)."""
    return (f"vstor seed={seed} n={n}".ljust(LOOP_BLOCK - 1) + "\n").encode()


def loop_expected(seed: int, size: int, rounds: int) -> bytes:
    """Exactly the first `size` bytes the loop job leaves after `rounds` rounds."""
    blocks = size // LOOP_BLOCK
    if rounds < blocks:
        raise ValueError("the loop job stops only after writing every block once")
    return b"".join(loop_record(seed, b + blocks * ((rounds - 1 - b) // blocks))
                    for b in range(blocks))


def stop_loop(path: str | os.PathLike, size: int) -> None:
    """Tell a loop job on the disk backed by `path` to stop (written by the
    host into the block after the region; the guest reads it every round)."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, LOOP_STOP.ljust(LOOP_BLOCK, b"\n"), size)
        os.fsync(fd)
    finally:
        os.close(fd)


def parse_loop(text: str) -> dict:
    """The loop job's markers: {'started' (uptime or None), 'progress': [(n,
    uptime)...], 'rounds' (at STOP, or None), 'wrote', 'read', 'done', 'fail'}."""
    parsed = parse_console(text)
    out = {"started": None, "progress": [], "rounds": None, "wrote": parsed["wrote"],
           "read": parsed["read"], "done": parsed["done"], "fail": parsed["fail"]}
    for body in parsed["markers"]:
        word, _, rest = body.partition(" ")
        if word != "LOOP":
            continue
        fields = dict(f.split("=", 1) for f in rest.split() if "=" in f)
        if rest.startswith("START"):
            out["started"] = float(fields.get("uptime", "nan"))
        elif rest.startswith("STOP"):
            out["rounds"] = int(fields["rounds"])
        elif "n" in fields:
            out["progress"].append((int(fields["n"]), float(fields.get("uptime", "nan"))))
    return out


def parse_console(text: str) -> dict:
    """The guest's markers from a console log: {'done', 'fail', 'wrote', 'read'
    (checksums of the first device), 'devices': {dev: {'wrote', 'read'}},
    'ready': [dev...], 'start_uptime', 'done_uptime', 'markers': [lines],
    'disks': {dev: {'pci', 'numa_node' (int; None: no PCI device found), 'label'}}, 'nodes': {node:
    {cpu...}}} (the last two from a topology job)."""
    out = {"done": False, "fail": None, "wrote": None, "read": None,
           "devices": {}, "ready": [], "start_uptime": None, "done_uptime": None,
           "markers": [], "disks": {}, "nodes": {}}
    for line in text.splitlines():
        at = line.find(MARKER)
        if at < 0:
            continue
        body = line[at + len(MARKER):].strip()
        out["markers"].append(body)
        word, _, rest = body.partition(" ")
        fields = dict(f.split("=", 1) for f in rest.split() if "=" in f)
        if word == "FAIL":
            out["fail"] = rest
        elif word == "DONE":
            out["done"] = True
            out["done_uptime"] = float(fields.get("uptime", "nan"))
        elif word == "START":
            out["start_uptime"] = float(fields.get("uptime", "nan"))
        elif word == "READY":
            out["ready"].append(fields.get("dev"))
        elif word == "DISK":
            node = fields.get("numa_node", "none")
            out["disks"][fields.get("dev")] = {"pci": fields.get("pci"), "label": fields.get("label"),
                                               "numa_node": int(node) if node.lstrip("-").isdigit() else None}
        elif word == "NODE":
            out["nodes"][int(fields["node"])] = cpulist(fields.get("cpus", ""))
        elif word in ("wrote", "read"):
            dev = fields.get("dev")
            out["devices"].setdefault(dev, {})[word] = fields.get("sha256")
            if out[word] is None:
                out[word] = fields.get("sha256")
    return out


def domain_xml(name: str, guest: Guest, cmdline_job: str, disks_xml: str = "", *,
               memory_mib: int = 256, vcpus: int = 1, console_log: str | os.PathLike | None = None,
               memory_backing: str | None = "memfd", machine: str = "q35",
               qemu_args: tuple[str, ...] = ()) -> str:
    """A TCG domain (KVM hangs on this machine) that boots the guest with
    `cmdline_job` (see job()) and `disks_xml` inside <devices>.  memory_backing:
    'memfd' or 'hugepages' (both shared, as vhost-user needs) or None.
    qemu_args go to <qemu:commandline> (e.g. an emulated NVMe controller)."""
    console_log = console_log or f"/var/log/libvirt/qemu/{name}-console.log"
    backing = {
        None: "",
        "memfd": "<memoryBacking><source type='memfd'/><access mode='shared'/></memoryBacking>",
        "hugepages": "<memoryBacking><hugepages/><access mode='shared'/></memoryBacking>",
    }[memory_backing]
    qemu_ns = " xmlns:qemu='http://libvirt.org/schemas/domain/qemu/1.0'" if qemu_args else ""
    qemu_cmdline = ""
    if qemu_args:
        qemu_cmdline = ("<qemu:commandline>"
                        + "".join(f"<qemu:arg value={quoteattr(a)}/>" for a in qemu_args)
                        + "</qemu:commandline>")
    # printk.devkmsg=on: /dev/kmsg writes are rate-limited to 10 per 5 s otherwise.
    cmdline = f"console=ttyS0 panic=-1 quiet printk.devkmsg=on {cmdline_job}"
    return f"""<domain type='qemu'{qemu_ns}>
  <name>{escape(name)}</name>
  <memory unit='MiB'>{memory_mib}</memory>
  {backing}
  <vcpu>{vcpus}</vcpu>
  <os>
    <type arch='x86_64' machine='{machine}'>hvm</type>
    <kernel>{escape(str(guest.kernel))}</kernel>
    <initrd>{escape(str(guest.initrd))}</initrd>
    <cmdline>{escape(cmdline)}</cmdline>
  </os>
  <features><acpi/></features>
  <clock offset='utc'/>
  <on_poweroff>destroy</on_poweroff>
  <on_reboot>destroy</on_reboot>
  <on_crash>destroy</on_crash>
  <devices>
    <console type='file'><source path={quoteattr(str(console_log))}/><target type='serial'/></console>
    <controller type='usb' model='none'/>
    <memballoon model='none'/>
    {disks_xml}
  </devices>
  {qemu_cmdline}
</domain>
"""


def build_guest() -> Guest:
    """The cached guest, built on first use (needs root, apt and network access
    to the Debian archive once)."""
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    # QEMU runs as libvirt-qemu: it must be able to reach the kernel and initrd.
    cache.chmod(0o755)
    kpkg = _kernel_package()
    init = _init_script()
    key = hashlib.sha256(f"{kpkg}\n{MODULES}\n{init}".encode()).hexdigest()[:12]
    out = cache / f"guest-{kpkg.removeprefix('linux-image-')}-{key}"
    guest = Guest(out / "vmlinuz", out / "initrd.img")
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)   # one build at a time across processes
        if not guest.initrd.exists():
            _build(kpkg, init, out, guest)
    return guest


def _kernel_package() -> str:
    for attempt in range(2):
        deps = subprocess.run(["apt-cache", "depends", "linux-image-amd64"],
                              capture_output=True, text=True).stdout
        found = re.search(r"Depends: (linux-image-\S+-amd64)\b", deps)
        if found:
            return found.group(1)
        if attempt == 0:    # a fresh machine has no package lists yet
            subprocess.run(["apt-get", "update", "-q"], check=True, capture_output=True)
    raise RuntimeError("apt-cache knows no linux-image-amd64 dependency: " + deps)


def _init_script() -> str:
    return (INIT.replace("@MODULES@", " ".join(MODULES))
            .replace("@RECORD@", str(RECORD))
            .replace("@PATTERN@", PATTERN_AWK)
            .replace("@LOOP@", LOOP_AWK))


def _build(kpkg: str, init: str, out: Path, guest: Guest) -> None:
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".build-") as tmp:
        tmp = Path(tmp)
        # The sandbox user _apt cannot write into a root-owned temporary dir.
        subprocess.run(["apt-get", "download", "-q", "-o", "APT::Sandbox::User=root",
                        kpkg, "busybox-static"], cwd=tmp, check=True, capture_output=True)
        pkgroot = tmp / "pkgs"
        for deb in tmp.glob("*.deb"):
            subprocess.run(["dpkg", "-x", str(deb), str(pkgroot)], check=True)
        root = tmp / "initramfs"
        for d in ("bin", "dev", "proc", "sys", "tmp", "lib/modules"):
            (root / d).mkdir(parents=True)
        shutil.copy2(pkgroot / "bin/busybox", root / "bin/busybox")
        os.mknod(root / "dev/console", 0o600 | stat.S_IFCHR, os.makedev(5, 1))
        _copy_modules(pkgroot, root / "lib/modules")
        (root / "init").write_text(init)
        (root / "init").chmod(0o755)
        staged = tmp / "out"
        staged.mkdir()
        (vmlinuz,) = (pkgroot / "boot").glob("vmlinuz-*")
        shutil.copy2(vmlinuz, staged / "vmlinuz")
        _pack(root, staged / "initrd.img")
        for f in staged.iterdir():
            f.chmod(0o644)
        staged.chmod(0o755)
        staged.rename(out)


def _copy_modules(pkgroot: Path, dest: Path) -> None:
    found = {}
    for ko in (pkgroot / "lib/modules").rglob("*.ko*"):
        found[ko.name.split(".ko")[0]] = ko
    loaded: set[str] = set()
    for name in MODULES:
        ko = found.get(name)
        if ko is None:
            raise RuntimeError(f"kernel package has no module {name}")
        data = ko.read_bytes()
        if ko.name.endswith(".xz"):   # busybox insmod takes plain .ko only
            data = lzma.decompress(data)
        target = dest / f"{name}.ko"
        target.write_bytes(data)
        deps = subprocess.run(["modinfo", "-F", "depends", str(target)],
                              capture_output=True, text=True, check=True).stdout.strip()
        missing = {d for d in deps.split(",") if d} - loaded
        if missing:
            raise RuntimeError(f"module {name} needs {sorted(missing)} loaded before it")
        loaded |= {name, name.replace("-", "_")}


def _pack(root: Path, initrd: Path) -> None:
    names = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
    cpio = subprocess.run(["cpio", "-o", "-H", "newc", "--owner=0:0", "--reproducible", "--quiet"],
                          cwd=root, input=("\n".join(names) + "\n").encode(),
                          capture_output=True, check=True)
    with gzip.GzipFile(initrd, "wb", mtime=0) as gz:
        gz.write(cpio.stdout)
