"""`vstor migrate agent`, the real process, fed every request a hostile or
broken source could send (issue 21): each gets exactly one JSON answer on
stdout and the exit code docs/migration.md documents (2 for a request that is
not one), no traceback, nothing on the host changed, and no block source
opened that is not one of the host model's block devices."""

import json
import os
import stat
import subprocess
import sys

import pytest

from vstor.config import Config
from vstor.errors import BadInput
from vstor.host.model import is_listed
from vstor.host.sysfs import SysFS
from vstor.migration import request as requests
from vstor.migration import storage

from tests.helpers import ROOT, agent, dest  # noqa: F401 (dest: the destination's fixture)
from tests.helpers import agent_domain as domain

REQ = {"vstor_agent": 1, "op": "check"}


def check(**more) -> dict:
    return {**REQ, "xml": domain(), **more}


def prepare(**more) -> dict:
    return {"vstor_agent": 1, "op": "prepare", "xml": domain(), "from": "compute-1", **more}


def files(**entry) -> dict:
    return {"vdb": {"path": "/x/a.raw", "kind": "file", "size": 4096, **entry}}


def _snapshot(d) -> dict:
    """Every file under the destination's directories, and the ptys /dev/pts holds."""
    out = {}
    for top, _dirs, names in os.walk(d.tmp):
        for name in names:
            path = os.path.join(top, name)
            out[path] = os.lstat(path).st_mtime_ns
    pts = sorted(os.listdir("/dev/pts")) if os.path.isdir("/dev/pts") else []
    return {"files": out, "pts": pts}


DEEP = b"[" * 200_000 + b"]" * 200_000
HOSTILE = [
    # not a request at all
    ("empty", b"", "is not JSON"),
    ("not json", b"{'vstor_agent': 1}", "is not JSON"),
    ("cut short", b'{"vstor_agent": 1, "op": "check", "xml": "<dom', "is not JSON"),
    ("not UTF-8", b'{"vstor_agent": 1, "op": "\xff\xfe"}', "is not UTF-8"),
    ("a list", b"[1]", "protocol 1"),
    ("NaN", b'{"vstor_agent": NaN, "op": "facts"}', "NaN, which is not JSON"),
    ("a number of 5000 digits", b'{"vstor_agent": ' + b"9" * 5000 + b', "op": "facts"}', "is not JSON"),
    ("a key twice", b'{"vstor_agent": 1, "op": "facts", "op": "check"}', "key 'op' twice"),
    # nested, or large, beyond any request
    ("nested 200000 deep", DEEP, "nests deeper than any request"),
    ("nested in a string-looking way", b'{"a": "\\\\"' + b"[" * 50_000 + b"}", "nests deeper"),
    ("an unclosed string", b'{"a": "\\"' * 100_000, "is not JSON"),
    ("nested in a file", check(files={"vdb": {"path": {"a": {"b": 1}}}}), "nests deeper"),
    ("100000 lists", b'{"vstor_agent": 1, "x": [' + b"[]," * 100_000 + b"[]]}", "more than any request"),
    ("larger than 16 MiB", b" " * (16 << 20) + b"{}", "larger than 16 MiB"),
    ("a file too many", check(files={f"vd{a}{b}": files()["vdb"] for a in "abcdefghijklmnopqrstuvwxyz"
                                     for b in "abcdefghijklmnopqrstuvwxyz"}), "more than 512"),
    # wrong types: a boolean is not an integer, nor is a float
    ("protocol true", {"vstor_agent": True, "op": "facts"}, "protocol 1"),
    ("protocol 1.0", {"vstor_agent": 1.0, "op": "facts"}, "protocol 1"),
    ("protocol '1'", {"vstor_agent": "1", "op": "facts"}, "protocol 1"),
    ("op a number", {"vstor_agent": 1, "op": 3}, "unknown agent request '3'"),
    ("size true", check(files=files(size=True)), "files.vdb.size must be a whole number"),
    ("size 4096.0", check(files=files(size=4096.0)), "not a fractional number"),
    ("size negative", check(files=files(size=-1)), "files.vdb.size must be a whole number"),
    ("kind a FIFO", check(files=files(kind="fifo")), "files.vdb.kind must be 'file' or 'block'"),
    ("cold 1", check(cold=1), "cold must be true or false, not a number"),
    ("cold 'yes'", prepare(cold="yes"), "cold must be true or false, not a string"),
    ("uuid a number", {"vstor_agent": 1, "op": "status", "name": "vm", "uuid": 7}, "uuid must be a string"),
    ("imports a list", check(imports=[]), "imports must be an object, not a list"),
    ("an import of numbers", check(imports={"vdb": {"traddr": 1}}), "imports.vdb.traddr must be a string"),
    # NUL, control characters, half a surrogate pair
    ("NUL in a file path", check(files=files(path="/x/a.raw\x00/etc/shadow")), "holds a NUL"),
    ("NUL in the XML", check(xml=domain() + "\x00"), "xml '"),
    ("a surrogate in the XML", check(xml=domain().replace("vm", "v\ud800m", 1)), "half a surrogate pair"),
    ("a surrogate in a name", {"vstor_agent": 1, "op": "status", "name": "v\udfffm"}, "half a surrogate"),
    ("an escape in the XML", check(xml=domain().replace("vm", "v\x1b[2Jm", 1)), "a control character"),
    ("NUL in an import", check(imports={"vdb": {"traddr": "1.2.3.4\x00"}}), "holds a NUL"),
    # names that are not names
    ("a newline in from", prepare(**{"from": "compute-1\nvstor: ok"}), "from 'compute-1\\nvstor: ok'"),
    ("a shell word in from", prepare(**{"from": "a;reboot"}), "is not an address"),
    ("an empty from", prepare(**{"from": ""}), "is not an address"),
    ("a newline in a name", {"vstor_agent": 1, "op": "abort", "name": "vm\nx"}, "control character"),
    ("a slash in a name", {"vstor_agent": 1, "op": "abort", "name": "../vm"}, "is not a domain name"),
    ("a newline in the domain's name", check(xml=domain().replace("<name>vm", "<name>vm&#10;x")),
     "the migrating domain's name"),
    ("not a UUID", {"vstor_agent": 1, "op": "abort", "name": "vm", "uuid": "../../x"}, "is not a UUID"),
    ("an attribute name with a space", check(imports={"vdb": {"tr addr": "1.2.3.4"}}),
     "is not an attribute name"),
    ("an attribute name in a namespace", check(imports={"vdb": {"{urn:x}a": "1"}}), "is not an attribute name"),
    ("an attribute name lxml refuses", check(imports={"vdb": {"1x": "1"}}), "is not an attribute name"),
    ("a target that is not one", check(files={"../vdb": files()["vdb"]}), "is not a virtio disk name"),
    ("a relative file path", check(files=files(path="x/../../etc/shadow")), "is not a clean absolute path"),
    # keys no request has
    ("an unknown key", check(format_disks=True), "unknown key 'format_disks'"),
    ("an unknown key in a file", check(files=files(owner="root")), "files.vdb has unknown key 'owner'"),
    ("facts with more", {"vstor_agent": 1, "op": "facts", "xml": "x"}, "unknown key 'xml'"),
    ("prepare's from on check", check(**{"from": "compute-1"}), "unknown key 'from'"),
]


@pytest.mark.parametrize("raw, words", [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE])
def test_a_hostile_request_is_one_refusal_exit_2_and_changes_nothing(dest, raw, words):
    before = _snapshot(dest)
    answer = agent(dest, raw)
    assert answer["ok"] is False and answer["exit_code"] == 2, answer
    assert words in answer["message"], answer["message"]
    assert answer["message"].isprintable() and len(answer["message"]) < 2100
    assert _snapshot(dest) == before


def test_the_declared_nesting_is_the_deepest_a_request_has():
    assert requests.MAX_DEPTH == 3      # the request, files, one file
    requests.parse(json.dumps(check(files=files())).encode())
    with pytest.raises(BadInput, match="nests deeper"):
        requests.parse(b'{"vstor_agent": 1, "op": "check", "files": {"vdb": {"path": []}}}')


@pytest.mark.parametrize("path", ["/dev/ptmx", "/dev/null", "/dev/tty", "/dev/loop0", "/dev/../dev/vda",
                                  "/dev/disk/by-id/x", "/dev/.vda", "/etc/passwd"])
def test_a_block_source_is_only_a_known_device_and_nothing_else_is_opened(dest, path):
    before = _snapshot(dest)
    opens: list[str] = []
    answer = agent(dest, check(xml=domain(str(dest.images / "a.raw")), files={
        "vdb": {"path": str(dest.images / "a.raw"), "kind": "file", "size": 4096},
        "vdc": {"path": path, "kind": "block", "size": 0}}), opens)
    if path == "/dev/loop0":        # never a block source: the file behind it is not vstor's to vouch for
        assert answer["ok"] and "is a loop device" in answer["seen"]["vdc"], answer
    elif ".." not in path:
        assert answer["ok"] and "not a disk or partition vstor can see" in answer["seen"]["vdc"], answer
    else:
        assert not answer["ok"] and "is not a clean absolute path" in answer["message"]
    # The hook sees opens (the file source's last component, opened O_PATH
    # relative to its directory: vstor.host.sources).
    assert "a.raw" in opens or str(dest.images / "a.raw") in opens or not answer["ok"]
    assert not [p for p in opens if p.startswith("/dev/")], opens
    assert _snapshot(dest) == before


def test_a_device_sysfs_calls_a_disk_is_looked_at_before_it_is_opened(tmp_path):
    """sysfs (a captured one, here) says 'null' and 'tty' are disks: lstat
    finds a character device, and neither is opened (an audit hook in a
    process of its own sees every open)."""
    null = os.stat("/dev/null").st_rdev
    fake_sysfs(tmp_path, "null", f"{os.major(null)}:{os.minor(null)}")
    fake_sysfs(tmp_path, "tty", "x")
    script = ("import sys\n"
              "sys.addaudithook(lambda e, a: print('opened', a[0]) if e == 'open' and "
              "str(a[0]).startswith('/dev/') else None)\n"
              "from vstor.config import Config\nfrom vstor.errors import BadInput\n"
              "from vstor.host.sysfs import SysFS\nfrom vstor.migration import storage\n"
              "for name in ('null', 'tty'):\n"
              "    try:\n"
              "        storage.describe(Config(), 'block', '/dev/' + name, SysFS(sys.argv[1]))\n"
              "    except BadInput as e:\n"
              "        print('refused', e)\n")
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True,
                         cwd=ROOT, timeout=60)
    assert out.stdout.splitlines() == ["refused /dev/null is not a block device",
                                       "refused sysfs gives tty no device number ('x')"], out


def fake_sysfs(tmp_path, name: str, devnum: str) -> SysFS:
    """A sysfs that says the kernel has block device NAME with DEVNUM."""
    (tmp_path / "sys/class/block" / name).mkdir(parents=True)
    (tmp_path / "sys/class/block" / name / "dev").write_text(devnum + "\n")
    return SysFS(str(tmp_path))


def _a_real_disk():
    """(name, MAJ:MIN, whether this process may open it) of a disk of this host."""
    for name in sorted(os.listdir("/sys/block")) if os.path.isdir("/sys/block") else ():
        try:
            st = os.lstat(f"/dev/{name}")
            dev = open(f"/sys/block/{name}/dev").read().strip()
        except OSError:
            continue
        if stat.S_ISBLK(st.st_mode) and dev == f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}" \
                and is_listed(name):
            try:       # a container's device cgroup may refuse it
                os.close(os.open(f"/dev/{name}", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC))
                return name, dev, True
            except OSError:
                return name, dev, False
    return None


DISK = _a_real_disk()


@pytest.mark.skipif(DISK is None, reason="needs a disk of this host")
def test_a_node_of_another_number_than_sysfs_gives_is_refused(tmp_path):
    name, dev, _ = DISK
    major, minor = dev.split(":")
    other = fake_sysfs(tmp_path, name, f"{major}:{int(minor) + 1}")
    with pytest.raises(BadInput, match=f"/dev/{name} is not the device the kernel calls {name}"):
        storage.describe(Config(), "block", f"/dev/{name}", other)


@pytest.mark.skipif(DISK is None or not DISK[2], reason="needs a disk of this host it may open")
def test_a_disk_of_the_host_is_described():
    name = DISK[0]
    mine = storage.describe(Config(), "block", f"/dev/{name}", SysFS("/"))
    assert mine["size"] == int(open(f"/sys/block/{name}/size").read()) * 512 and mine["fstype"] == "block"


def test_a_refusal_from_deeper_down_is_one_answer_with_its_own_code(dest):
    """Not only bad input: a record here that cannot be read refuses status
    with exit 4, and says so in the one answer."""
    state = dest.tmp / "state" / "domains"
    state.mkdir(parents=True)
    (state / "vm.json").write_text("{")
    answer = agent(dest, {"vstor_agent": 1, "op": "status", "name": "vm"})
    assert answer == {"ok": False, "exit_code": 4, "message": answer["message"]}
    assert "cannot be read" in answer["message"]


def private_dev(*setup: str) -> list[str]:
    """A command prefix that runs its command with a /dev of its own (a
    tmpfs in a private mount namespace) made by `setup`: device nodes, FIFOs
    and links vstor must tell apart, and nothing made on the host."""
    script = "mount -t tmpfs vstor-test /dev && " + " && ".join(setup) + ' && exec "$@"'
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh"]


def _private_dev_works() -> bool:
    try:
        return subprocess.run(private_dev("mknod /dev/x b 7 0", "test -b /dev/x") + ["true"],
                              capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


PRIVATE_DEV = _private_dev_works()


@pytest.mark.skipif(not PRIVATE_DEV, reason="needs root and unshare --mount")
def test_what_stands_at_a_disk_s_name_in_dev_is_looked_at_before_it_is_opened(dest):
    """The host model (two-socket) names sda, nvme0n1, nvme1n1 and nvme2n1
    as disks; what /dev holds at those names is a character device (ptmx's
    number, which makes a pty when opened), a FIFO, a link to a block
    device, and a block device of another number: each is refused, and the
    real agent process opens none of them."""
    sysfs = SysFS(dest.root)
    dev = {n: sysfs.read(f"/sys/class/block/{n}/dev").strip() for n in ("sda", "nvme0n1", "nvme1n1", "nvme2n1")}
    major, minor = dev["nvme2n1"].split(":")
    wrap = private_dev("mknod /dev/sda c 5 2", "mkfifo /dev/nvme0n1", f"mknod /dev/real b {major} {minor}",
                       "ln -s real /dev/nvme1n1", f"mknod /dev/nvme2n1 b {major} {int(minor) + 1}")
    block = {f"vd{c}": {"path": f"/dev/{n}", "kind": "block", "size": 0}
             for c, n in zip("cdef", ("sda", "nvme0n1", "nvme1n1", "nvme2n1"))}
    before = _snapshot(dest)
    opens: list[str] = []
    answer = agent(dest, check(xml=domain(str(dest.images / "a.raw")), files=block), opens, wrap)
    assert answer["ok"], answer
    assert answer["seen"] == {
        "vdc": "cannot use it (/dev/sda is not a block device)",
        "vdd": "cannot use it (/dev/nvme0n1 is not a block device)",
        "vde": "cannot use it (/dev/nvme1n1 is not a block device)",
        "vdf": f"cannot use it (/dev/nvme2n1 is not the device the kernel calls nvme2n1 "
               f"({major}:{int(minor) + 1}, not {dev['nvme2n1']}))"}
    assert opens == [], opens
    assert _snapshot(dest) == before


@pytest.mark.skipif(not PRIVATE_DEV or not os.path.exists("/sys/block/loop0"),
                    reason="needs root, unshare --mount and loop0")
def test_a_block_device_of_the_number_sysfs_gives_is_opened_and_described(dest):
    """The positive case, through the agent: /dev/nvme2n1 a block device of
    the number the host model's sysfs gives it (a loop device's node made
    with that number would not be: this one is loop0's, and sysfs says so)."""
    root = dest.tmp / "host"
    import shutil
    shutil.copytree(dest.root, root, symlinks=True)
    (root / "sys/class/block/nvme2n1").unlink()
    (root / "sys/class/block/nvme2n1").mkdir()
    (root / "sys/class/block/nvme2n1/dev").write_text("7:0\n")
    d = type("D", (), {**{k: getattr(dest, k) for k in ("tmp", "images", "conf")}, "root": str(root)})()
    wrap = private_dev("mknod /dev/nvme2n1 b 7 0")
    opens: list[str] = []
    answer = agent(d, check(xml=domain(str(dest.images / "a.raw")), files={
        "vdc": {"path": "/dev/nvme2n1", "kind": "block", "size": 0, "fstype": "block",
                "mount": "/dev/nvme2n1", "shared_root": ""}}), opens, wrap)
    size = int(open("/sys/block/loop0/size").read()) * 512
    assert answer["ok"] and opens == ["/dev/nvme2n1"], (answer, opens)
    # opened and described: then compared (a local block device is not shared storage)
    assert answer["seen"]["vdc"] == (f"has it with another size ({size} bytes, not 0)" if size else
                                     "has its own block /dev/nvme2n1 at that path (a local block device is "
                                     "another disk on each host: put it on storage both hosts see, "
                                     "listed in [migrate] shared on both)")


def test_a_state_directory_that_is_a_file_is_one_answer_naming_it(dest, tmp_path):
    """A state directory that is a file: the state directory's check names
    it (exit 4), one answer, no traceback."""
    (tmp_path / "statefile").write_text("")
    conf = tmp_path / "broken.conf"
    conf.write_text(open(dest.conf).read().replace(f"{dest.tmp}/state", f"{tmp_path}/statefile"))
    d = type("D", (), {"tmp": dest.tmp, "images": dest.images, "conf": str(conf), "root": dest.root})()
    answer = agent(d, {"vstor_agent": 1, "op": "status", "name": "vm"})
    assert answer["exit_code"] == 4 and answer["message"].startswith(
        f"state directory {tmp_path}/statefile is not root's alone: {tmp_path}/statefile is not a directory")


def test_an_error_vstor_did_not_foresee_is_still_one_answer_exit_1(monkeypatch):
    """A bug (here one made on purpose): exit 1, the one answer saying what
    failed, no traceback unless VSTOR_DEBUG."""
    import io
    from vstor.migration import agent as agent_mod

    def bug(here, request):
        raise NotADirectoryError(20, "Not a directory")
    monkeypatch.setattr(agent_mod, "_serve", bug)
    monkeypatch.delenv("VSTOR_DEBUG", raising=False)
    answer = agent_mod.answer(None, io.BytesIO(json.dumps({"vstor_agent": 1, "op": "status", "name": "vm"}).encode()))
    assert answer["exit_code"] == 1 and answer["message"].startswith("internal error: NotADirectoryError")
    assert "\n" not in answer["message"]


# -- a block source judged by what it stacks on (issue 28) -----------------------------------

@pytest.mark.parametrize("path, words", [
    ("/dev/dm-1", "/dev/dm-1 stacks on /dev/loop2 through /dev/md6p1, /dev/md6, a loop device: "),
    ("/dev/md5", "/dev/md5 stacks on /dev/loop1, a loop device: "),
    ("/dev/nbd0", "/dev/nbd0 is a network block device (nbd): "),
])
def test_a_block_source_on_a_file_vstor_never_opened_is_described_as_the_planner_refuses_it(host_layout, path, words):
    """Before /dev is looked at: the planner's words, from the same stack."""
    with pytest.raises(BadInput) as e:
        storage.describe(Config(), "block", path, SysFS(host_layout("stacked")))
    assert e.value.message.startswith(words)




# -- issue 28: a guest cell's numbers ---------------------------------------------------------
#
# A migrating domain's guest cells are its ABI, read by `check` and `prepare`:
# a cell's memory of 400 digits in KB reached float arithmetic (an internal
# error, exit 1); a CPU range in other digits was expanded whole.

def _celled(cell: str) -> str:
    return domain().replace("<devices/>", f"<cpu><numa>{cell}</numa></cpu><devices/>")


@pytest.mark.parametrize("cell, words", [
    (f"<cell id='0' cpus='0' memory='{'9' * 400}' unit='KB'/>", "is not a whole number of at most 20 digits"),
    ("<cell id='0' cpus='0-١٠٠٠٠٠٠٠٠٠' memory='524288' unit='KiB'/>", "is not a CPU or a range of CPUs"),
], ids=["memory-400-digits", "cpus-arabic-indic"])
def test_a_cell_vstor_cannot_read_is_a_problem_check_names_and_prepare_refuses(dest, cell, words):
    answer = agent(dest, check(xml=_celled(cell)))
    assert answer["ok"] is True and any(words in p for p in answer["problems"]), answer
    answer = agent(dest, prepare(xml=_celled(cell)))
    assert answer["ok"] is False and answer["exit_code"] == 2 and words in answer["message"], answer
