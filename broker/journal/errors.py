"""The journal's exceptions."""

from __future__ import annotations

import errno

__all__ = [
    "DefinitionsDamaged",
    "DiskFullError",
    "FatalJournalError",
    "JournalError",
    "io_error",
]

_DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


class JournalError(Exception):
    """The journal cannot do what was asked (I/O error, corruption, misuse)."""


class DiskFullError(JournalError):
    """A write failed for lack of space; it was rolled back and the journal still works."""


class FatalJournalError(JournalError):
    """The file could not be put back in a known state: stop writing for good."""


class DefinitionsDamaged(JournalError):
    """The definitions log has an unreadable record with intact ones after it (not a
    torn tail): the start is refused, and the damage is recorded (DAMAGED.json)."""

    def __init__(self, message: str, *, file: str, offset: int, length: int, reason: str) -> None:
        super().__init__(message)
        self.file = file
        self.offset = offset
        self.length = length  # bytes from the bad record to the end of the file
        self.reason = reason


def io_error(what: str, exc: OSError) -> JournalError:
    """The journal error for a failed system call: DiskFullError for ENOSPC/EDQUOT."""
    if exc.errno in _DISK_FULL_ERRNOS:
        return DiskFullError(f"{what}: {exc}")
    return JournalError(f"{what}: {exc}")
