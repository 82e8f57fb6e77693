"""SHA-256 for what every hook computes (a plan's intent digest, a lock's
slot): CPython's own implementation when it is there, since hashlib's import
starts OpenSSL (about 3 ms of each hook's start); the same digest either way."""

try:
    from _sha256 import sha256      # CPython 3.11 and earlier
except ImportError:                 # 3.12 renamed it _sha2; any other Python
    from hashlib import sha256

__all__ = ["sha256"]
