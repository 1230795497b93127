"""Durable file replacement: the one place for write-to-temp, fsync, rename, fsync the
directory (a rename survives a power loss only once its directory is synced)."""

from __future__ import annotations

import os
from pathlib import Path


def sync_dir(directory: Path) -> None:
    """fsync a directory: its entries (a create, a rename, an unlink) become durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_file(path: Path, data: bytes) -> None:
    """Replace `path` with `data` atomically and durably (`<path>.tmp`, fsync, rename,
    fsync the directory): a reader sees the old content or the new, never part of it."""
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    sync_dir(path.parent)
