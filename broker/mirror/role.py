"""A site's DR role and epoch, durable in `<data-dir>/mirror-role.json`.

Fencing rule: a site takes client writes only while its role is `source`; every
switch raises the DR epoch (a demotion token carries the next one, a forced
promotion takes one above any it has seen), the link's handshake carries the
source's epoch both ways, and a site that learns of a higher epoch than its own
while it is a source demotes itself to `replica` at once. The record is replaced
before a switch is answered, so a restart never makes a demoted site writable
again, and a repeated request gets the answer it got the first time.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Final

from pydantic import BaseModel

from twinmq.broker.api import MirrorRole, MirrorRpo, MirrorSwitch
from twinmq.broker.damage import replace_file

log = logging.getLogger(__name__)

ROLE_FILE: Final = "mirror-role.json"


class SiteRole(BaseModel):
    """The durable record."""

    role: MirrorRole
    epoch: int = 0
    last_switch: MirrorSwitch | None = None  # replayed to a repeated request
    rpo: MirrorRpo | None = None  # of the last forced promotion
    needs_resync: str | None = None  # the backlog was dropped: why
    fenced_by: str | None = None  # demoted by a higher epoch (not by a switchover): why
    took_over_from: str | None = None  # promoted with this origin's token: its site only


class RoleStore:
    """The site's role: read at start-up, replaced atomically at every change."""

    def __init__(self, data_dir: Path, first: MirrorRole) -> None:
        self.path = data_dir / ROLE_FILE
        if self.path.exists():
            self.current = SiteRole.model_validate_json(self.path.read_bytes())
            if self.current.role != first:
                log.warning("mirror: DR role %s (epoch %d) from %s, not --mirror-role %s",
                            self.current.role, self.current.epoch, self.path, first)  # fmt: skip
        else:
            self.current = SiteRole(role=first)

    @property
    def role(self) -> MirrorRole:
        """The role now."""
        return self.current.role

    @property
    def epoch(self) -> int:
        """The DR epoch now."""
        return self.current.epoch

    def save(self, record: SiteRole) -> None:
        """Make `record` durable, then current."""
        replace_file(self.path, record.model_dump_json(indent=1).encode())
        self.current = record
