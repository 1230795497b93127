"""What the replication source and replica need from the broker around them.

As `ConnectionContext` does for client connections: replication depends on
these Protocols, not on the whole `Broker`. The broker satisfies them as it
is (its `committer` and `vhost` attributes are the real objects); a test or
another host can satisfy them with anything of the same shape.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from twinmq.broker.api import Role
    from twinmq.broker.commit import Waiter
    from twinmq.broker.dedup import DedupWindow
    from twinmq.broker.definitions import Definitions, DefinitionsDelta
    from twinmq.broker.journal import JournalError, JournalOp
    from twinmq.broker.queue import Queue
    from twinmq.broker.settings import BrokerSettings
    from twinmq.broker.tls import MutualTls


class ReplicatedLog(Protocol):
    """The group committer as replication sees it: batches out (active), batches in (passive)."""

    on_batch: Callable[[int, list[JournalOp]], None] | None

    @property
    def guarded(self) -> bool:
        """Whether completion waits for the passive's acknowledgement."""
        ...

    def guard(self, on: bool) -> None:
        """Make completion wait for the passive (on) or for the local disk only (off)."""
        ...

    def flush_now(self) -> int:
        """Close the open batch now; its number."""
        ...

    def flush_topology(self) -> None:
        """Write the staged topology changes now (one append, one fsync)."""
        ...

    def withdrawn(self, batch: int | None = None) -> None:
        """The passive no longer holds the failed batches up to `batch` (None: any)."""
        ...

    def replica_acked(self, batch: int) -> None:
        """The passive has everything up to `batch` on its disk."""
        ...

    def add(self, ops: Iterable[JournalOp], encoded: bytes | None = None) -> int:
        """Journal ops (`encoded`: already in the journal's encoding) in the open batch;
        its number."""
        ...

    def confirm_point(self) -> int:
        """The batch whose durability covers everything added so far."""
        ...

    def await_durable(self, waiter: Waiter) -> None:
        """Call `waiter.durable(batch)` as batches become durable."""
        ...

    async def idle(self, limit: float) -> None:
        """Wait (at most `limit` seconds) until no batch waits for its sync."""
        ...


class ReplicatedState(Protocol):
    """The virtual host as replication sees it: its messages and topology."""

    on_topology_change: Callable[[Definitions], None] | None
    on_topology_delta: Callable[[DefinitionsDelta], None] | None

    def definitions(self) -> Definitions:
        """The durable topology."""
        ...

    def all_definitions(self) -> Definitions:
        """The durable topology of every vhost (what the passive is sent)."""
        ...

    def all_queues(self) -> list[Queue]:
        """The queues of every vhost (what the catch-up reads)."""
        ...

    queues: dict[str, Queue]
    next_mid: int
    dedup: DedupWindow  # the active's window travels with every catch-up

    def queue_by_qid(self, qid: int) -> Queue | None:
        """The queue of an incarnation id, if it still exists."""
        ...

    def replication_snapshot(self) -> dict[int, list[int]]:
        """The replication IDs held per durable queue (the passive's side)."""
        ...

    def apply_ops(
        self, ops: list[JournalOp], *, defer_sort: bool = False, catchup: bool = False
    ) -> list[str]:
        """Apply replicated ops to the queues (passive); return their messages' dedup keys."""
        ...

    def remember_when_durable(self, keys: list[str], batch: int) -> None:
        """Admit dedup keys to the window once `batch` is durable here (never if it fails)."""
        ...

    def forget_dedup_window(self) -> None:
        """Drop every admitted dedup key (a passive's catch-up brings the active's window)."""
        ...

    def forget_dedup_keys(self, keys: list[str]) -> None:
        """Drop these dedup keys, admitted or waiting (a failed batch's, withdrawn)."""
        ...

    def restore_order(self) -> None:
        """Sort queues the deferred batches left out of replication ID order (passive)."""
        ...

    def apply_definitions(self, defs: Definitions, served: Collection[str] | None = None) -> None:
        """Make the topology equal to the active's (passive); with `served`, drop the vhosts
        neither `defs` nor `served` names."""
        ...

    def apply_delta(
        self,
        delta: DefinitionsDelta,
        staged: Callable[[JournalError | None], None] | None = None,
    ) -> None:
        """Apply one topology change of the active's (passive); with `staged`, its write
        staged for the group commit (`flush_topology`), `staged` told the outcome."""
        ...


class GuardRecorder(Protocol):
    """The active's Lease as replication uses it: the replication guard it carries
    (`broker/lease.py`, `ReplicationGuard`)."""

    async def record_alone(self) -> bool:
        """Mark the Lease before confirming without the passive; True once durable there
        and this broker may still act as the active."""
        ...

    def passive_in_sync(self) -> None:
        """The passive caught up: the Lease may say `alone` = 0 again."""
        ...


class ReplicationContext(Protocol):
    """What the replication source and replica use of the broker."""

    @property
    def lease(self) -> GuardRecorder | None:
        """The active role's Lease (None: not in Kubernetes, no guard to record)."""
        ...

    @property
    def settings(self) -> BrokerSettings:
        """Name, replication timeouts and limits."""
        ...

    @property
    def role(self) -> Role:
        """This broker's role now."""
        ...

    @property
    def epoch(self) -> int:
        """The highest epoch this broker has seen (persisted)."""
        ...

    @property
    def committer(self) -> ReplicatedLog:
        """The journal's group committer."""
        ...

    @property
    def vhost(self) -> ReplicatedState:
        """The virtual host."""
        ...

    @property
    def damaged(self) -> bool:
        """Its journal lost data to corruption (then, as active, it never makes its passive
        discard: catch-up must not spread the loss)."""
        ...

    def replication_token(self) -> str | None:
        """The link's shared secret (None: none configured, nobody is authenticated)."""
        ...

    @property
    def replication_tls(self) -> MutualTls | None:
        """The link's mutual TLS (None: plain TCP, the token alone)."""
        ...

    def served_vhosts(self) -> frozenset[str]:
        """The vhosts this broker's users file declares (and `/`)."""
        ...

    def stop_passive(self, reason: str) -> None:
        """This passive cannot go on (a local write failed, replication ended): log
        `reason` and exit with 75, so that a restart recovers from the disk."""
        ...

    async def save_dedup_window(self) -> bool:
        """Write the dedup window now if it changed since the last write; False if the
        write failed (the file keeps the previous window)."""
        ...

    async def save_or_remove_dedup_window(self) -> bool:
        """Write the dedup window now, or else remove its file (a passive); False only if
        both failed."""
        ...

    def learn_epoch(self, epoch: int, source: str) -> bool:
        """An authenticated peer knows `epoch`: persist it if higher (an active steps down).

        Returns False if it was refused as an implausible jump (logged and
        reported by the broker); the caller then closes the link.
        """
        ...
