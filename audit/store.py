"""The audit store: where brokers ship closed audit segments and the audit job keeps its state.

A store is named by a URL: a filesystem path (`/var/lib/twinmq-audit`,
`file:///shared/audit`; the embedded default and a shared volume) or an
S3-compatible bucket and prefix (`s3://bucket/prefix`, through fsspec/s3fs;
the endpoint comes from `AWS_ENDPOINT_URL` or `storage_options`).

Layout under the root:

    segments/<broker>/<broker>-e<epoch:06d>-<seq:08d>.parquet   shipped segments
    audit/manifest.json                                          the job's watermark
    audit/state/<run>/...                                        the job's state
    audit/runs/<run>/summary.json, findings.parquet, lag.parquet  each run's results
    audit/latest.json                                            the last run's summary

A segment's name carries its broker, epoch and sequence number, which a
broker never reuses: two brokers and many epochs never collide. A shipped
segment is written once and never replaced.

Atomicity. On a filesystem an object is written to a hidden temporary name
in the same directory, fsynced and renamed over its final name (`rename(2)`
is atomic). S3 has no rename, and needs none: a PUT (or a multipart upload,
on completion) makes an object visible whole or not at all, so objects are
written straight to their final keys; an interrupted multipart upload stays
invisible (a bucket lifecycle rule aborts it). Readers ignore names starting
with `.`. Directories of many files (the job's state) are committed by the
manifest, written last: whatever a crashed run left behind is never
referenced, so never read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import logging
import os
import re
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from twinmq.audit.records import AuditEvent, SegmentFormatError, segment_columns
from twinmq.audit.schema import arrow_schema, record_arrow_schema
from twinmq.broker.atomicfile import replace_file, sync_dir

log = logging.getLogger(__name__)

SEGMENTS = "segments"
SOURCE_DIGEST_KEY = b"twinmq.source.blake2b"
"""Parquet key-value metadata: BLAKE2b-128 of the JSON-lines segment it was made from."""

_LOCAL_NAME = re.compile(r"^(?P<broker>.+)-e(?P<epoch>\d+)-(?P<seq>\d+)\.jsonl$")
_STORED_NAME = re.compile(r"^(?P<broker>.+)-e(?P<epoch>\d+)-(?P<seq>\d+)\.parquet$")


class ShipError(RuntimeError):
    """A segment cannot be shipped (unreadable, or its name is taken by other content)."""


@dataclasses.dataclass(frozen=True, order=True)
class SegmentName:
    """A segment's identity: broker, epoch and the broker's sequence number."""

    broker: str
    seq: int
    epoch: int

    @property
    def stem(self) -> str:
        """`<broker>-e<epoch>-<seq>`, as the broker names it."""
        return f"{self.broker}-e{self.epoch:06d}-{self.seq:08d}"

    @property
    def key(self) -> str:
        """Its path in the store."""
        return f"{SEGMENTS}/{self.broker}/{self.stem}.parquet"

    @classmethod
    def parse_local(cls, name: str) -> SegmentName | None:
        """The identity of a closed broker segment file name, None for anything else."""
        m = _LOCAL_NAME.match(name)
        return cls(m["broker"], int(m["seq"]), int(m["epoch"])) if m else None

    @classmethod
    def parse_stored(cls, name: str) -> SegmentName | None:
        """The identity of a shipped segment's file name, None for anything else."""
        m = _STORED_NAME.match(name)
        return cls(m["broker"], int(m["seq"]), int(m["epoch"])) if m else None


class Store:
    """A URL-addressed audit store (filesystem path or S3 prefix) through fsspec."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        import fsspec

        self.url = url.rstrip("/")
        options = dict(storage_options or {})
        if url.startswith("s3://"):
            self.scheme = "s3"
            endpoint = os.environ.get("AWS_ENDPOINT_URL")
            if endpoint and "endpoint_url" not in options:
                options.setdefault("client_kwargs", {}).setdefault("endpoint_url", endpoint)
            options.setdefault("use_listings_cache", False)  # other processes write too
            self.fs = fsspec.filesystem("s3", **options)
            self.root = self.url[len("s3://") :]
        elif url.startswith("file://") or "://" not in url:
            self.scheme = "file"
            self.fs = fsspec.filesystem("file")
            self.root = str(Path(url.removeprefix("file://")).absolute())
        else:
            raise ValueError(f"unsupported audit store URL {url!r} (a path, file:// or s3://)")
        self.storage_options = options

    @property
    def location(self) -> str:
        """The store's identity in a ledger: `file:///abs/path` or `s3://bucket/prefix` (one
        store named two ways, a relative and an absolute path, is one location)."""
        return f"{self.scheme}://{self.root}"

    @property
    def is_local(self) -> bool:
        """A filesystem store (the job's Spark can read and write it directly)."""
        return self.scheme == "file"

    def path(self, key: str) -> str:
        """The fsspec path of a key."""
        return f"{self.root}/{key}" if key else self.root

    def spark_uri(self, key: str) -> str:
        """The URI Spark (Hadoop) uses for a key: `file://...` or `s3a://...`."""
        if self.is_local:
            return "file://" + self.path(key)
        return "s3a://" + self.path(key)

    def exists(self, key: str) -> bool:
        """Whether an object exists."""
        return bool(self.fs.exists(self.path(key)))

    def read_bytes(self, key: str) -> bytes:
        """An object's content."""
        data: bytes = self.fs.cat_file(self.path(key))
        return data

    def read_json(self, key: str) -> Any:
        """An object's JSON content, None if it does not exist."""
        try:
            return json.loads(self.read_bytes(key))
        except FileNotFoundError:
            return None

    def write_bytes(self, key: str, data: bytes) -> None:
        """Write an object atomically: readers see all of it or none of it."""
        if self.is_local:
            final = Path(self.path(key))
            final.parent.mkdir(parents=True, exist_ok=True)
            tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex}"
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, final)
            finally:
                tmp.unlink(missing_ok=True)
            sync_dir(final.parent)
        else:
            self.fs.pipe_file(self.path(key), data)

    def write_json(self, key: str, value: Any) -> None:
        """Write an object of JSON atomically."""
        self.write_bytes(key, json.dumps(value, indent=1, sort_keys=True).encode())

    def keys(self, prefix: str) -> list[str]:
        """Keys of every visible object under a prefix (hidden `.` names left out)."""
        base = self.path(prefix).rstrip("/")
        try:
            found = self.fs.find(base)
        except FileNotFoundError:
            return []
        root = self.root.rstrip("/") + "/"
        out = []
        for p in found:
            p = str(p)
            p = p.split("://", 1)[-1] if "://" in p else p
            if not p.startswith(root):
                continue
            key = p[len(root) :]
            if any(part.startswith(".") for part in key.split("/")):
                continue
            out.append(key)
        return sorted(out)

    def segments(self) -> list[SegmentName]:
        """Every shipped segment, by broker and sequence number."""
        names = (SegmentName.parse_stored(k.rsplit("/", 1)[-1]) for k in self.keys(SEGMENTS))
        return sorted(n for n in names if n is not None)

    def delete_prefix(self, prefix: str) -> None:
        """Remove every object under a prefix (the job's garbage collection)."""
        path = self.path(prefix)
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)

    def get_dir(self, key: str, local: Path) -> None:
        """Copy an object, or a directory of objects, to a local path."""
        base = self.path(key).rstrip("/")
        for remote in self.fs.find(base):
            remote = str(remote).split("://", 1)[-1]
            rel = remote[len(base) :].lstrip("/")
            target = local / rel if rel else local
            target.parent.mkdir(parents=True, exist_ok=True)
            self.fs.get_file(remote, str(target))

    def children(self, prefix: str) -> list[str]:
        """Names directly under a prefix (folders and objects)."""
        try:
            entries = self.fs.ls(self.path(prefix), detail=False)
        except FileNotFoundError:
            return []
        return sorted(str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries)

    def put_dir(self, local: Path, key: str) -> None:
        """Copy a local directory's visible files under a key (each object atomically)."""
        for path in sorted(local.rglob("*")):
            rel = path.relative_to(local)
            if path.is_file() and not any(p.startswith((".", "_")) for p in rel.parts):
                self.write_bytes(f"{key}/{rel.as_posix()}", path.read_bytes())


# -- the shipper --------------------------------------------------------------------------


def segment_to_parquet(name: SegmentName, data: bytes) -> bytes:
    """A broker's JSON-lines segment as Parquet, with provenance columns and source digest."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    record_schema = record_arrow_schema()
    try:
        # Either line format (one record, or a batch's records), expanded in log order.
        table = pa.Table.from_pydict(segment_columns(data), schema=record_schema)
    except (SegmentFormatError, pa.ArrowException, TypeError) as exc:
        raise ShipError(f"segment {name.stem} is not valid audit JSON lines: {exc}") from exc
    table = table.cast(record_schema)
    events = set(table.column("event").unique().to_pylist())
    unknown = events - {e.value for e in AuditEvent}
    if unknown or table.column("broker").null_count or table.column("event").null_count:
        raise ShipError(f"segment {name.stem} has unknown events or missing fields: {unknown}")
    brokers = set(table.column("broker").unique().to_pylist())
    if brokers - {name.broker}:
        raise ShipError(f"segment {name.stem} holds records of other brokers: {brokers}")
    n = table.num_rows
    table = table.append_column("segment_seq", pa.array([name.seq] * n, pa.int64()))
    table = table.append_column("line", pa.array(range(n), pa.int64()))
    digest = hashlib.blake2b(data, digest_size=16).hexdigest().encode()
    schema = arrow_schema().with_metadata({SOURCE_DIGEST_KEY: digest})
    table = table.cast(schema)
    out = io.BytesIO()
    pq.write_table(table, out, compression="zstd")
    return out.getvalue()


def stored_source_digest(store: Store, name: SegmentName) -> str | None:
    """The source digest recorded in a shipped segment's footer."""
    import pyarrow.parquet as pq

    with store.fs.open(store.path(name.key), "rb") as f:
        meta = pq.read_metadata(f).metadata or {}
    value = meta.get(SOURCE_DIGEST_KEY)
    return value.decode() if value is not None else None


@dataclasses.dataclass
class ShipReport:
    """What one shipping pass did."""

    shipped: list[str] = dataclasses.field(default_factory=list)
    already: list[str] = dataclasses.field(default_factory=list)
    skipped: list[str] = dataclasses.field(default_factory=list)  # open or foreign files
    deleted: list[str] = dataclasses.field(default_factory=list)  # shipped, past retention
    # in the ledger, not in the store (emptied, replaced): kept, and shipped again
    missing: list[str] = dataclasses.field(default_factory=list)


LEDGER = ".shipped"
"""File in the broker's audit directory listing the segments already shipped: one line per
segment and store, `<segment> <store location>`. (Lines of a bare segment name, written
before the store was recorded, name no store: such a segment is checked in the store.)"""


def read_ledger(path: Path, store: Store) -> set[str]:
    """The segments the ledger says were shipped to `store`."""
    if not path.exists():
        return set()
    shipped = set()
    for line in path.read_text().splitlines():
        stem, _, location = line.partition(" ")
        if location == store.location:
            shipped.add(stem)
    return shipped


def closed_segments(audit_dir: Path) -> Iterator[tuple[SegmentName, Path]]:
    """A broker's closed segments (`.jsonl`; never `.open`), in sequence order."""
    found = []
    for path in audit_dir.glob("*.jsonl"):
        name = SegmentName.parse_local(path.name)
        if name is not None:
            found.append((name, path))
    yield from sorted(found)


def ship(audit_dir: Path, store: Store, *, broker: str | None = None) -> ShipReport:
    """Ship a broker's closed segments to the store, oldest first; safe to repeat.

    Each segment is converted to Parquet and written once, atomically. The
    ledger (`<audit_dir>/.shipped`, per store: shipping the same directory to a
    second store ships everything there too) saves looking at the store again
    for segments already shipped. A segment that is in the store but not in the
    ledger (a crash between upload and ledger) is checked by content digest
    and recorded. A name already taken by different content (a broker whose
    data directory was wiped, reusing sequence numbers) is an error: shipping
    stops there rather than replace what the audit may have read, or skip
    past it (segments of a broker are shipped in order).
    """
    report = ShipReport()
    ledger_path = audit_dir / LEDGER
    ledger = read_ledger(ledger_path, store)
    for name, path in closed_segments(audit_dir):
        if broker is not None and name.broker != broker:
            report.skipped.append(path.name)
            continue
        if name.stem in ledger:
            report.already.append(name.stem)
            continue
        data = path.read_bytes()
        if store.exists(name.key):
            digest = hashlib.blake2b(data, digest_size=16).hexdigest()
            if stored_source_digest(store, name) != digest:
                raise ShipError(
                    f"{name.key} exists in the store with other content: was the broker's "
                    "data directory reset? (move its old audit segments away first)"
                )
            report.already.append(name.stem)
        else:
            store.write_bytes(name.key, segment_to_parquet(name, data))
            report.shipped.append(name.stem)
            log.info("shipped %s", name.key)
        with open(ledger_path, "a") as f:
            f.write(f"{name.stem} {store.location}\n")
        ledger.add(name.stem)
    return report


def prune_shipped(
    audit_dir: Path, store: Store, keep_seconds: float, report: ShipReport, now: float
) -> None:
    """Delete the local segments shipped to `store` more than `keep_seconds` ago (by the
    time they were closed), so a broker's audit directory does not grow without bound.

    A segment not in the ledger for this store is never deleted (an audit needs it, and
    only shipping puts it there). Each broker's newest segment is always kept: a
    broker numbers its next segment after the highest it finds in the directory
    (`AuditLog`), and a number used again would collide with a shipped segment. The
    ledger is then rewritten without the lines of segments no longer here.

    The ledger is not trusted alone: a segment is deleted only once the store is seen to
    hold it, with this content (its source digest). A store emptied or replaced at the
    same location (a bucket re-created, another endpoint) would otherwise lose the only
    copy; such a segment's ledger line is dropped instead, so the next pass ships it
    again (`ShipReport.missing`).
    """
    shipped = read_ledger(audit_dir / LEDGER, store)
    segments = list(closed_segments(audit_dir))
    newest: dict[str, int] = {}
    for name, _path in segments:
        newest[name.broker] = max(newest.get(name.broker, 0), name.seq)
    for name, path in segments:
        if name.stem not in shipped or name.seq == newest[name.broker]:
            continue
        with contextlib.suppress(FileNotFoundError):
            if now - path.stat().st_mtime < keep_seconds:
                continue
            if not _store_holds(store, name, path):
                log.warning("%s: in the ledger but not in %s (or other content there): "
                            "kept, and shipped again", name.stem, store.location)  # fmt: skip
                report.missing.append(name.stem)
                continue
            path.unlink()
            report.deleted.append(name.stem)
    if not report.deleted and not report.missing:
        return
    sync_dir(audit_dir)
    ledger_path = audit_dir / LEDGER
    present = {name.stem for name, _path in closed_segments(audit_dir)}
    missing = {f"{stem} {store.location}" for stem in report.missing}
    kept = [
        line
        for line in ledger_path.read_text().splitlines()
        if line.partition(" ")[0] in present and line not in missing
    ]
    replace_file(ledger_path, "".join(f"{line}\n" for line in kept).encode())
    log.info("deleted %d shipped segments older than %ss", len(report.deleted), keep_seconds)


def _store_holds(store: Store, name: SegmentName, path: Path) -> bool:
    """Whether the store holds this local segment (its name, with this content)."""
    if not store.exists(name.key):
        return False
    try:
        stored = stored_source_digest(store, name)
    except FileNotFoundError:
        return False
    return stored == hashlib.blake2b(path.read_bytes(), digest_size=16).hexdigest()
