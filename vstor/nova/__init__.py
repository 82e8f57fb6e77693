"""OpenStack Nova: its own PCI passthrough configured from the host model (config.py), and Nova instances in the hook."""
