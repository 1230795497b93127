"""The catch-up handshake's decision, as a pure function.

On every (re)connect the passive sends the replication IDs it holds per queue;
the active compares them with its own live messages: what the passive lacks is
sent, what the passive holds but the active no longer does (dequeued, or never
confirmed before a failover) is discarded, and nothing the passive already has
is copied again.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from twinmq.broker.journal import JournalOp, Settle, StoredMessage


@dataclass
class CatchupPlan:
    """What the active sends to bring a passive to its state."""

    send: list[StoredMessage] = field(default_factory=list)
    discard: list[Settle] = field(default_factory=list)
    kept: int = 0  # messages the passive already had

    @property
    def ops(self) -> list[JournalOp]:
        """The plan as one batch of journal ops (discards first)."""
        return [*self.discard, *self.send]


def plan_catchup(
    active: Mapping[int, Iterable[StoredMessage]],
    passive: Mapping[int, Iterable[int]],
    *,
    discard: bool = True,
) -> CatchupPlan:
    """Compare the active's live messages per qid with the passive's IDs per qid.

    Queues the active does not have are dropped on the passive by the topology
    it receives, so their IDs need no discard. With `discard=False` (a damaged
    active: journal corruption may have cost it messages) nothing is discarded:
    the passive keeps what the active lacks, so catch-up never spreads a loss.
    """
    plan = CatchupPlan()
    for qid, messages in active.items():
        have = set(passive.get(qid, ()))
        live: set[int] = set()
        for message in messages:
            live.add(message.mid)
            if message.mid in have:
                plan.kept += 1
            else:
                plan.send.append(message)
        if discard:
            plan.discard.extend(Settle(qid, mid) for mid in sorted(have - live))
    return plan
