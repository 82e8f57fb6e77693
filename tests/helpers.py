"""What the test modules share besides fixtures (those are in
tests/conftest.py): a test module imports from here, never from another
test module."""

import os

import pytest

from vstor.config import Config
from vstor.errors import DoesNotFit
from vstor.meta.document import Domain
from vstor.planner import Request, plan_domain
from vstor.planner.ledger import Ledger

NS = "https://vstor.dev/xmlns/domain/1"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Data of other projects, never copied into the checkout: ../shared next to it, where CI puts it.
SHARED = os.path.normpath(os.path.join(ROOT, "..", "shared"))


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("true", "1", "yes")


def unavailable(reason: str) -> None:
    """A test that cannot run here is skipped saying why, except in CI
    (CI=true), where a missing piece must not pass as green: it fails."""
    if in_ci():
        pytest.fail(f"{reason} (CI is set, so this fails instead of skipping)", pytrace=False)
    pytest.skip(reason)


# -- planner requests (tests/test_planner.py and the cells, host and migration tests) ----------

def request(disks: str, vm: str = "", name="vm1", vcpus=4, memory_mib=8192, machine="q35") -> Request:
    return Request.from_domain(Domain.parse(f"""
      <domain type='kvm'><name>{name}</name><memory unit='MiB'>{memory_mib}</memory>
      <vcpu>{vcpus}</vcpu><metadata><vstor:vstor xmlns:vstor='{NS}'>{vm}{disks}</vstor:vstor></metadata>
      <os><type arch='x86_64' machine='{machine}'>hvm</type></os><devices/></domain>"""))


def nvme(addr, target="vdb", **attrs):
    a = " ".join(f"{k}='{v}'" for k, v in attrs.items())
    return f"<vstor:disk target='{target}' {a}><vstor:nvme controller='{addr}'/></vstor:disk>"


def nvmf(target="vdb", **attrs):
    a = " ".join(f"{k}='{v}'" for k, v in attrs.items())
    return (f"<vstor:disk target='{target}' {a}><vstor:nvmf transport='rdma' traddr='192.168.100.8' "
            "subnqn='nqn.2016-06.io.spdk:cnode1'><vstor:path traddr='192.168.101.8'/></vstor:nvmf></vstor:disk>")


def qsd_file(path="/var/lib/vstor/images/a.raw", target="vdb", **attrs):
    a = " ".join(f"{k}='{v}'" for k, v in attrs.items())
    return f"<vstor:disk target='{target}' {a}><vstor:file path='{path}'/></vstor:disk>"


def request_xml(disks, vm="", name="vm1", vcpus=4, memory_mib=8192, machine="q35") -> str:
    return (f"<domain type='kvm'><name>{name}</name><memory unit='MiB'>{memory_mib}</memory>"
            f"<vcpu>{vcpus}</vcpu><metadata><vstor:vstor xmlns:vstor='https://vstor.dev/xmlns/domain/1'>"
            f"{vm}{disks}</vstor:vstor></metadata><os><type arch='x86_64' machine='{machine}'>hvm</type>"
            "</os><devices/></domain>")


SPDK_CFG = Config(reactors=(2, 18))


def refused(host, cfg, req, ledger=Ledger()) -> str:
    with pytest.raises(DoesNotFit) as e:
        plan_domain(host, cfg, req, ledger)
    assert e.value.exit_code == 3 and "\n" not in str(e.value)
    return str(e.value)
