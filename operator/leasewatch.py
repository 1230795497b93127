"""The active role's Lease as the operator judges it: by what it observed, on its own clock.

As client-go's leader election does (`observedRecord`, `observedTime`), the operator never
compares the Lease's `renewTime`, written with the active broker's wall clock, with its
own wall clock: it remembers the record it last read and the moment (its monotonic clock)
it first read it, and judges by how long it has seen that record unchanged. The Lease
has lapsed once the same record has been seen for its duration; a replication guard of
`<epoch>:0` is trusted once it has been seen for twice that. Why no wall clock is needed
at all: every write by the broker (a renewal, a mark, a catch-up's `0`) changes the
record, and the broker writes nothing that counts after its own deadline (its last
renewal's start + the duration - 1 s, on its monotonic clock), which comes before the
operator's first sight of that renewal + the duration. Only the clocks' *rates* matter
(docs/replication.md, "Clock skew"). Pure: the adapter (`operator/main.py`) reads the
Lease and the clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from twinmq.broker.lease import GUARD_ANNOTATION, ReplicationGuard

GUARD_DURATIONS = 2
"""How many Lease durations a record saying `<epoch>:0` must have been seen unchanged
before the guard is trusted: one for the Lease to lapse, one more as a margin for the
rates of the broker's and the operator's monotonic clocks (a broker clock running up to
half as fast as the operator's still fences before the operator trusts its `0`)."""

Record = tuple[str | None, str | None, str | None, str | None]
"""What identifies one write of the Lease: resourceVersion, holder, renewTime, guard."""


class LeaseState(NamedTuple):
    """What `decide` is told of the Lease (`failover.Observation`)."""

    holder: str | None  # the holder's identity (a broker's pod name), None: no Lease
    expired: bool  # seen unchanged for its duration (or there is none)
    guard: tuple[int, bool] | None  # (epoch, alone): a 1 at once, a 0 once trusted


def record_of(lease: dict[str, Any]) -> Record:
    """The parts of a Lease whose change restarts the observation. The resourceVersion
    alone would do on a real API server (every write that changes anything bumps it);
    the rest keeps a server that omits it honest."""
    meta = lease.get("metadata") or {}
    spec = lease.get("spec") or {}
    annotations = meta.get("annotations") or {}
    guard = annotations.get(GUARD_ANNOTATION)
    return (
        meta.get("resourceVersion"),
        spec.get("holderIdentity"),
        spec.get("renewTime"),
        None if guard is None else str(guard),
    )


@dataclass
class LeaseWatch:
    """One operator process's sight of one cluster's Lease: the record last read and when
    (its monotonic clock) it first read it. Kept in memory only: a restarted operator (or
    a new leader) starts from its first read, and so waits a whole duration (two for a
    `0`) before it calls the Lease lapsed, however old its `renewTime` looks."""

    record: Record | None = None
    since: float = 0.0

    def judge(self, lease: dict[str, Any] | None, now: float) -> LeaseState:
        """Take in the Lease as read just now (`now`: the monotonic clock read *after* the
        answer, so never before the record was written) and judge it."""
        if lease is None:
            self.record = None
            return LeaseState(None, True, None)
        record = record_of(lease)
        if record != self.record:
            self.record, self.since = record, now
        seen_for = now - self.since
        spec = lease.get("spec") or {}
        duration = float(spec.get("leaseDurationSeconds") or 0)
        expired = seen_for >= duration
        guard = ReplicationGuard.of_lease(lease)
        if guard is None or not (guard.alone or seen_for >= GUARD_DURATIONS * duration):
            # Not trusted (yet): the passive's readiness window decides, as without a
            # guard. A mark (`alone`) is news at once: the active wrote it before it
            # confirmed alone, whatever the clocks.
            return LeaseState(spec.get("holderIdentity"), expired, None)
        return LeaseState(spec.get("holderIdentity"), expired, (guard.epoch, guard.alone))
