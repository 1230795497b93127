"""Synthetic audit logs of a pair, written as the brokers write them (tests and demos).

`PairLog` records what two brokers would have written, event by event, and
writes each broker's segments as JSON lines into `<dir>/<broker>/audit/`
(ready for the shipper). A segment holds one epoch; `rotate` starts a new one.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from twinmq.audit.records import AuditEvent, AuditRecord, body_digest

EPOCH_SHIFT = 40


def rid(epoch: int, n: int) -> int:
    """A replication id as brokers assign them."""
    return (epoch << EPOCH_SHIFT) | n


@dataclasses.dataclass
class _Segment:
    epoch: int
    seq: int
    records: list[AuditRecord] = dataclasses.field(default_factory=list)


class PairLog:
    """Two brokers' audit logs, built record by record in log order."""

    def __init__(self, brokers: tuple[str, str] = ("a", "b")) -> None:
        self.brokers = brokers
        self.segments: dict[str, list[_Segment]] = {b: [] for b in brokers}

    def add(
        self,
        broker: str,
        epoch: int,
        event: AuditEvent,
        queue: str,
        replication_id: int,
        time: float,
        message_id: str | None = None,
        body: str | None = None,
    ) -> None:
        """Append one record to the broker's current segment (a new one on a new epoch)."""
        segments = self.segments[broker]
        if not segments or segments[-1].epoch != epoch:
            self.rotate(broker, epoch)
        stored = event != AuditEvent.DEQUEUED
        segments[-1].records.append(
            AuditRecord(
                broker=broker,
                epoch=epoch,
                queue=queue,
                replication_id=replication_id,
                message_id=message_id if stored else None,
                digest=body_digest((body if body is not None else str(replication_id)).encode())
                if stored
                else "",
                event=event,
                time=time,
            )
        )

    def rotate(self, broker: str, epoch: int | None = None) -> None:
        """Close the broker's current segment and start the next one."""
        segments = self.segments[broker]
        seq = segments[-1].seq + 1 if segments else 1
        if epoch is None:
            epoch = segments[-1].epoch
        segments.append(_Segment(epoch, seq))

    def write(self, root: Path, *, upto: dict[str, int] | None = None) -> dict[str, Path]:
        """Write closed segments (those with seq <= upto[broker], default all) as JSON lines.

        Returns each broker's audit directory.
        """
        dirs = {}
        for broker, segments in self.segments.items():
            directory = root / broker / "audit"
            directory.mkdir(parents=True, exist_ok=True)
            dirs[broker] = directory
            for seg in segments:
                if upto is not None and seg.seq > upto.get(broker, 0):
                    continue
                path = directory / f"{broker}-e{seg.epoch:06d}-{seg.seq:08d}.jsonl"
                if not path.exists():
                    path.write_text("".join(r.model_dump_json() + "\n" for r in seg.records))
        return dirs

    def count(self) -> int:
        """Records in all segments."""
        return sum(len(s.records) for segs in self.segments.values() for s in segs)
