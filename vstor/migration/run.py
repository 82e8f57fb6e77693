"""`vstor migrate prepare --run`: the migration itself, through libvirt-python
as `virsh migrate --live --persistent --undefinesource` does it, with a
progress line from libvirt's job statistics and a time limit after which
libvirt's job is aborted (the guest keeps running here)."""

from __future__ import annotations

import threading
import time
from typing import Callable

from vstor.errors import ActionFailed, Unavailable, one_line

MIB = 1 << 20


def migrate(src_conn, name: str, dest_uri: str, xml: str, timeout: float,
            say: Callable[[str], None], migrate_uri: str | None = None) -> dict:
    """Migrate `name` to `dest_uri` arriving with `xml`; libvirt's statistics
    of the completed job (downtime, total time, data moved)."""
    import libvirt
    try:
        dom = src_conn.lookupByName(name)
        dconn = libvirt.open(dest_uri)
    except libvirt.libvirtError as e:
        raise Unavailable(one_line(f"cannot reach libvirt for the migration: {e.get_error_message()}"),
                          hint=f"check virsh -c {dest_uri} list") from None
    params = {libvirt.VIR_MIGRATE_PARAM_DEST_XML: xml, libvirt.VIR_MIGRATE_PARAM_PERSIST_XML: xml}
    if migrate_uri:
        params[libvirt.VIR_MIGRATE_PARAM_URI] = migrate_uri
    flags = libvirt.VIR_MIGRATE_LIVE | libvirt.VIR_MIGRATE_PERSIST_DEST | libvirt.VIR_MIGRATE_UNDEFINE_SOURCE
    outcome: dict = {}

    def run():
        try:
            dom.migrate3(dconn, params, flags)
            outcome["ok"] = True
        except libvirt.libvirtError as e:
            outcome["error"] = e.get_error_message()

    worker = threading.Thread(target=run, name="vstor-migrate", daemon=True)
    started = time.monotonic()
    worker.start()
    aborted = None
    try:
        while worker.is_alive():
            worker.join(1.0)
            if not worker.is_alive():
                break
            now = time.monotonic()
            if aborted is None:
                say(progress(_stats(dom), now - started))
                if now - started > timeout:
                    say(f"{timeout:.0f} s passed: aborting libvirt's migration job")
                    aborted = _abort(dom)
            elif now - aborted > 60:
                raise ActionFailed(f"libvirt's migration of {name} did not stop 60 s after it was "
                                   "aborted", hint=f"virsh domjobabort {name}; virsh domjobinfo {name}")
    except KeyboardInterrupt:
        _abort(dom)         # the guest stays here; the caller gives the destination back
        worker.join(30)
        dconn.close()
        raise
    if "error" in outcome:
        why = outcome["error"] + (f" (aborted after [migrate] timeout {timeout:.0f} s)" if aborted else "")
        dconn.close()
        raise ActionFailed(one_line(f"libvirt's migration of {name} failed: {why}"))
    try:
        return dconn.lookupByName(name).jobStats(libvirt.VIR_DOMAIN_JOB_STATS_COMPLETED) or {}
    except libvirt.libvirtError:
        return {}
    finally:
        dconn.close()


def _abort(dom) -> float:
    try:
        dom.abortJob()
    except Exception:       # finished or failed meanwhile: the worker says which
        pass
    return time.monotonic()


def _stats(dom) -> dict:
    try:
        return dom.jobStats() or {}
    except Exception:       # between phases libvirt may have no job to show
        return {}


def progress(stats: dict, elapsed: float) -> str:
    """One line: data remaining, dirty rate, expected downtime, as libvirt says."""
    parts = [f"{elapsed:5.1f} s"]
    if "data_remaining" in stats:
        parts.append(f"{stats['data_remaining'] / MIB:.1f} MiB left of {stats.get('data_total', 0) / MIB:.1f}")
    if "memory_dirty_rate" in stats:
        page = stats.get("memory_page_size", 4096)
        parts.append(f"dirtying {stats['memory_dirty_rate'] * page / MIB:.1f} MiB/s")
    if "downtime" in stats:
        parts.append(f"expected downtime {stats['downtime']} ms")
    return "  migrating: " + ", ".join(parts)


def completed(stats: dict) -> str:
    bits = []
    if "downtime" in stats:
        bits.append(f"downtime {stats['downtime']} ms")
    if "time_elapsed" in stats:
        bits.append(f"{stats['time_elapsed'] / 1000:.1f} s in all")
    if "data_processed" in stats:
        bits.append(f"{stats['data_processed'] / MIB:.1f} MiB moved")
    return ", ".join(bits) or "no statistics from libvirt"
