"""What vstor's avocado-vt tests share: the lab from the test's params
(lab.py), vstor's CLI and virsh (cli.py), the host's devices (hostdev.py),
a guest booted in a vstor domain (guestrun.py), NUMA locality (numa.py).

Failures raise avocado's TestFail / TestError; absent hardware TestCancel
with the reason, which avocado reports as CANCEL."""
