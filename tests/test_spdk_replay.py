"""The SPDK test double held to a real SPDK: every request recorded from SPDK
v26.09-pre (tests/spdk/transcripts/) is sent to fresh doubles of the app(s)
it was recorded on, in recorded order, through a raw JSON-RPC client over the
real socket (one connection per request, as the recorder did), and the answer
is compared with the recorded one:

- an error by its exact code and message;
- a result exactly, except the fields in LOOSE, whose values are particular
  to the run: those must have the recorded JSON type (and, for ``socket``,
  the recorded file name under the app's -S directory), and every object
  must have exactly the recorded keys, every list the recorded length;
- a recorded ``null`` (no answer before the recorder's 5 s timeout): the
  double must not answer within NO_ANSWER seconds.

The state a recording depends on is set up as it was: the vhost app attached
to the target of nvmf-target-setup.jsonl (replayed into an nvmf_tgt double on
a shared Fabric first); QEMU connected to and was killed from a vhost-user
socket where the recording's notes say (a real Unix-socket client here); the
vhost app restarted where its second spdk_get_version is.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

import pytest

from tests.doubles.spdk_target import Fabric, SpdkTargetDouble

TRANSCRIPTS = Path(__file__).resolve().parent / "spdk" / "transcripts"
RECORDINGS = ("nvmf-target-setup.jsonl", "vhost-attach-and-serve.jsonl",
              "vhost-delete-while-connected.jsonl", "method-not-found.jsonl",
              "export-claim-order.jsonl")
VERSION = "v26.09"
CORES = {"nvmf_tgt": (0,), "vhost": (1,), "spdk_tgt": (1,)}    # their -m 0x1 / 0x2
NO_ANSWER = 0.5     # seconds (the recorder waited 5)

# Compared by JSON type only: values particular to the run (random UUIDs and
# the NGUIDs made from them, pids and thread ids, tick counts and rates).
# "socket": the path under the app's -S directory; its file name is compared.
LOOSE = {"uuid", "nguid", "aliases", "pid", "tid", "tick_rate", "busy", "idle", "irq", "sys",
         "usr", "elapsed", "socket"}


# -- the recordings ---------------------------------------------------------------------------

def recording(name: str) -> list[dict]:
    path = TRANSCRIPTS / name
    assert path.is_file(), f"{path} is missing: the replay has nothing to hold the double to"
    lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    assert lines, f"{path} is empty"
    return lines


def test_the_recordings_are_all_there():
    """Missing or empty transcripts fail CI; a new one is not silently left out."""
    assert TRANSCRIPTS.is_dir(), f"{TRANSCRIPTS} is missing"
    found = sorted(p.name for p in TRANSCRIPTS.glob("*.jsonl"))
    assert found == sorted(RECORDINGS), f"recordings {found}, the replay knows {sorted(RECORDINGS)}"
    for name in RECORDINGS:
        assert recording(name)


# -- a raw client and the comparison ---------------------------------------------------------

def exchange(path: str, request: dict, timeout: float) -> dict | None:
    """Send one request on a new connection; the one JSON value answered, or
    None when nothing came within timeout. The connection is then closed."""
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(path)
        s.sendall(json.dumps(request).encode())
        s.settimeout(timeout)
        buf = b""
        while True:
            try:
                data = s.recv(65536)
            except socket.timeout:
                return None
            if not data:
                return None
            buf += data
            try:
                return json.loads(buf)
            except json.JSONDecodeError:
                continue


def differences(want, got, where: str = "") -> list[str]:
    """Where got is not the recorded want (see the module docstring)."""
    key = where.rsplit(".", 1)[-1].split("[", 1)[0]
    if key in LOOSE:
        if key == "socket":
            return [] if (isinstance(got, str) and os.path.basename(got) == os.path.basename(want)) \
                else [f"{where}: {got!r}, recorded {want!r}"]
        return differences_of_shape(want, got, where)
    if isinstance(want, dict):
        if not isinstance(got, dict):
            return [f"{where}: {got!r}, recorded an object"]
        if set(want) != set(got):
            return [f"{where}: keys {sorted(got)}, recorded {sorted(want)}"]
        return [d for k in want for d in differences(want[k], got[k], f"{where}.{k}")]
    if isinstance(want, list):
        if not isinstance(got, list) or len(got) != len(want):
            return [f"{where}: {got!r}, recorded {want!r}"]
        return [d for i, (w, g) in enumerate(zip(want, got)) for d in differences(w, g, f"{where}[{i}]")]
    if type(got) is not type(want) or got != want:
        return [f"{where}: {got!r}, recorded {want!r}"]
    return []


def differences_of_shape(want, got, where: str) -> list[str]:
    if isinstance(want, dict) and isinstance(got, dict) and set(want) == set(got):
        return [d for k in want for d in differences_of_shape(want[k], got[k], f"{where}.{k}")]
    if isinstance(want, list) and isinstance(got, list) and len(want) == len(got):
        return [d for i, (w, g) in enumerate(zip(want, got))
                for d in differences_of_shape(w, g, f"{where}[{i}]")]
    if type(got) is type(want) and not isinstance(want, (dict, list)):
        return []
    return [f"{where}: {got!r} has not the shape of the recorded {want!r}"]


def check(line: dict, got: dict | None) -> list[str]:
    want = line["response"]
    step = f"{line['app']}: {line['step']}"
    if want is None:
        return [] if got is None else [f"{step}: answered {got!r}, recorded no answer"]
    if got is None:
        return [f"{step}: no answer, recorded {want!r}"]
    if got.get("id") != line["request"]["id"] or got.get("jsonrpc") != "2.0":
        return [f"{step}: answered {got!r} to request {line['request']['id']}"]
    if "error" in want:
        if got.get("error") != want["error"]:
            return [f"{step}: {got.get('error') or got.get('result')!r}, recorded error {want['error']!r}"]
        return []
    if "result" not in got:
        return [f"{step}: error {got.get('error')!r}, recorded a result"]
    return [f"{step}: {d}" for d in differences(want["result"], got["result"], "result")]


# -- the apps as they were ------------------------------------------------------------------

class Apps:
    """Fresh doubles, one per app, on one Fabric, under a short /tmp directory."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="spdk-replay-")
        self.fabric = Fabric()
        self.doubles: dict[str, SpdkTargetDouble] = {}
        self.qemu: socket.socket | None = None

    def start(self, app: str) -> SpdkTargetDouble:
        old = self.doubles.pop(app, None)
        if old is not None:
            old.stop()
        double = SpdkTargetDouble(os.path.join(self.dir, f"{app}.sock"), os.path.join(self.dir, app),
                                  app=app, version=VERSION, cores=CORES[app], fabric=self.fabric)
        self.doubles[app] = double.start()
        return double

    def double(self, app: str) -> SpdkTargetDouble:
        return self.doubles.get(app) or self.start(app)

    def send(self, line: dict) -> dict | None:
        double = self.double(line["app"])
        timeout = NO_ANSWER if line["response"] is None else 10
        return exchange(double.socket_path, line["request"], timeout)

    def replay(self, lines: list[dict], events: dict | None = None) -> list[str]:
        wrong = []
        for line in lines:
            (events or {}).get(line["step"], lambda _: None)(line)
            wrong += check(line, self.send(line))
        return wrong

    def close(self) -> None:
        if self.qemu is not None:
            self.qemu.close()
        for double in self.doubles.values():
            double.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def apps():
    a = Apps()
    yield a
    a.close()


def vhost_restart(apps: Apps, lines: list[dict]) -> dict:
    """The vhost app was restarted before its second spdk_get_version."""
    versions = [line["step"] for line in lines if line["request"]["method"] == "spdk_get_version"]
    assert len(versions) == 2 and "restart" in versions[1]
    return {versions[1]: lambda line: apps.start("vhost")}


def qemu_comes_and_goes(apps: Apps, ctrlr: str) -> dict:
    """QEMU connected before the step whose note says it is running, and was
    killed before the step whose note says so; here a real Unix-socket client
    connects to the controller's socket and hangs up."""
    def connect(line):
        assert "running=True" in json.dumps(line.get("note"))
        vhost = apps.double("vhost")
        apps.qemu = socket.socket(socket.AF_UNIX)
        apps.qemu.connect(os.path.join(vhost.vhost_dir, ctrlr))
        assert vhost.is_connected(ctrlr)

    def kill(line):
        assert "killed" in json.dumps(line.get("note"))
        apps.qemu.close()
        apps.qemu = None
        deadline = time.monotonic() + 2      # "2 s after QEMU killed"
        while ctrlr in apps.double("vhost").vhost and time.monotonic() < deadline:
            time.sleep(0.01)

    lines = recording("vhost-delete-while-connected.jsonl")
    running = [line["step"] for line in lines if "running=True" in json.dumps(line.get("note"))]
    killed = [line["step"] for line in lines if "killed" in json.dumps(line.get("note"))]
    assert len(running) == 1 and len(killed) == 1
    return {running[0]: connect, killed[0]: kill}


# -- the replay ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", RECORDINGS)
def test_the_double_answers_as_recorded(apps, name):
    lines = recording(name)
    events = {}
    if name == "vhost-attach-and-serve.jsonl":
        # The remote target it attached to: nvmf-target-setup.jsonl's, served on the fabric.
        setup = apps.replay(recording("nvmf-target-setup.jsonl"))
        assert setup == [], "\n".join(setup)
        events = vhost_restart(apps, lines)
    elif name == "vhost-delete-while-connected.jsonl":
        events = qemu_comes_and_goes(apps, "vblkq")
    wrong = apps.replay(lines, events)
    assert wrong == [], f"{len(wrong)} answers differ from {name}:\n" + "\n".join(wrong)


def test_the_comparison_is_strict_where_the_recording_is():
    """What the replay would let through, and what not."""
    want = {"ctrlr": "c", "socket": "/run/vstor/vhost/c", "sessions": [], "uuid": "a", "cpumask": "0x2"}
    assert differences(want, dict(want, socket="/tmp/x/c", uuid="b")) == []
    assert differences(want, dict(want, cpumask="0x1"))
    assert differences(want, dict(want, sessions=[{}]))
    assert differences(want, dict(want, uuid=1))
    assert differences(want, dict(want, extra=1))
    assert differences(want, dict(want, socket="/run/vstor/vhost/d"))
    assert differences({"n": 1}, {"n": True}) and differences({"b": False}, {"b": 0})
