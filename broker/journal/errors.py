"""The journal's exceptions."""

from __future__ import annotations

import errno

__all__ = ["DiskFullError", "FatalJournalError", "JournalError", "io_error"]

_DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


class JournalError(Exception):
    """The journal cannot do what was asked (I/O error, corruption, misuse)."""


class DiskFullError(JournalError):
    """A write failed for lack of space; it was rolled back and the journal still works."""


class FatalJournalError(JournalError):
    """The file could not be put back in a known state: stop writing for good."""


def io_error(what: str, exc: OSError) -> JournalError:
    """The journal error for a failed system call: DiskFullError for ENOSPC/EDQUOT."""
    if exc.errno in _DISK_FULL_ERRNOS:
        return DiskFullError(f"{what}: {exc}")
    return JournalError(f"{what}: {exc}")
