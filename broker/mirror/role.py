"""A site's DR role and epoch: one record in the internal queue `amq.twinmq.mirror-role`.

Fencing rule: a site takes client writes only while its role is `source`; every
switch raises the DR epoch (a demotion token carries the next one, a forced
promotion takes one above any it has seen), the link's handshake carries the
source's epoch both ways, and a site that learns of a higher epoch than its own
while it is a source demotes itself to `replica` at once.

The record is journaled like the applier's mark (replaced in one group commit)
and a switch is answered only once that batch is complete: a restart never
makes a demoted site writable again, and the pair's passive holds the record
like any op, so a failover of the pair keeps the site's role. A repeated
request gets the answer the record keeps (`last_switch`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Final, Protocol

from pydantic import BaseModel

from twinmq.broker.api import MirrorRole, MirrorRpo, MirrorSwitch, MirrorUnmirrored
from twinmq.broker.journal import JournalOp
from twinmq.broker.mirror.durable import BatchFutures
from twinmq.broker.mirror.events import (
    INTERNAL_PREFIX,
    INTERNAL_QID_BASE,
    replace_record,
    restore_record,
)
from twinmq.broker.queue import Queue

log = logging.getLogger(__name__)

ROLE_QUEUE: Final = INTERNAL_PREFIX + "mirror-role"
ROLE_QID: Final = INTERNAL_QID_BASE + 3


class SiteRole(BaseModel):
    """The record."""

    role: MirrorRole
    epoch: int = 0
    last_switch: MirrorSwitch | None = None  # replayed to a repeated request
    rpo: MirrorRpo | None = None  # of the last forced promotion
    needs_resync: str | None = None  # the backlog was dropped: why
    fenced_by: str | None = None  # demoted by a higher epoch (not by a switchover): why
    took_over_from: str | None = None  # promoted with this origin's token: its site only
    unmirrored: MirrorUnmirrored | None = None  # fenced by a forced failover: what was lost
    # A forced promotion's seed for the old source is not durable yet: clients are refused
    # (also after a restart, or on the pair's passive once it takes over) until one is.
    # Written with the promotion's record, cleared once a seed's batch is complete.
    seed_pending: str | None = None


class RoleHost(Protocol):
    """The virtual host as the role store uses it."""

    next_mid: int
    queues: dict[str, Queue]

    def internal_queue(self, name: str, qid: int, *, locked: bool = True) -> Queue:
        """The broker's own durable queue `name`, made if missing."""
        ...


class RoleLog(Protocol):
    """The group committer as the role store uses it."""

    def add(self, ops: Iterable[JournalOp]) -> int:
        """Journal ops in the open batch; its number."""
        ...


class RoleStore:
    """The site's role, read from its record (recovered, or replicated from the pair's
    active), `first` until a switch writes one."""

    def __init__(
        self, vhost: RoleHost, log: RoleLog, futures: BatchFutures, first: MirrorRole
    ) -> None:
        self.vhost = vhost
        self.log = log
        self.futures = futures
        self._default = SiteRole(role=first)
        self._cached: tuple[int, SiteRole] | None = None

    @property
    def current(self) -> SiteRole:
        """The record now (parsed once per version)."""
        queue = self.vhost.queues.get(ROLE_QUEUE)
        if queue is None or not queue.entries:
            return self._default
        message = queue.entries[-1].message
        if self._cached is None or self._cached[0] != message.mid:
            self._cached = (message.mid, SiteRole.model_validate_json(message.body))
        return self._cached[1]

    @property
    def role(self) -> MirrorRole:
        """The role now."""
        return self.current.role

    @property
    def epoch(self) -> int:
        """The DR epoch now."""
        return self.current.epoch

    def record(self, record: SiteRole) -> int:
        """Make `record` current now (in memory) and journal it; the batch holding it."""
        ops, _undo = self.replace(record)
        return self.log.add(ops)

    def record_undoable(self, record: SiteRole) -> tuple[int, Callable[[], list[JournalOp]]]:
        """`record` made current as by `record`; its batch, and what puts the record it
        replaced back should that batch fail (`MirrorSource.undo_if_failed`)."""
        ops, undo = self.replace(record)
        return self.log.add(ops), undo

    def replace(self, record: SiteRole) -> tuple[list[JournalOp], Callable[[], list[JournalOp]]]:
        """Make `record` current now (in memory), journaling nothing: the ops that journal
        it (for the caller to put in a batch: the committer's tap, in the batch closing),
        and what puts the record it replaced back should that batch fail."""
        queue = self.vhost.internal_queue(ROLE_QUEUE, ROLE_QID)
        previous = list(queue.entries)
        mid = self.vhost.next_mid
        self.vhost.next_mid = mid + 1
        ops = replace_record(queue, mid, record.model_dump_json().encode())
        return ops, lambda: restore_record(queue, previous, mid)

    async def save(self, record: SiteRole) -> bool:
        """`record` current, and durable (on the pair's passive too) before this returns;
        False if its batch failed (the journal refused it)."""
        return await self.futures.wait(self.record(record))
