"""Issue 9's four SPDK bugs as an operator and libvirt meet them: through the
`vstor` CLI and through hooks/vstor run as libvirt runs it (a separate
process, the XML on stdin), against the SPDK target double as the oldest SPDK
vstor supports (v24.01) and the newest recorded one (v26.09).

1. a start on SPDK >= v26.05 (whose "no such controller" is -22) works;
2. two targets with one NQN give two controllers and each domain the namespace
   of the target it named; a multipath domain gets every path;
3. a release while QEMU is connected is refused before anything is sent, and
   --force follows SPDK's deferred deletion;
4. an SPDK app without vhost is found before anything changes (exit 4)."""

from tests import installed_hook  # noqa: E402
import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from tests.doubles.spdk_target import SpdkTargetDouble
from tests.hostlayout import build_tree
from vstor.cli.main import main
from vstor.errors import EXIT_DOES_NOT_FIT, EXIT_UNAVAILABLE

pytestmark = pytest.mark.skipif(os.geteuid() != 0 and not os.environ.get("CI"),
                                reason="sockets are handed to root:kvm (needs root)")

HERE = os.path.dirname(__file__)
ROOT = os.path.join(HERE, "..")
HOOK = os.path.join(ROOT, "hooks", "vstor")
NS = "https://vstor.dev/xmlns/domain/1"
NQN = "nqn.2016-06.io.spdk:cnode1"          # SPDK's example NQN, on both targets


@pytest.fixture(params=["v24.01", "v26.09"])
def site(request):
    work = tempfile.mkdtemp(prefix="vs-", dir="/tmp")
    os.chmod(work, 0o755)
    host = build_tree(os.path.join(HERE, "hosts", "two-socket.toml"), os.path.join(work, "host"))
    spdk = SpdkTargetDouble(os.path.join(work, "spdk.sock"), os.path.join(work, "vhost"),
                            cores=tuple(range(64)), version=request.param)
    for addr in ("127.0.0.1", "127.0.0.2"):
        spdk.add_fabric("RDMA", addr, "4420", NQN, (1, 2))
    spdk.start()
    conf = os.path.join(work, "vstor.conf")
    with open(conf, "w") as f:
        f.write(f"[paths]\nstate_dir = {work}/state\nvhost_dir = {spdk.vhost_dir}\n"
                f"qsd_dir = {work}/qsd\nimages = {work}\n[cpu]\nreactors = 2,18\n"
                f"[spdk]\nrpc_socket = {spdk.socket_path}\ntimeout = 5\n")
    s = type("Site", (), {"work": work, "host": host, "spdk": spdk, "conf": conf})()
    yield s
    for name in os.listdir(f"{work}/state/domains") if os.path.isdir(f"{work}/state/domains") else ():
        for ctrlr in list(spdk.vhost):
            spdk.mark_connected(ctrlr, False)
        vstor(s, "release", "--force", name.removesuffix(".json"))
    spdk.stop()
    shutil.rmtree(work, ignore_errors=True)


def vstor(site, *args) -> int:
    return main(["-c", "test:///default", "--config", site.conf, "--host-root", site.host, *args])


def hook(site, name, op, sub, xml: str):
    env = {"PYTHONPATH": ROOT, "PATH": os.environ.get("PATH", ""),
           "VSTOR_CONFIG": site.conf, "VSTOR_HOST_ROOT": site.host}
    return subprocess.run([installed_hook(), name, op, sub, "-"], input=xml.encode(),
                          capture_output=True, env=env)


def rendered(site, name, disk: str) -> str:
    """The domain as `vstor render` writes it: the plan recorded in it (vCPUs
    shared, so domains rendered before any is prepared do not collide)."""
    src, out = (os.path.join(site.work, f"{name}.{x}.xml") for x in ("in", "out"))
    with open(src, "w") as f:
        f.write(f"""<domain type='kvm'><name>{name}</name><memory unit='MiB'>1024</memory><vcpu>2</vcpu>
          <os><type arch='x86_64' machine='q35'>hvm</type></os>
          <metadata><vstor:vstor xmlns:vstor='{NS}'><vstor:vm cpus='shared'/>{disk}</vstor:vstor></metadata><devices/></domain>""")
    assert vstor(site, "render", src, "-o", out) == 0
    return out


def nvmf(addr="127.0.0.1", nsid=2, paths=()) -> str:
    extra = "".join(f"<vstor:path traddr='{p}'/>" for p in paths)
    return (f"<vstor:disk target='vdb' backend='spdk'><vstor:nvmf transport='rdma' traddr='{addr}' "
            f"subnqn='{NQN}' namespace='{nsid}'>{extra}</vstor:nvmf></vstor:disk>")


def served(site) -> dict:
    """vhost controller -> (target address of the controller behind it, nsid)."""
    addrs = {}
    for c in site.spdk.params_of("bdev_nvme_attach_controller"):
        addrs.setdefault(c["name"], []).append(c["traddr"])
    out = {}
    for v in site.spdk.vhost.values():
        ctrlr, nsid = v.bdev.rsplit("n", 1)
        out[v.name] = (tuple(addrs[ctrlr]), int(nsid))
    return out


def changes(site, since=0) -> list[str]:
    return [r["method"] for r in site.spdk.requests[since:]
            if not r["method"].endswith(("_get_controllers", "get_version", "get_methods"))]


def records(site) -> list[str]:
    d = f"{site.work}/state/domains"
    return sorted(os.listdir(d)) if os.path.isdir(d) else []


# -- 1 and 2: starts on every supported SPDK, one controller per real target ----------------------

def test_the_cli_gives_two_domains_on_two_targets_with_one_nqn_their_own_namespaces(site, capsys):
    a, b = rendered(site, "a", nvmf("127.0.0.1")), rendered(site, "b", nvmf("127.0.0.2"))
    assert vstor(site, "prepare", a) == 0 and vstor(site, "prepare", b) == 0
    assert served(site) == {"a-vdb": (("127.0.0.1",), 2), "b-vdb": (("127.0.0.2",), 2)}
    capsys.readouterr()
    assert vstor(site, "status", "--json") == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["domain"] for r in rows} == {"a", "b"}
    assert all(s["problem"] is None for r in rows for s in r["steps"])
    assert vstor(site, "release", "a") == 0 and vstor(site, "release", "b") == 0
    assert site.spdk.nvme == {} and site.spdk.vhost == {} and records(site) == []


def test_the_hook_starts_and_stops_an_spdk_domain_on_every_supported_spdk(site):
    xml = open(rendered(site, "h", nvmf("127.0.0.2", nsid=1))).read()
    out = hook(site, "h", "prepare", "begin", xml)
    assert (out.returncode, out.stderr) == (0, b""), out.stderr
    assert served(site) == {"h-vdb": (("127.0.0.2",), 1)}
    out = hook(site, "h", "release", "end", xml)
    assert (out.returncode, out.stderr) == (0, b""), out.stderr
    assert site.spdk.nvme == {} and site.spdk.vhost == {} and records(site) == []


def test_a_multipath_domain_gets_every_path_or_is_refused(site):
    """SPDK keeps one controller per path and host NQN: a multipath domain
    whose first path a single-path domain's controller already has cannot get
    a controller of its own, and sharing that one would drop its second path.
    Refused before anything changes; it starts with both paths once alone."""
    single = open(rendered(site, "one", nvmf("127.0.0.1", nsid=1))).read()
    multi = open(rendered(site, "two", nvmf("127.0.0.1", nsid=2, paths=("127.0.0.2",)))).read()
    assert hook(site, "one", "prepare", "begin", single).returncode == 0
    sent = len(site.spdk.requests)
    out = hook(site, "two", "prepare", "begin", multi)
    assert out.returncode == EXIT_DOES_NOT_FIT and out.stderr.decode().count("\n") == 1
    assert b"SPDK keeps one NVMe-oF controller per path and host NQN, and domain 'one'" in out.stderr
    assert changes(site, sent) == [] and records(site) == ["one.json"]

    assert hook(site, "one", "release", "end", single).returncode == 0
    out = hook(site, "two", "prepare", "begin", multi)
    assert (out.returncode, out.stderr) == (0, b""), out.stderr
    assert served(site) == {"two-vdb": (("127.0.0.1", "127.0.0.2"), 2)}
    assert all(c["multipath"] == "multipath" for c in site.spdk.params_of("bdev_nvme_attach_controller")[-2:])
    assert hook(site, "two", "release", "end", multi).returncode == 0
    assert site.spdk.nvme == {} and records(site) == []


def test_a_path_a_controller_vstor_did_not_make_has_is_refused_before_anything_changes(site, capsys):
    """An operator's own controller to the same target with this host's NQN
    (rpc.py bdev_nvme_attach_controller -b nvme0 ... -q <it>): SPDK would
    refuse vstor's attach half-way; vstor names it before the first change.
    One with SPDK's default NQN is another connection: vstor, which always
    names its host NQN, attaches beside it."""
    from vstor.backends.spdk import SpdkClient
    from vstor.host.read import read_hostnqn
    from vstor.host.sysfs import SysFS
    client = SpdkClient(site.spdk.socket_path)
    client.attach_nvme_controller(name="nvme1", trtype="RDMA", traddr="127.0.0.2", trsvcid="4420",
                                  subnqn=NQN)
    assert vstor(site, "prepare", rendered(site, "b", nvmf("127.0.0.2"))) == 0
    hostnqn = read_hostnqn(SysFS(site.host))
    assert [p.get("hostnqn") for p in site.spdk.params_of("bdev_nvme_attach_controller")] == [None, hostnqn]
    assert vstor(site, "release", "--force", "b") == 0
    client.detach_nvme_controller("nvme1")
    client.attach_nvme_controller(name="nvme0", trtype="RDMA", traddr="127.0.0.2", trsvcid="4420",
                                  subnqn=NQN, hostnqn=hostnqn)
    sent = len(site.spdk.requests)
    capsys.readouterr()
    assert vstor(site, "prepare", rendered(site, "a", nvmf("127.0.0.2"))) == EXIT_DOES_NOT_FIT
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "SPDK's NVMe controller nvme0 already has the path RDMA 127.0.0.2:4420" in err
    assert changes(site, sent) == [] and records(site) == [] and list(site.spdk.nvme) == ["nvme0"]


# -- 3: a release while QEMU is connected -------------------------------------------------------

def test_the_cli_refuses_a_release_while_qemu_is_connected_and_force_follows_spdk(site, capsys):
    assert vstor(site, "prepare", rendered(site, "a", nvmf())) == 0
    site.spdk.mark_connected("a-vdb")
    sent = len(site.spdk.requests)
    capsys.readouterr()
    assert vstor(site, "release", "a") == EXIT_DOES_NOT_FIT
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "QEMU is connected to SPDK vhost controller a-vdb" in err
    assert changes(site, sent) == [] and records(site) == ["a.json"]

    rc = vstor(site, "release", "--force", "a")      # SPDK refuses (v24.01) or defers (v26.09)
    err = capsys.readouterr().err
    assert rc != 0 and err.count("\n") == 1 and "vstor release a" in err
    assert changes(site, sent) == ["vhost_delete_controller"] and records(site) == ["a.json"]
    assert site.spdk.nvme != {}                      # nothing under the vhost controller touched

    site.spdk.mark_connected("a-vdb", False)         # QEMU lets go; a deferred delete completes
    assert vstor(site, "release", "a") == 0
    assert site.spdk.nvme == {} and site.spdk.vhost == {} and records(site) == []


def test_the_hook_refuses_a_release_while_something_is_still_connected(site):
    xml = open(rendered(site, "h", nvmf())).read()
    assert hook(site, "h", "prepare", "begin", xml).returncode == 0
    site.spdk.mark_connected("h-vdb")
    sent = len(site.spdk.requests)
    out = hook(site, "h", "release", "end", xml)
    assert out.returncode == EXIT_DOES_NOT_FIT and out.stderr.decode().count("\n") == 1
    assert b"QEMU is connected to SPDK vhost controller h-vdb" in out.stderr
    assert changes(site, sent) == [] and records(site) == ["h.json"]
    site.spdk.mark_connected("h-vdb", False)
    assert hook(site, "h", "release", "end", xml).returncode == 0 and records(site) == []


# -- 4: an SPDK app without vhost ----------------------------------------------------------------

@pytest.mark.parametrize("entry", ["cli", "hook"])
def test_an_spdk_app_without_vhost_is_refused_before_anything_changes(site, entry, capsys):
    xml_path = rendered(site, "a", nvmf())
    site.spdk.stop()
    nvmf_tgt = SpdkTargetDouble(site.spdk.socket_path, app="nvmf_tgt", version=site.spdk.version).start()
    try:
        if entry == "cli":
            capsys.readouterr()
            rc, err = vstor(site, "prepare", xml_path), capsys.readouterr().err
        else:
            out = hook(site, "a", "prepare", "begin", open(xml_path).read())
            rc, err = out.returncode, out.stderr.decode()
        assert rc == EXIT_UNAVAILABLE and err.count("\n") == 1
        assert "has no vhost_create_blk_controller" in err and f"-S {site.spdk.vhost_dir})" in err
        assert [r["method"] for r in nvmf_tgt.requests] == ["rpc_get_methods"]
        assert records(site) == []
    finally:
        nvmf_tgt.stop()


# -- gc: SPDK objects no record holds are named and left -------------------------------------------

def test_gc_names_spdk_controllers_no_record_holds_and_leaves_them(site, capsys):
    from vstor.backends.spdk import SpdkClient
    assert vstor(site, "prepare", rendered(site, "a", nvmf())) == 0
    client = SpdkClient(site.spdk.socket_path)
    client.attach_nvme_controller(name="vs_nvmf_0123456789abcdef", trtype="RDMA", traddr="127.0.0.2",
                                  trsvcid="4420", subnqn=NQN)
    client.vhost_create_blk_controller("old-vdb", "vs_nvmf_0123456789abcdefn1")
    client.vhost_create_blk_controller("operators", "vs_nvmf_0123456789abcdefn2")
    os.unlink(f"{site.work}/state/domains/a.json")       # a record removed by hand
    before = (dict(site.spdk.nvme), dict(site.spdk.vhost))
    capsys.readouterr()
    for dry in (["--dry-run"], []):
        assert vstor(site, "gc", *dry) == 0
        out = capsys.readouterr().out
        for name in ("a-vdb", "old-vdb"):
            assert f"Leaving SPDK vhost controller {name}: no vstor record holds it" in out
        assert "Leaving SPDK NVMe controller vs_nvmf_0123456789abcdef: no vstor record holds it" in out
        assert "SPDK vhost controller operators" not in out          # not named like vstor's
        assert (dict(site.spdk.nvme), dict(site.spdk.vhost)) == before
