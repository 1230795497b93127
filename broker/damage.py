"""The damaged marker: a broker whose journal was corrupt may know less than it confirmed.

When recovery finds corruption (`twinmq.broker.journal.recovery`), the broker
writes `<data-dir>/DAMAGED.json` with what was found. The marker outlives the
restart that found it (the damaged segments are in quarantine by then, so the
journal itself scans clean) until an operator runs `twinmq-broker journal
repair`. While it is there and the broker has not caught up from an active since,
the broker is *damaged*: it refuses `POST /role active` without `force`, and as
an active it never tells its passive to discard messages (catch-up must not
spread a loss). See docs/journal.md, "Corruption".
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from pydantic import BaseModel, Field, ValidationError

from twinmq.broker.api import CorruptionReport
from twinmq.broker.atomicfile import replace_file, sync_dir
from twinmq.broker.journal import DefinitionsDamaged, Recovered

__all__ = [
    "MARKER",
    "DamageMarker",
    "clear",
    "load",
    "quarantine_dir",
    "record",
    "record_definitions",
    "save",
]

log = logging.getLogger(__name__)

MARKER = "DAMAGED.json"


def quarantine_dir(data_dir: Path) -> Path:
    """Where damaged journal files are kept."""
    return data_dir / "quarantine"


class DamageMarker(BaseModel):
    """`<data-dir>/DAMAGED.json`."""

    since: float = Field(description="Unix time the first corruption was found")
    corruption: list[CorruptionReport] = Field(default_factory=list)
    healed_by: str | None = Field(
        None, description="The active whose complete catch-up made this broker whole again"
    )


def load(data_dir: Path) -> DamageMarker | None:
    """The marker, None if there is none. An unreadable marker still means damaged."""
    path = data_dir / MARKER
    try:
        return DamageMarker.model_validate_json(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValidationError) as exc:
        log.error("cannot read %s (%s): treating this broker as damaged", path, exc)
        return DamageMarker(since=path.stat().st_mtime if path.exists() else 0.0)


def record(data_dir: Path, recovered: Recovered, now: float) -> DamageMarker:
    """Add what `recovered` found to the marker (creating it), durably; return it."""
    marker = load(data_dir) or DamageMarker(since=now)
    moved = {p.name.split(".seg")[0] + ".seg": p for p in recovered.quarantined}
    for found in recovered.corruption:
        target = moved.get(found.segment)
        marker.corruption.append(
            CorruptionReport(
                segment=found.segment,
                offset=found.offset,
                length=found.length,
                reason=found.reason,
                detected_at=now,
                quarantined_as=None if target is None else str(target),
            )
        )
    marker.healed_by = None  # new damage: any earlier healing is void
    save(data_dir, marker)
    return marker


def record_definitions(data_dir: Path, found: DefinitionsDamaged, now: float) -> DamageMarker:
    """Add a damaged definitions log (the start it refuses) to the marker, durably, once
    per place: every refused restart finds the same damage again."""
    marker = load(data_dir) or DamageMarker(since=now)
    if not any(c.segment == found.file and c.offset == found.offset for c in marker.corruption):
        marker.corruption.append(
            CorruptionReport(
                segment=found.file,
                offset=found.offset,
                length=found.length,
                reason=found.reason,
                detected_at=now,
            )
        )
        marker.healed_by = None
        save(data_dir, marker)
    return marker


def save(data_dir: Path, marker: DamageMarker) -> None:
    """Replace the marker atomically (tmp, fsync, rename, fsync dir)."""
    replace_file(data_dir / MARKER, marker.model_dump_json(indent=1).encode())


def clear(data_dir: Path) -> bool:
    """Remove the marker (the repair command); whether there was one."""
    path = data_dir / MARKER
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    with contextlib.suppress(OSError):
        sync_dir(data_dir)
    return True
