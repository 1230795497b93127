"""The audit log's record: one shared definition for the brokers and the Spark audit.

Brokers write JSON lines in rotated segment files under `<data-dir>/audit/`; the
Spark schema is derived from `AuditRecord` (never written out by hand). A line is
either one `AuditRecord` (format 1, still read) or, as brokers write since format
2, an `AuditBatch`: the records of one group commit for one queue and event, the
per-message fields as lists (one line per batch instead of one per message keeps
the broker's cost per message small). Format 3 packs those lists further (the
replication ids as runs of consecutive ids, the digests as one hex string).
Format 4 adds `origin` to the lines a DR mirror writes for what it applied.
Format 5 adds, on the stored lines a bidirectional site applied, the messages'
own origin and their ids there (`message_origin`, `origin_id_runs`/`origin_ids`):
with ids mapped per origin the applying site's replication id is its own.
Format 6 names the vhost of a queue of another vhost than `/` (`vhost`; `queue` is the
queue's own name): before it, such a queue was written `<name> (vhost <vhost>)`, which
a `/` queue of that literal name would also write. A line without `vhost` is of `/`,
unless its queue name has that old shape: then it is read as the old writer meant it
(a format 6 writer gives such a `/` queue `"vhost": "/"`, so it cannot be taken for
another vhost's). `segment_columns` reads every format into records.

The audit job tells queues apart by one string (`queue_key`): the queue's name for `/`,
and for another vhost (or a `/` name beginning with NUL) NUL followed by the JSON list
of vhost and name, which no `/` queue's key can be; `split_queue_key` reverses it.
"""

from __future__ import annotations

import enum
import json
import re
import zlib
from typing import Any

from pydantic import BaseModel, Field


class AuditEvent(enum.StrEnum):
    """What happened to a message on the broker that wrote the record."""

    CONFIRMED = "confirmed"  # active: on its disk and acknowledged by the in-sync passive
    CONFIRMED_ALONE = "confirmed-alone"  # active, degraded: on its own disk only
    REPLICATED = "replicated"  # passive: on its disk
    DEQUEUED = "dequeued"  # acknowledged, expired, dropped or discarded: settled for good


class AuditRecord(BaseModel):
    """One replication event."""

    broker: str = Field(description="Name of the broker that wrote the record")
    epoch: int = Field(description="The broker's epoch when it wrote the record")
    queue: str = Field(description="Queue name")
    replication_id: int = Field(description="The message's replication ID (same on both brokers)")
    message_id: str | None = Field(description="The publisher's message-id property, if set")
    digest: str = Field(
        description="Body digest: CRC-32, 8 hex digits (BLAKE2b-64, 16 hex digits, in "
        "format 1); '' for dequeue events"
    )
    event: AuditEvent
    time: float = Field(description="Unix time in seconds")
    origin: str | None = Field(
        None,
        description="On a DR mirror: the mirror id of the site whose event this record "
        "applies (the message keeps its queue and replication id there); None for what "
        "clients did on this site, and in logs written before format 4",
    )
    message_origin: str | None = Field(
        None,
        description="Bidirectional mirror (format 5), on a stored copy applied from another "
        "site: the mirror id of the site where a client published the message (not always "
        "`origin`, the link's neighbour); None otherwise",
    )
    origin_id: int | None = Field(
        None,
        description="With `message_origin`: the message's replication id at that site (this "
        "site's `replication_id` is its own, ids being mapped per origin)",
    )
    vhost: str | None = Field(
        None,
        description="The queue's vhost (format 6); None for `/` (and `/` in logs before "
        "format 6, whose other vhosts' queues are read from their `<name> (vhost <vhost>)`)",
    )


class AuditBatch(BaseModel):
    """One line of a segment (formats 2 and 3): the records of one batch, queue and event.

    The replication ids are either listed (`replication_ids`, format 2, and format 3
    when they are not consecutive) or given as runs (`replication_id_runs`: `[first,
    count]` pairs, `[[7, 3]]` being 7, 8, 9). The digests, one per replication id and
    in order, are either listed (`digests`, format 2) or concatenated (`digests_hex`,
    format 3: 8 hex digits each); `message_ids` is listed, and left out when no
    message of the line has one. Digests and message ids are absent for `dequeued`
    (no message id, digest ''). `origin` (format 4) marks a line a DR mirror applied
    from another site's events (every record of the line).
    """

    broker: str
    epoch: int
    queue: str
    event: AuditEvent
    time: float
    replication_ids: list[int] | None = None
    replication_id_runs: list[tuple[int, int]] | None = None
    message_ids: list[str | None] | None = None
    digests: list[str] | None = None
    digests_hex: str | None = None
    origin: str | None = None
    message_origin: str | None = None
    origin_ids: list[int] | None = None
    origin_id_runs: list[tuple[int, int]] | None = None
    vhost: str | None = None  # format 6: the queue's vhost (left out for `/`)


DEFAULT_VHOST = "/"
# How writers before format 6 named a queue of another vhost (broker/server.py then).
_LEGACY_QUALIFIED = re.compile(r"(?s)(.*) \(vhost (.+)\)")


def legacy_qualified(queue: str) -> tuple[str, str] | None:
    """(name, vhost) of a queue name of the shape writers before format 6 gave a queue
    of another vhost (`<name> (vhost <vhost>)`), else None."""
    match = _LEGACY_QUALIFIED.fullmatch(queue)
    return None if match is None else (match.group(1), match.group(2))


def line_vhost(queue: str, vhost: str) -> str | None:
    """The `vhost` member a format 6 line gives a queue: None (left out) for a `/` queue
    whose name a reader cannot take for an old writer's name of another vhost's queue."""
    if vhost == DEFAULT_VHOST and legacy_qualified(queue) is None:
        return None
    return vhost


def read_queue(queue: str, vhost: str | None) -> tuple[str, str | None]:
    """A line's (queue, vhost) as records hold them (vhost None: `/`)."""
    if vhost is None:
        legacy = legacy_qualified(queue)
        if legacy is not None:
            return legacy
        return queue, None
    return queue, None if vhost == DEFAULT_VHOST else vhost


QUEUE_KEY_MARK = "\x00"


def queue_key(queue: str, vhost: str | None) -> str:
    """The one string that names a queue of a vhost in the audit job (module doc)."""
    if (vhost is None or vhost == DEFAULT_VHOST) and not queue.startswith(QUEUE_KEY_MARK):
        return queue
    return QUEUE_KEY_MARK + json.dumps([vhost or DEFAULT_VHOST, queue])


def split_queue_key(key: str) -> tuple[str, str]:
    """(vhost, queue) of a `queue_key`."""
    if not key.startswith(QUEUE_KEY_MARK):
        return DEFAULT_VHOST, key
    vhost, queue = json.loads(key[len(QUEUE_KEY_MARK) :])
    return vhost, queue


AUDIT_FIELDS: tuple[str, ...] = tuple(AuditRecord.model_fields)
BATCH_FIELDS: tuple[str, ...] = tuple(AuditBatch.model_fields)
_DIGEST_HEX = 8  # hex digits of one digest in `digests_hex`


def body_digest(body: bytes) -> str:
    """The digest a broker records for a body (CRC-32, as the journal's records use)."""
    return "%08x" % zlib.crc32(body)  # noqa: UP031 (the writer maps this format in C)


class SegmentFormatError(ValueError):
    """A segment line that is neither an `AuditRecord` nor an `AuditBatch`."""


def segment_columns(data: bytes) -> dict[str, list[Any]]:
    """The records of a segment's JSON lines (any format, mixed), as columns by field.

    Records keep the order of the log: a batch's records in list order, where its
    line stands. Types are checked by whoever builds the table (`AuditRecord`,
    Arrow); the shapes (known fields, equal list lengths) here.
    """
    cols: dict[str, list[Any]] = {name: [] for name in AUDIT_FIELDS}
    record_fields = set(AUDIT_FIELDS)
    batch_fields = set(BATCH_FIELDS)
    for number, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise SegmentFormatError(f"line {number}: not JSON: {exc}") from exc
        if not isinstance(obj, dict):
            raise SegmentFormatError(f"line {number}: not an object")
        if "replication_ids" not in obj and "replication_id_runs" not in obj:  # format 1
            if not obj.keys() <= record_fields:
                unknown = obj.keys() - record_fields
                raise SegmentFormatError(f"line {number}: unknown fields {unknown}")
            for name in AUDIT_FIELDS:
                cols[name].append(obj.get(name))
            _read_queue_of_last(cols)
            continue
        if not obj.keys() <= batch_fields:
            raise SegmentFormatError(f"line {number}: unknown fields {obj.keys() - batch_fields}")
        try:
            ids = _replication_ids(obj)
            cols["origin_id"] += _origin_ids(obj, len(ids))
            cols["message_id"] += _per_record(obj.get("message_ids"), len(ids), None, "message_ids")
            cols["digest"] += _per_record(_digests(obj), len(ids), "", "digests")
        except (TypeError, ValueError) as exc:
            raise SegmentFormatError(f"line {number}: {exc}") from exc
        cols["replication_id"] += ids
        n = len(ids)
        for name in ("broker", "epoch", "event", "time", "origin", "message_origin"):
            cols[name] += [obj.get(name)] * n
        queue, vhost = obj.get("queue"), obj.get("vhost")
        if isinstance(queue, str) and (vhost is None or isinstance(vhost, str)):
            queue, vhost = read_queue(queue, vhost)
        cols["queue"] += [queue] * n
        cols["vhost"] += [vhost] * n
    return cols


def _read_queue_of_last(cols: dict[str, list[Any]]) -> None:
    """A format 1 record's queue and vhost, read as a batch line's are."""
    queue, vhost = cols["queue"][-1], cols["vhost"][-1]
    if isinstance(queue, str) and (vhost is None or isinstance(vhost, str)):
        cols["queue"][-1], cols["vhost"][-1] = read_queue(queue, vhost)


def _replication_ids(obj: dict[str, Any], name: str = "replication_ids") -> list[Any]:
    """A batch line's replication ids, listed or as runs (exactly one of the two)."""
    listed, runs = obj.get(name), obj.get(name[:-1] + "_runs")
    if (listed is None) == (runs is None):
        raise ValueError(f"needs exactly one of {name} and {name[:-1]}_runs")
    if listed is not None:
        if not isinstance(listed, list):
            raise TypeError(f"{name} is not a list")
        return listed
    if not isinstance(runs, list):
        raise TypeError(f"{name[:-1]}_runs is not a list")
    ids: list[Any] = []
    for run in runs:
        if (
            not (isinstance(run, list) and len(run) == 2 and all(type(v) is int for v in run))
            or run[1] < 1
        ):
            raise ValueError(f"{name[:-1]}_runs: {run!r} is not a [first, count] pair")
        ids += range(run[0], run[0] + run[1])
    return ids


def _origin_ids(obj: dict[str, Any], n: int) -> list[Any]:
    """A line's ids at the messages' origin (format 5), one per record; None each if absent."""
    if obj.get("origin_ids") is None and obj.get("origin_id_runs") is None:
        return [None] * n
    if obj.get("message_origin") is None:
        raise ValueError("origin ids without message_origin")
    ids = _replication_ids(obj, "origin_ids")
    if len(ids) != n:
        raise ValueError("origin ids do not match replication_ids")
    return ids


def _digests(obj: dict[str, Any]) -> list[Any] | None:
    """A batch line's digests, listed or concatenated (at most one of the two)."""
    listed, packed = obj.get("digests"), obj.get("digests_hex")
    if packed is None:
        return listed
    if listed is not None:
        raise ValueError("has both digests and digests_hex")
    if not isinstance(packed, str) or len(packed) % _DIGEST_HEX:
        raise ValueError(f"digests_hex is not {_DIGEST_HEX} hex digits per digest")
    return [packed[i : i + _DIGEST_HEX] for i in range(0, len(packed), _DIGEST_HEX)]


def _per_record(values: Any, n: int, absent: Any, name: str) -> list[Any]:
    """One value per replication id: `values` checked, or `absent` for each if None."""
    if values is None:  # dequeued: none of either; stored: digests not recorded
        return [absent] * n
    if not isinstance(values, list) or len(values) != n:
        raise ValueError(f"{name} does not match replication_ids")
    return values


def segment_records(data: bytes) -> list[AuditRecord]:
    """The records of a segment's JSON lines (any format), validated."""
    cols = segment_columns(data)
    return [
        AuditRecord.model_validate(dict(zip(AUDIT_FIELDS, values, strict=True)))
        for values in zip(*cols.values(), strict=True)
    ]
