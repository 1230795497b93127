"""Keep the broker's long-lived objects out of the garbage collector's full collections.

One policy for the process, as the collector is one (`HEAP`): two freezers would undo
each other's freezes at their sweeps. Its users are the DR mirror's two ends and the
pair's passive during a catch-up.

Both ends of a mirror hold every message of their queues as long-lived Python
objects (the `Message` and `Entry` of each, the source's events too), never in
a reference cycle: reference counting frees them when they are settled. CPython
walks all of them at each full collection, which it starts whenever the
long-lived objects grew by a quarter: with tens of thousands of messages held,
pauses of 100-640 ms on either side, several a minute, each holding up the
link (events not sent, not applied, acknowledgements not read). They were the
largest share of the mirror's lag p99 (docs/benchmarks.md, "DR mirror lag").

So each end calls `HeapFreezer.freeze` once per event made or batch applied:
`gc.freeze()` (constant time) moves every tracked object into the permanent
generation, which no collection walks. The price is that a garbage cycle present
at a freeze is not collected then; every `sweep_every` seconds the permanent
generation is given back and one full collection reclaims them: one pause per
sweep (about 0.5 s per million tracked objects here) instead of several per
minute, and the memory such cycles can hold stays
bounded by what the broker makes of them in that time. The pair's passive
freezes after each catch-up chunk (`broker/replication/replica.py`: 1 M messages
caught up otherwise cost 16 full collections of up to 0.4 s, a quarter of its
CPU); it never unfreezes at the end of the catch-up, since that full collection
would walk the whole backlog once, in sync, holding up the active's confirms: the
next sweep does it, as for the mirror.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Protocol

SWEEP_EVERY = 300.0  # seconds between full collections (reclaiming frozen garbage cycles)


class Collector(Protocol):
    """The garbage collector's controls this uses (the `gc` module)."""

    def freeze(self) -> None:
        """Move every tracked object into the permanent generation."""
        ...

    def unfreeze(self) -> None:
        """Give the permanent generation back to the oldest one."""
        ...

    def collect(self, generation: int = 2) -> int:
        """Run a collection; the unreachable objects found."""
        ...


class HeapFreezer:
    """Freezes the heap after each batch of long-lived objects; sweeps it now and then."""

    def __init__(
        self,
        collector: Collector = gc,
        clock: Callable[[], float] = time.monotonic,
        sweep_every: float = SWEEP_EVERY,
    ) -> None:
        self.collector = collector
        self.clock = clock
        self.sweep_every = sweep_every
        self.swept_at = clock()
        self.sweeps = 0

    def freeze(self) -> None:
        """Long-lived objects were just made (an event, an applied batch): out of the
        collector's generations; first a sweep if the last one is `sweep_every` old."""
        now = self.clock()
        if now - self.swept_at >= self.sweep_every:
            self.swept_at = now
            self.sweeps += 1
            self.collector.unfreeze()
            self.collector.collect()  # the garbage cycles frozen since the last sweep
        self.collector.freeze()


HEAP = HeapFreezer()
"""The process's one freezer (the broker's policy): every user shares its sweeps."""
