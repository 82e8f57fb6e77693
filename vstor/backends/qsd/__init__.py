"""The embedded vhost backend: one qemu-storage-daemon per vstor disk.

Each daemon exports one file or block device as vhost-user-blk on a socket
handed to QEMU (root:<qemu group> 0660), with a QMP monitor socket and a
pidfile in vstor's run directory.

- `export`: what a daemon is (QsdExport), its command line and its record.
  Pure: importing it touches no process, socket or file.
- `daemon`: starting, finding, checking and stopping the daemon itself.
- `monitor`: its QMP monitor, through QEMU's own library (qemu.qmp).
- `proc`: /proc, pidfds, signals, and connecting as QEMU's user.
- `files`: the source, the directories and the socket's ownership.

This package imports none of them, so a pure caller that imports
`vstor.backends.qsd.export` pulls in no process control.
"""
