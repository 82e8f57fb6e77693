"""Live migration: whether a domain can move (verdict, pure), how the source
reaches vstor on the destination (peer), what the destination does for an
incoming domain (agent), and the source's commands (source).

The destination never trusts the source's plan: it plans the domain's intent
again with its own host model, config and ledger, exactly as for a start,
and the XML the domain arrives with is that plan rendered onto the domain
libvirt sends (vstor.render.migration)."""
