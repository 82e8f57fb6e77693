"""hooks/vstor as `vstor hooks install` writes it and libvirt calls it:
executed directly, arguments, XML on stdin, exit code, stderr."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")
HOOK = os.path.join(ROOT, "hooks", "vstor")
NS = "https://vstor.dev/xmlns/domain/1"
VSTOR_XML = (f"<domain><name>h1</name><memory>1024</memory><metadata><vstor:vstor xmlns:vstor='{NS}'>"
             "<vstor:disk target='vdb'><vstor:file path='/a.raw'/></vstor:disk></vstor:vstor></metadata></domain>")


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    from vstor.cli.hooks import render_hook
    path = tmp_path_factory.mktemp("hooks") / "vstor"
    path.write_text(render_hook(None))
    path.chmod(0o755)
    return str(path)


@pytest.fixture
def hook(installed):
    def run(*args, xml: str, env=None):
        return subprocess.run([installed, *args], input=xml.encode(), capture_output=True,
                              env={**os.environ, "PYTHONPATH": ROOT, **(env or {})})
    return run


def test_a_domain_without_vstor_metadata_passes_untouched(hook):
    for op in (("prepare", "begin", "-"), ("migrate", "begin", "-"), ("release", "end", "-")):
        out = hook("plain", *op, xml="<domain><name>plain</name></domain>")
        assert (out.returncode, out.stdout, out.stderr) == (0, b"", b"")


def test_restore_keeps_the_xml_and_an_unprepared_migration_is_refused(hook, tmp_path):
    out = hook("h1", "restore", "begin", "-", xml=VSTOR_XML)
    assert (out.returncode, out.stdout) == (0, b"")     # empty stdout: unchanged
    conf = tmp_path / "c.conf"
    conf.write_text(f"[paths]\nstate_dir = {tmp_path}/state\n")
    out = hook("h1", "migrate", "begin", "-", xml=VSTOR_XML, env={"VSTOR_CONFIG": str(conf)})
    assert out.returncode == 3 and out.stdout == b""
    lines = out.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and "no migration was prepared for it on this host" in lines[0]
    assert "vstor migrate prepare h1 --to" in lines[0]


def test_a_refused_prepare_is_one_line_with_vstors_exit_code(hook, tmp_path):
    conf = tmp_path / "c.conf"
    conf.write_text(f"[paths]\nstate_dir = {tmp_path}/state\n")
    out = hook("h1", "prepare", "begin", "-", xml=VSTOR_XML, env={"VSTOR_CONFIG": str(conf)})
    assert out.returncode == 2
    lines = out.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("vstor: ") and "no plan" in lines[0]
    assert not (tmp_path / "state" / "domains").exists() or not os.listdir(tmp_path / "state" / "domains")


def test_malformed_xml_that_names_vstor_is_refused_cleanly(hook):
    out = hook("h1", "prepare", "begin", "-", xml=f"<domain xmlns:v='{NS}'><name>h1")
    assert out.returncode == 2 and b"malformed XML" in out.stderr and b"Traceback" not in out.stderr


def test_operations_without_work_for_vstor_never_start_python(tmp_path):
    # libvirt's qemu hook operations besides the four vstor serves
    # (docs: libvirt.org/hooks.html); the hook's Python here does not exist,
    # so reaching it would fail.
    from vstor.cli.hooks import render_hook
    hook_copy = tmp_path / "vstor"
    hook_copy.write_text(render_hook(None).replace(f"\nPYTHON={sys.executable}\n",
                                                   f"\nPYTHON={tmp_path}/no-such-python\n"))
    hook_copy.chmod(0o755)
    for op in (("start", "begin", "-"), ("started", "begin", "-"), ("stopped", "end", "-"),
               ("attach", "begin", "-"), ("restore", "begin", "-")):
        out = subprocess.run([str(hook_copy), "h1", *op], input=VSTOR_XML.encode(),
                             capture_output=True)
        assert (out.returncode, out.stdout, out.stderr) == (0, b"", b""), op
    out = subprocess.run([str(hook_copy), "h1", "release", "end", "-"], input=VSTOR_XML.encode(),
                         capture_output=True)
    assert out.returncode == 1 and b"the hook's Python" in out.stderr


def test_restore_passes_even_when_vstor_cannot_be_imported(tmp_path):
    """A moved or broken install must not break a restore; a start or an
    incoming migration it cannot serve fails with one line, not a traceback.
    Moved: the installed paths are gone and the hook's Python (a venv of
    its own) has no vstor either."""
    import re
    import venv
    from vstor.cli.hooks import render_hook
    venv.create(tmp_path / "venv", with_pip=False)
    bare = tmp_path / "venv" / "bin" / "python3"
    gone = tmp_path / "no-such-python"
    for python, message in ((bare, "cannot load vstor"), (gone, "the hook's Python")):
        hook_copy = tmp_path / "vstor"
        text = render_hook(None).replace(f"\nPYTHON={sys.executable}\n", f"\nPYTHON={python}\n")
        hook_copy.write_text(re.sub(r"\nSYSPATH=.*\n", f"\nSYSPATH={tmp_path}/moved\n", text))
        hook_copy.chmod(0o755)
        env = {"PYTHONPATH": str(tmp_path / "nothing-here"), "PATH": os.environ.get("PATH", "")}
        run = lambda *a: subprocess.run([str(hook_copy), *a],  # noqa: E731
                                        input=VSTOR_XML.encode(), capture_output=True, env=env)
        out = run("h1", "restore", "begin", "-")
        assert (out.returncode, out.stdout, out.stderr) == (0, b"", b"")
        for op in ("prepare", "migrate"):
            out = run("h1", op, "begin", "-")
            assert out.returncode == 1 and b"Traceback" not in out.stderr and out.stdout == b""
            assert out.stderr.decode().count("\n") == 1 and message in out.stderr.decode()


def test_the_hook_python_starts_without_site_and_finds_vstor_where_it_was_installed(tmp_path):
    """-S with the paths written at install; when those moved, the
    interpreter's own site finds vstor (here: the same install)."""
    import re
    from vstor.cli.hooks import render_hook, site_paths
    text = render_hook(None)
    assert ' exec "$PYTHON" -S -c ' in text
    paths = site_paths()
    import vstor
    assert os.path.dirname(os.path.dirname(os.path.abspath(vstor.__file__))) in paths
    home = os.path.dirname(os.path.dirname(os.path.abspath(vstor.__file__)))
    # As installed; moved away; vstor there but lxml not (installed since, elsewhere).
    for syspath in (":".join(paths), f"{tmp_path}/moved", home):
        hook_copy = tmp_path / "vstor"
        hook_copy.write_text(re.sub(r"\nSYSPATH=.*\n", f"\nSYSPATH={syspath}\n", text))
        hook_copy.chmod(0o755)
        out = subprocess.run([str(hook_copy), "h1", "prepare", "begin", "-"], input=VSTOR_XML.encode(),
                             capture_output=True, env={"PATH": os.environ.get("PATH", "")})
        # vstor ran: it read the domain and refused it for want of a plan.
        assert (out.returncode, out.stderr.decode()) == (
            2, "vstor: domain 'h1' has vstor metadata but no plan (run: vstor apply h1)\n")


def test_a_nova_instance_with_vstor_specs_reaches_python_and_others_do_not(hook, tmp_path):
    """The shell's decision, both quotings of Nova's marker; a tenant's text
    that merely names it (escaped, as XML escapes '<') does not count."""
    conf = tmp_path / "c.conf"
    conf.write_text(f"[paths]\nstate_dir = {tmp_path}/state\n")
    env = {"VSTOR_CONFIG": str(conf)}
    for marker in ('<nova:extraSpec name="vstor:disk.vdb.file.path">/a</nova:extraSpec>',
                   "<nova:extraSpec name='vstor:disk.vdb.file.path'>/a</nova:extraSpec>"):
        xml = ("<domain><name>instance-1</name><metadata><nova:instance xmlns:nova="
               f"'http://openstack.org/xmlns/libvirt/nova/1.1'><nova:flavor name='f'><nova:extraSpecs>{marker}"
               "</nova:extraSpecs></nova:flavor></nova:instance></metadata></domain>")
        out = hook("instance-1", "prepare", "begin", "-", xml=xml, env=env)
        assert out.returncode != 0 and out.stderr.startswith(b"vstor: "), out    # Python answered
    escaped = "<domain><name>x</name><description>&lt;nova:extraSpec name=\"vstor:</description></domain>"
    out = hook("x", "prepare", "begin", "-", xml=escaped, env=env)
    assert (out.returncode, out.stdout, out.stderr) == (0, b"", b"")
