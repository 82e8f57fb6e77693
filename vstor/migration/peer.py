"""How the source reaches vstor on the destination: `[migrate] peer_command`
(by default `ssh -o BatchMode=yes -- {host} vstor migrate agent`, as virsh
reaches a qemu+ssh:// URI), run as an argv, never through a shell; one JSON
request on its stdin, one JSON answer on its stdout."""

from __future__ import annotations

import ipaddress
import json
import re
import shlex
import subprocess
from urllib.parse import urlparse

from vstor.config import Config
from vstor.errors import BadInput, Unavailable, from_exit_code, one_line

PROTOCOL = 1
MAX_ANSWER = 16 << 20        # a domain's XML and its verdict, with room to spare
_HOST = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.-]{0,252}$")


def destination(dest: str) -> tuple[str, str]:
    """(host name, libvirt URI) of `--to DEST`: a host name, or a URI."""
    if "://" in dest:
        host = urlparse(dest).hostname
        if not host:
            raise BadInput(f"libvirt URI {dest} names no host", hint="use qemu+ssh://HOST/system")
        uri = dest
    else:
        host = dest.strip("[]")
        uri = f"qemu+ssh://{f'[{host}]' if ':' in host else host}/system"
    if not (_HOST.match(host) or _is_ipv6(host)):
        raise BadInput(f"'{host}' is not a host name", hint="use a DNS name or an IP address")
    return host, uri


def _is_ipv6(text: str) -> bool:
    try:
        return ipaddress.ip_address(text).version == 6
    except ValueError:
        return False


def status(cfg: Config, host: str, rec, timeout: float = 60.0) -> dict:
    """What vstor on `host` holds of the domain of `rec` (a state record):
    the agent's `status` answer, a read."""
    return Peer(cfg, host, timeout).call("status", name=rec.domain, uuid=rec.uuid)


class Peer:
    def __init__(self, cfg: Config, host: str, timeout: float = 300.0):
        self.host = host
        self.argv = [a.replace("{host}", host) for a in shlex.split(cfg.peer_command)]
        self.timeout = timeout
        self.config = cfg.file

    def call(self, op: str, **payload) -> dict:
        request = json.dumps({"vstor_agent": PROTOCOL, "op": op, **payload})
        hint = f"check that vstor is installed on {self.host}, or set [migrate] peer_command in {self.config}"
        try:
            out = subprocess.run(self.argv, input=request.encode(), capture_output=True,
                                 timeout=self.timeout)
        except FileNotFoundError:
            raise Unavailable(f"cannot run {self.argv[0]} to reach vstor on {self.host}", hint=hint) from None
        except subprocess.TimeoutExpired:
            raise Unavailable(f"vstor on {self.host} did not answer '{op}' in {self.timeout:.0f} s "
                              "(it may still finish)", hint=f"see vstor status on {self.host}; "
                              f"vstor migrate abort DOMAIN --to {self.host} gives up") from None
        if len(out.stdout) > MAX_ANSWER:
            raise Unavailable(f"vstor on {self.host} answered '{op}' with {len(out.stdout)} bytes",
                              hint=hint)
        try:
            answer = json.loads(out.stdout)
            if not isinstance(answer, dict):
                raise ValueError("not an object")
        except ValueError:
            lines = out.stderr.decode(errors="replace").strip().splitlines()
            why = lines[-1] if lines else f"exit status {out.returncode}, no answer"
            raise Unavailable(one_line(f"vstor on {self.host} did not answer '{op}': {why}"),
                              hint=hint) from None
        if answer.get("ok") is not True:
            message = answer.get("message")
            message = message if isinstance(message, str) else "refused, saying nothing"
            raise from_exit_code(answer.get("exit_code"), f"{self.host}: {message}")
        return answer
