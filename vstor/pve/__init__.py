"""Proxmox VE: a VM's config file as data (config), and, built on it, the
second renderer of vstor's plan and the hookscript (issue 11, in progress)."""
