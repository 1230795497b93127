"""A compact set of one origin's sequence numbers: a bitmap from a moving floor.

The dedup window moves a key it still awaits on a lagging link here once it is older than
`dedup-window` keys: one bit per seq instead of a ~150-byte dictionary entry. An origin's
seqs are its replication IDs (headers.py), increasing but not dense (its other messages,
its records, what it republishes for other origins take IDs too), so a run-length or
interval set would hold about one interval per key; a bitmap costs one bit per ID of the
span between the floor and the newest seq, whatever the density. The floor rises as every
link passes the seqs below it (`trim`), so the span is the lag, not the history.

Sans-I/O: the window journals `encode()` as a snapshot record and `decode`s it at load.
"""

from __future__ import annotations

import base64
import binascii
from typing import Final

# Every byte of the bitmap starts at a multiple of 8, so the floor moves by whole bytes.
_ALIGN: Final = 8


class SeqBits:
    """Seqs of one origin at or above `base` (a multiple of 8); the ones below are not
    known (the floor: either every path has passed them or they were forced out)."""

    __slots__ = ("base", "bits", "count")

    def __init__(self) -> None:
        self.base = 0
        self.bits = bytearray()
        self.count = 0  # seqs set

    def __contains__(self, seq: int) -> bool:
        offset = seq - self.base
        if offset < 0 or offset >= len(self.bits) * 8:
            return False
        return bool(self.bits[offset >> 3] & (1 << (offset & 7)))

    def __len__(self) -> int:
        return self.count

    @property
    def span(self) -> int:
        """Seqs the bitmap covers (its memory, in bits)."""
        return len(self.bits) * 8

    def add(self, seq: int, limit: int | None = None) -> int:
        """Remember `seq`; the bitmap grows to reach it, downward too (rare: a key that
        leaves the newest window after a newer one of its origin). With `limit` (bits)
        the span never grows past it: an origin's IDs jump (a failover of its pair starts
        a new epoch's range), and a bitmap reaching across the jump would be gigabytes:
        the seqs too far below `seq` are forgotten first, or `seq` itself when it is too
        far below the others. Returns how many seqs were forgotten so."""
        if seq < 0:
            return 0
        forgotten = 0
        if limit is not None and self.bits:
            if seq < self.base and self.base + self.span - seq > limit:
                return 1  # older than the span can reach: not kept
            if seq - self.base >= limit:
                forgotten = self.trim(seq - limit + _ALIGN)
        if not self.bits:
            self.base = seq - seq % _ALIGN
        elif seq < self.base:
            new_base = seq - seq % _ALIGN
            self.bits[0:0] = bytes((self.base - new_base) >> 3)
            self.base = new_base
        offset = seq - self.base
        index = offset >> 3
        if index >= len(self.bits):
            self.bits.extend(bytes(index + 1 - len(self.bits)))
        mask = 1 << (offset & 7)
        if not self.bits[index] & mask:
            self.bits[index] |= mask
            self.count += 1
        return forgotten

    def trim(self, below: int) -> int:
        """Forget every seq under `below`; the number forgotten."""
        if below <= self.base or not self.bits:
            return 0
        drop = min((below - self.base) >> 3, len(self.bits))
        gone = sum(bin(byte).count("1") for byte in self.bits[:drop])
        del self.bits[:drop]
        self.base += drop * 8
        if self.bits and below > self.base:
            # The byte holding `below`: its lower bits go, the floor stays on the byte.
            low = (1 << (below - self.base)) - 1
            gone += bin(self.bits[0] & low).count("1")
            self.bits[0] &= ~low & 0xFF
        self.count -= gone
        # Leading empty bytes cost memory and say nothing: the floor moves past them.
        empty = len(self.bits) - len(self.bits.lstrip(b"\x00"))
        if empty:
            del self.bits[:empty]
            self.base += empty * 8
        return gone

    def union(self, other: SeqBits, limit: int | None = None) -> int:
        """Add every seq of `other` (a snapshot read back at load), within `limit` (as
        `add`); how many seqs were forgotten so."""
        if not self.bits:
            self.base, self.bits, self.count = other.base, bytearray(other.bits), other.count
            return 0
        forgotten = 0
        for index, byte in enumerate(other.bits):
            if byte:
                for bit in range(8):
                    if byte & (1 << bit):
                        forgotten += self.add(other.base + index * 8 + bit, limit)
        return forgotten

    def encode(self) -> str:
        """`base:bitmap` (base64): one line of a snapshot record."""
        return f"{self.base}:{base64.b64encode(bytes(self.bits)).decode()}"

    @classmethod
    def decode(cls, text: str) -> SeqBits | None:
        """The inverse of `encode`; None for text it did not make."""
        base, sep, bitmap = text.partition(":")
        if not sep or not base.isdigit():
            return None
        try:
            raw = base64.b64decode(bitmap, validate=True)
        except (binascii.Error, ValueError):
            return None
        made = cls()
        made.base = int(base) - int(base) % _ALIGN
        made.bits = bytearray(raw)
        made.count = sum(bin(byte).count("1") for byte in raw)
        return made
