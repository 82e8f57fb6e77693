"""Proxmox VE's formats: a VM config (config), its property strings and
`hostpciN` lines (grammar), its `args` words (words), what a config says
about the VM (vm), storage.cfg (storage).  vstor.pve reads and writes the
files; vstor.render.pve renders vstor's plan into a config."""
