"""The `vstor` command line (virsh-like: vstor [-c URI] COMMAND ...)."""
