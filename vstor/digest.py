"""SHA-256 from the interpreter's own module (CPython's _sha256, _sha2 from
3.12), not hashlib's OpenSSL: loading OpenSSL is 2 ms of every hook run
that locks a record (docs/performance.md, "The hook"), and the digests
are the same (tests/test_records.py checks them against hashlib's)."""

try:
    from _sha256 import sha256  # noqa: F401
except ImportError:     # pragma: no cover (3.12 and later; or an interpreter without it)
    try:
        from _sha2 import sha256  # noqa: F401
    except ImportError:
        from hashlib import sha256  # noqa: F401
