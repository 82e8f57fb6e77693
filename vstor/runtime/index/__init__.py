"""What every state record holds, kept beside the records (store.py) and
asked one thing at a time (views.py); see store.py."""

from vstor.runtime.index.shape import summary  # noqa: F401
from vstor.runtime.index.store import UNREADABLE, Index, plain, reindex  # noqa: F401
from vstor.runtime.index.views import FromIndex, IndexLedger  # noqa: F401
