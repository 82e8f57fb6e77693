"""What vstor's disks are doing and whether the host still runs the plan:
collect.py looks (per disk, from its backend; what vstor holds and
counted), totals.py folds the hooks' and commands' counted events,
expose.py gives a look to Prometheus (prometheus_client), top.py to a
terminal."""
