"""The highest epoch a broker has seen, persisted so a restart cannot forget it."""

from __future__ import annotations

import json
from pathlib import Path

from twinmq.broker.atomicfile import replace_file

# A replication ID is (epoch << EPOCH_SHIFT) | sequence: IDs assigned in different
# epochs never collide, even when an old active assigned some that never replicated.
EPOCH_SHIFT = 40


def first_mid(epoch: int) -> int:
    """The first replication ID of an epoch."""
    return (epoch << EPOCH_SHIFT) + 1


def epoch_of(mid: int) -> int:
    """The epoch a replication ID was assigned in."""
    return mid >> EPOCH_SHIFT


def epoch_jump_refusal(current: int, offered: int, max_jump: int) -> str | None:
    """Why a peer's `offered` epoch is not believed (None: it is plausible).

    Every failover raises the epoch by one; a peer, even an authenticated one,
    that claims far more is broken or forged, and believing it would fence
    this broker out of every later role change (409) until someone edits
    `epoch.json` by hand.
    """
    if offered - current > max_jump:
        return (
            f"epoch {offered} is {offered - current} ahead of this broker's {current} "
            f"(more than max_epoch_jump {max_jump})"
        )
    return None


class EpochStore:
    """`<data-dir>/epoch.json`: replaced atomically, only ever raised (but by `epoch set`)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.epoch = 0
        if path.exists():
            self.epoch = int(json.loads(path.read_text())["epoch"])

    def raise_to(self, epoch: int) -> bool:
        """Persist `epoch` if it is higher than any seen; return whether it was."""
        if epoch <= self.epoch:
            return False
        self.write(epoch)
        return True

    def write(self, epoch: int) -> None:
        """Persist `epoch`, lower or not: only the operator's recovery (`epoch set`) lowers one."""
        replace_file(self.path, json.dumps({"epoch": epoch}).encode())
        self.epoch = epoch
