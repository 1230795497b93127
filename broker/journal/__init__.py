"""Crash-safe message journal and definitions store (see `facade.py` for the overview).

Modules by concern: `ops` (op types and their codec, shared with channel, vhost,
audit and replication), `segment` (the file format and scanning), `recovery`
(replay; torn tail vs corruption; the read-only check), `index` (which segment
holds each live message), `compaction`, `writer` (the writer thread's file I/O),
`completion` (which lsns are done or failed, and who waits) and `facade` (`Journal`).
"""

from twinmq.broker.journal.errors import DefinitionsDamaged, DiskFullError, JournalError
from twinmq.broker.journal.facade import Journal, JournalStats
from twinmq.broker.journal.ops import (
    JournalOp,
    Settle,
    StoredMessage,
    decode_ops,
    encode_message,
    encode_ops,
    encode_settle,
)
from twinmq.broker.journal.recovery import Corruption, Recovered

__all__ = [
    "Corruption",
    "DefinitionsDamaged",
    "DiskFullError",
    "Journal",
    "JournalError",
    "JournalOp",
    "JournalStats",
    "Recovered",
    "Settle",
    "StoredMessage",
    "decode_ops",
    "encode_message",
    "encode_ops",
    "encode_settle",
]
