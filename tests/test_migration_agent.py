"""`vstor migrate agent` fed what a hostile or broken source could send: one
JSON answer every time (never a traceback), the documented exit code in
it, nothing on the host touched; and source paths opened only safely."""

import json
import os

import pytest

from tests.helpers import agent, dest  # noqa: F401 (dest: a fixture)
from tests.helpers import agent_domain as domain
from vstor.config import Config
from vstor.errors import BadInput
from vstor.host.sysfs import SysFS
from vstor.migration import storage

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
NS = "https://vstor.dev/xmlns/domain/1"


@pytest.mark.parametrize("request_, code, words", [
    (b"not json", 2, "is not JSON"),
    ({"vstor_agent": 2, "op": "check"}, 2, "protocol 1"),
    ({"vstor_agent": 1, "op": "format-disks", "xml": domain()}, 2, "unknown agent request"),
    ({"vstor_agent": 1, "op": "check"}, 2, "no xml"),
    ({"vstor_agent": 1, "op": "check", "xml": 5}, 2, "xml must be a string, not a number"),
    ({"vstor_agent": 1, "op": "check", "xml": "<domain><name>vm"}, 2, "malformed"),
    ({"vstor_agent": 1, "op": "check", "xml": domain(), "files": []}, 2, "files must be an object"),
    ({"vstor_agent": 1, "op": "check", "xml": domain(), "files": {"vdb": {"path": 1}}}, 2,
     "files.vdb.path must be a string"),
    ({"vstor_agent": 1, "op": "check", "xml": domain(), "imports": {"vdb": {
        "transport": "tcp", "traddr": "1.2.3.4;reboot", "subnqn": "nqn.2016-06.io.x:y"}}}, 2,
     "is not an address"),
    ({"vstor_agent": 1, "op": "prepare", "xml": domain()}, 2, "no from"),
    ({"vstor_agent": 1, "op": "abort", "name": ["vm"]}, 2, "name must be a string, not a list"),
    ({"vstor_agent": 1, "op": "status", "name": "vm", "uuid": 7}, 2, "uuid must be a string"),
])
def test_a_bad_request_is_one_refusal_and_changes_nothing(dest, request_, code, words):
    answer = agent(dest, request_)
    assert answer["ok"] is False and answer["exit_code"] == code and words in answer["message"], answer
    assert "\n" not in answer["message"]
    assert not os.path.exists(dest.tmp / "state" / "domains") or os.listdir(dest.tmp / "state" / "domains") == []


def test_a_source_is_opened_only_where_and_as_it_may_be(dest, tmp_path):
    cfg = Config(images=(str(dest.images),), migrate_shared=(str(dest.images),))
    os.mkfifo(dest.images / "fifo.raw")                 # a FIFO would block an open for ever
    os.symlink(dest.images / "a.raw", dest.images / "link.raw")
    (tmp_path / "outside.raw").write_bytes(b"x")
    sysfs = SysFS(dest.root)
    with pytest.raises(BadInput, match="not a regular file"):
        storage.describe(cfg, "file", str(dest.images / "fifo.raw"), sysfs)
    with pytest.raises(BadInput, match="outside the image roots"):
        storage.describe(cfg, "file", str(tmp_path / "outside.raw"), sysfs)
    with pytest.raises(BadInput, match="not a disk or partition vstor can see"):
        storage.describe(cfg, "block", str(dest.images / "a.raw"), sysfs)
    mine = storage.describe(cfg, "file", str(dest.images / "link.raw"), sysfs)     # resolved, then opened
    assert mine["size"] == 4096 and mine["shared_root"] == os.path.realpath(dest.images)
    answer = agent(dest, {"vstor_agent": 1, "op": "check", "xml": domain(str(dest.images / "a.raw")),
                          "files": {"vdb": {"path": str(dest.images / "fifo.raw"), "kind": "file",
                                            "size": 0}}})
    assert answer["ok"] and "not a regular file" in answer["seen"]["vdb"]


def test_abort_and_status_answer_only_for_the_named_domain(dest):
    state = dest.tmp / "state" / "domains"
    state.mkdir(parents=True)
    (state / "vm.json").write_text(json.dumps({"key": "vm", "domain": "vm", "uuid": "6a0c6c5e-7f55-4b4a-9d8e-000000000001",
                                               "status": "incoming", "holding": {}, "steps": []}))
    other = agent(dest, {"vstor_agent": 1, "op": "abort", "name": "vm", "uuid": "6a0c6c5e-7f55-4b4a-9d8e-0000000000ff"})
    assert other["ok"] is False and other["exit_code"] == 3 and (state / "vm.json").exists()
    assert agent(dest, {"vstor_agent": 1, "op": "status", "name": "vm"})["status"] == "incoming"
    gone = agent(dest, {"vstor_agent": 1, "op": "abort", "name": "vm", "uuid": "6a0c6c5e-7f55-4b4a-9d8e-000000000001"})
    assert gone["ok"] and gone["aborted"] and not (state / "vm.json").exists()
