"""Where the ledger comes from: the plans recorded in every defined domain
(through libvirt) and, for running domains, the state directory."""

from __future__ import annotations

import sys

from vstor.meta.document import Domain
from vstor.errors import VstorError
from vstor.planner.ledger import Holding, Ledger
from vstor.runtime import virt


def holdings_from_libvirt(conn) -> list[Holding]:
    out = []
    for vdom in virt.all_domains(conn):
        try:
            dom = Domain.parse(virt.inactive_xml(vdom), f"domain '{vdom.name()}'")
            if not dom.has_vstor():
                continue
            plan = dom.recorded_plan()
        except VstorError as e:
            # One damaged neighbour must not block planning for everybody.
            print(f"vstor: warning: ledger skips {e}", file=sys.stderr)
            continue
        if plan is not None:
            out.append(Holding.from_plan(plan, active=bool(vdom.isActive())))
    return out


def load_ledger(conn=None, records=()) -> Ledger:
    """Every defined domain's plan (libvirt) and, besides, what state
    records hold for domains libvirt does not list: prepared by hand, or
    reserved for an incoming migration."""
    from vstor.runtime.lifecycle import holding_of
    holdings = holdings_from_libvirt(conn) if conn is not None else []
    known = {h.domain for h in holdings}
    holdings += [holding_of(r) for r in records if r.holding and r.domain not in known]
    return Ledger(holdings)
