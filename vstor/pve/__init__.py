"""Proxmox VE: the node's files, locks and processes (node), a VM's plan
(manage, request, snippet), the hookscript, doctor and unapply (leave).
Proxmox's formats themselves are vstor.formats.pve."""
