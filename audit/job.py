"""The replication audit job: extract from the store, transform (transforms.py), load results.

`run_audit(spark, store, params)` is one run. It reads only the segments the
watermark (`audit/manifest.json`) has not seen, folds them into the stored
state, and writes the results; a run from an empty manifest (`full=True`) reads
everything. Both go through the same code, and the state is built from
associative merges, so an incremental run gives the result of a full re-run
(tests/test_audit_incremental.py).

State, per block of replication ids (`rid >> block_bits`), rewritten only for
the blocks this run's events touch:
    messages  per replication id aggregates (transforms.AGGREGATE_SCHEMA)
    findings  single-message findings (unreplicated, replicated twice, digest)
    lag       lag histogram rows (queue, time bucket, bin)
    counts    per queue counts
and global, small: streams (reorder state), resends, reorders, and the epoch
statistics (in the manifest itself). The manifest maps each block to the run
directory holding its current version; it is written last, so a crashed run
leaves nothing that a later run would read.

A segment of a broker older than one already audited (shipped late) makes the
run a full one: the reorder state assumes each broker's log is read in order.
"""

from __future__ import annotations

import dataclasses
import io as io_
import itertools
import json
import logging
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import StringType, StructField, StructType

from twinmq.audit import transforms as T
from twinmq.audit.records import queue_key, split_queue_key
from twinmq.audit.schema import spark_schema
from twinmq.audit.store import SegmentName, Store
from twinmq.audit.summary import (
    AuditSummary,
    Counts,
    EpochSummary,
    Failover,
    FindingKind,
    LagBucket,
    LagStats,
    QueueSummary,
    lag_stats,
    verdict_of,
)

log = logging.getLogger(__name__)

MANIFEST = "audit/manifest.json"
LATEST = "audit/latest.json"
# 4: digest keys tell CRC-32 and BLAKE2b digests apart (state of format 3 is recomputed).
FORMAT = 4


class AuditError(RuntimeError):
    """The audit cannot run (bad store content, more than two brokers, ...)."""


@dataclasses.dataclass(frozen=True)
class AuditParams:
    """What the results depend on besides the data (a change makes the next run full)."""

    block_bits: int = 16
    bucket_seconds: float = 60.0
    stream_pattern: str = T.DEFAULT_STREAM_PATTERN

    def fingerprint(self) -> dict[str, Any]:
        """The parameters as stored in the manifest."""
        return dataclasses.asdict(self)


def build_session(
    master: str | None = None,
    app_name: str = "twinmq-replication-audit",
    conf: Mapping[str, str] | None = None,
) -> SparkSession:
    """The one place a SparkSession is built (spark-submit's master wins when not given)."""
    builder = SparkSession.builder.appName(app_name)
    if master:
        builder = builder.master(master)
    defaults = {
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.session.timeZone": "UTC",
        # State is written partitioned by block: concurrent writers instead of a sort.
        "spark.sql.maxConcurrentOutputFileWriters": "64",
    }
    endpoint = os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:  # an S3-compatible store read through s3a (when on the classpath)
        defaults["spark.hadoop.fs.s3a.endpoint"] = endpoint
        defaults["spark.hadoop.fs.s3a.path.style.access"] = "true"
    # Python workers (the reorder check) run this interpreter unless told otherwise.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    for key, value in {**defaults, **(conf or {})}.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    return spark


# -- store I/O for Spark -------------------------------------------------------------------


class SparkIO:
    """Spark paths for store keys.

    A filesystem store (and an S3 store when the s3a connector is on Spark's
    classpath) is read and written by Spark directly. Otherwise (S3 in local
    mode without the connector) the keys a run reads are copied to a local
    work directory, and what it writes is uploaded from there.
    """

    def __init__(self, spark: SparkSession, store: Store, work_dir: Path | None = None) -> None:
        self.store = store
        self.native = store.is_local or _has_s3a(spark)
        self._own_work = work_dir is None
        self.work = work_dir or Path(tempfile.mkdtemp(prefix="twinmq-audit-"))
        self._written: list[str] = []

    def read(self, key: str) -> str:
        """A Spark path to read a key (a file or a directory)."""
        if self.native:
            return self.store.spark_uri(key)
        local = self.work / "in" / key
        if not local.exists():
            self.store.get_dir(key, local)
        return "file://" + str(local)

    def write(self, key: str) -> str:
        """A Spark path to write a key's directory to (published by `flush`)."""
        if self.native:
            return self.store.spark_uri(key)
        self._written.append(key)
        return "file://" + str(self.work / "out" / key)

    def flush(self) -> None:
        """Upload what was written locally (mirror mode)."""
        for key in self._written:
            self.store.put_dir(self.work / "out" / key, key)
        self._written.clear()

    def close(self) -> None:
        """Remove the work directory if it is ours."""
        if self._own_work:
            shutil.rmtree(self.work, ignore_errors=True)


def _has_s3a(spark: SparkSession) -> bool:
    jvm = spark.sparkContext._jvm
    try:
        jvm.java.lang.Class.forName("org.apache.hadoop.fs.s3a.S3AFileSystem")  # type: ignore[union-attr]
        return True
    except Exception:
        return False


def _read(spark: SparkSession, paths: list[str], schema: StructType) -> DataFrame:
    """Parquet files or directories, or an empty frame when there are none."""
    if not paths:
        return spark.createDataFrame([], schema)
    return spark.read.schema(schema).parquet(*paths)


# -- the manifest (watermark) --------------------------------------------------------------


@dataclasses.dataclass
class Manifest:
    """What has been audited, and where the current state lives."""

    params: dict[str, Any]
    brokers: list[str] = dataclasses.field(default_factory=list)
    segments: list[str] = dataclasses.field(default_factory=list)  # stems
    max_seq: dict[str, int] = dataclasses.field(default_factory=dict)
    blocks: dict[str, str] = dataclasses.field(default_factory=dict)  # block -> run id
    globals_run: str | None = None
    epochs: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    runs: list[str] = dataclasses.field(default_factory=list)

    @classmethod
    def load(cls, store: Store) -> Manifest | None:
        """The store's manifest, None if there is none."""
        data = store.read_json(MANIFEST)
        if data is None:
            return None
        if data.get("format") != FORMAT:
            log.warning("manifest format %s is not %s: full run", data.get("format"), FORMAT)
            return None
        data.pop("format")
        return cls(**data)

    def dump(self) -> dict[str, Any]:
        """JSON for the store."""
        return {"format": FORMAT, **dataclasses.asdict(self)}


# -- one run -------------------------------------------------------------------------------


def _state(run: str, table: str, block: str | None = None) -> str:
    key = f"audit/state/{run}/{table}"
    return f"{key}/block={block}" if block is not None else key


def _block_paths(
    io: SparkIO, blocks: Mapping[str, str], table: str, only: Iterable[str] | None = None
) -> list[str]:
    """Spark paths of a per-block table's versions named by `blocks` (those with rows)."""
    wanted = set(blocks) if only is None else set(only) & set(blocks)
    by_run: dict[str, set[str]] = defaultdict(set)
    for block in wanted:
        by_run[blocks[block]].add(block)
    paths = []
    for run, run_blocks in sorted(by_run.items()):
        prefix = _state(run, table)
        present = {
            key[len(prefix) + 1 :].split("/", 1)[0].removeprefix("block=")
            for key in io.store.keys(prefix)
            if key.endswith(".parquet")
        }
        paths += [io.read(_state(run, table, b)) for b in sorted(run_blocks & present)]
    return paths


def _global_path(io: SparkIO, run: str | None, table: str) -> list[str]:
    """The Spark path of a global table of a run, if it has any rows."""
    if run is None:
        return []
    key = _state(run, table)
    return [io.read(key)] if any(k.endswith(".parquet") for k in io.store.keys(key)) else []


def _new_run_id() -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + uuid.uuid4().hex[:6]


def plan_segments(
    segments: list[SegmentName], manifest: Manifest | None, params: AuditParams
) -> tuple[bool, list[SegmentName]]:
    """(full, segments to read): full if there is no usable manifest or a segment came late."""
    if manifest is None or manifest.params != params.fingerprint():
        return True, segments
    seen = set(manifest.segments)
    new = [s for s in segments if s.stem not in seen]
    if any(s.seq <= manifest.max_seq.get(s.broker, -1) for s in new):
        log.warning("a segment older than ones already audited arrived: full run")
        return True, segments
    return False, new


def run_audit(
    spark: SparkSession,
    store: Store,
    params: AuditParams | None = None,
    *,
    full: bool = False,
    work_dir: Path | None = None,
    run_id: str | None = None,
) -> AuditSummary:
    """One audit run; returns the summary it wrote to the store (`audit/runs/<run_id>/`,
    a fresh id unless given: the operator names runs after their Job)."""
    params = params or AuditParams()
    started = time.monotonic()
    io = SparkIO(spark, store, work_dir)
    try:
        return _run(spark, io, params, full, started, run_id or _new_run_id())
    finally:
        io.close()


class _Clock:
    """Logs how long each phase of a run took (debug level)."""

    def __init__(self) -> None:
        self.last = time.monotonic()
        self.phases: dict[str, float] = {}

    def __call__(self, phase: str) -> None:
        now = time.monotonic()
        self.phases[phase] = round(now - self.last, 3)
        self.last = now
        log.debug("audit phase %s: %.2fs", phase, now - self.last)


def _write_by_block(frame: DataFrame, io: SparkIO, key: str, bits: int | None = None) -> None:
    if bits is not None:
        frame = frame.withColumn("block", T.block_of(F.col("replication_id"), bits))
    frame.write.partitionBy("block").parquet(io.write(key))


def _run(
    spark: SparkSession,
    io: SparkIO,
    params: AuditParams,
    force_full: bool,
    started: float,
    run: str,
) -> AuditSummary:
    store = io.store
    stored = Manifest.load(store)
    old = None if force_full else stored
    segments = store.segments()
    full, new_segments = plan_segments(segments, old, params)
    manifest = Manifest(params=params.fingerprint()) if full or old is None else old
    manifest.runs = stored.runs if stored is not None else []  # the history of results stays
    for name in sorted({s.broker for s in segments}):
        if name not in manifest.brokers:
            manifest.brokers.append(name)
    brokers = list(manifest.brokers)
    if len(brokers) > T.SLOTS:
        raise AuditError(f"a store holds the logs of one pair; found brokers {brokers}")
    bits = params.block_bits
    clock = _Clock()
    previous_globals = manifest.globals_run

    # Extract: the segments not audited yet.
    events = T.with_queue_keys(_read(spark, [io.read(s.key) for s in new_segments], spark_schema()))

    # Per replication id: fold the new events into the state blocks they touch.
    partial = T.message_aggregates(events, brokers).persist()
    touched = sorted(
        str(r[0])
        for r in partial.select(T.block_of(F.col("replication_id"), bits)).distinct().collect()
    )
    clock("aggregate")
    previous = _read(
        spark, _block_paths(io, manifest.blocks, "messages", touched), T.AGGREGATE_SCHEMA
    )
    merged = partial if full else T.merge_aggregates(previous.unionByName(partial))
    if touched:
        indexed = merged.withColumn("id_key", T.id_key())
        _write_by_block(indexed, io, _state(run, "messages"), bits)
        io.flush()
    clock("messages")
    current = _read(
        spark, [io.read(_state(run, "messages", b)) for b in touched], T.AGGREGATE_SCHEMA
    )
    classified = (
        T.classify_messages(current)
        .withColumn("block", T.block_of(F.col("replication_id"), bits))
        .persist()
    )
    if touched:
        _write_by_block(T.local_findings(classified, brokers), io, _state(run, "findings"), bits)
        _write_by_block(
            T.lag_histogram(classified, params.bucket_seconds, by=["block"]),
            io,
            _state(run, "lag"),
        )
        _write_by_block(T.queue_counts(classified, by=["block"]), io, _state(run, "counts"))
        io.flush()
    clock("block tables")
    classified.unpersist()
    previous_blocks = dict(manifest.blocks)
    manifest.blocks.update({b: run for b in touched})

    # Across messages: client re-sends (by message id) and reordering (by stream).
    if full:
        all_messages = T.classify_messages(
            _read(spark, _block_paths(io, manifest.blocks, "messages"), T.AGGREGATE_SCHEMA)
        )
        resends = T.find_resends(all_messages, brokers)
    else:
        keys = (
            partial.where(F.col("message_id").isNotNull()).select("queue", "message_id").distinct()
        )
        # The keys come from this run's new messages: few, so sent to every task. The
        # blocks holding any of them are found from the id_key column alone.
        new_keys = keys.select(T.id_key().alias("id_key")).distinct()
        index = _read(spark, _block_paths(io, manifest.blocks, "messages"), T.ID_INDEX_SCHEMA)
        holding = sorted(
            str(r[0])
            for r in index.join(F.broadcast(new_keys), "id_key", "left_semi")
            .select(T.block_of(F.col("replication_id"), bits))
            .distinct()
            .collect()
        )
        candidates = T.classify_messages(
            _read(spark, _block_paths(io, manifest.blocks, "messages", holding), T.AGGREGATE_SCHEMA)
        )
        fresh = T.find_resends(
            candidates.join(F.broadcast(keys), ["queue", "message_id"], "left_semi"), brokers
        )
        kept = _read(spark, _global_path(io, previous_globals, "resends"), T.FINDINGS_SCHEMA)
        resends = kept.join(keys, ["queue", "message_id"], "left_anti").unionByName(fresh)

    copies = T.stream_copies(current, params.stream_pattern)
    if full:
        stream_state = spark.createDataFrame([], T.STREAM_STATE_SCHEMA)
        earlier: DataFrame = spark.createDataFrame([], T.FINDINGS_SCHEMA)
    else:
        seen = T.stream_copies(
            _read(
                spark,
                _block_paths(io, previous_blocks, "messages", touched),
                T.AGGREGATE_SCHEMA,
            ),
            params.stream_pattern,
        ).select("replication_id", "slot")
        copies = copies.join(seen, ["replication_id", "slot"], "left_anti")
        stream_state = _read(
            spark, _global_path(io, previous_globals, "streams"), T.STREAM_STATE_SCHEMA
        )
        earlier = _read(spark, _global_path(io, previous_globals, "reorders"), T.FINDINGS_SCHEMA)
    found, streams = T.find_reorders(copies, stream_state, brokers)
    reorders = earlier.unionByName(found)
    for table, frame in (("resends", resends), ("reorders", reorders), ("streams", streams)):
        frame.write.parquet(io.write(_state(run, table)))
        clock(table)
    io.flush()
    manifest.globals_run = run
    run_epochs = _epoch_rows(T.epoch_stats(events))
    manifest.epochs = _merge_epochs(manifest.epochs, run_epochs)
    events_read = sum(e["records"] for e in run_epochs)
    partial.unpersist()

    # Results, then the commit: the manifest names the new state; then the latest summary.
    clock("epochs")
    summary = _summarize(spark, io, manifest, run, brokers, params, full)
    clock("summary")
    summary = summary.model_copy(
        update={
            "segments_read": len(new_segments),
            "segments_total": len(segments),
            "events_read": events_read,
            "seconds": round(time.monotonic() - started, 3),
        }
    )
    store.write_bytes(f"audit/runs/{run}/summary.json", summary.model_dump_json(indent=1).encode())
    manifest.segments = sorted({*manifest.segments, *(s.stem for s in new_segments)})
    for s in new_segments:
        manifest.max_seq[s.broker] = max(manifest.max_seq.get(s.broker, -1), s.seq)
    manifest.runs = [*manifest.runs, run][-KEEP_RUNS:]
    store.write_json(MANIFEST, manifest.dump())
    store.write_bytes(LATEST, summary.model_dump_json(indent=1).encode())
    _collect_garbage(store, manifest)
    clock("commit")
    log.info("audit run %s phases: %s", run, clock.phases)
    return summary


KEEP_RUNS = 50
"""Results of this many runs are kept in the store (audit/runs/)."""


def _epoch_rows(stats: DataFrame) -> list[dict[str, Any]]:
    return [r.asDict() for r in stats.collect()]


def _merge_epochs(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Fold this run's epoch statistics into the stored ones (in Python: a few rows)."""
    merged = {(e["epoch"], e["broker"]): dict(e) for e in old}
    for row in new:
        key = (row["epoch"], row["broker"])
        if key not in merged:
            merged[key] = row
            continue
        m = merged[key]
        m["records"] += row["records"]
        m["confirms"] += row["confirms"]
        for field, pick in (
            ("first_time", min), ("last_time", max), ("first_confirm", min), ("last_confirm", max),
        ):  # fmt: skip
            values = [v for v in (m[field], row[field]) if v is not None]
            m[field] = pick(values) if values else None
    return [merged[k] for k in sorted(merged)]


def _epochs_and_failovers(
    epochs: list[dict[str, Any]],
) -> tuple[list[EpochSummary], list[Failover]]:
    by_epoch: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for row in epochs:
        by_epoch[row["epoch"]].append(row)
    summaries = []
    for epoch in sorted(by_epoch):
        rows = by_epoch[epoch]
        firsts = [r["first_confirm"] for r in rows if r["first_confirm"] is not None]
        lasts = [r["last_confirm"] for r in rows if r["last_confirm"] is not None]
        summaries.append(
            EpochSummary(
                epoch=epoch,
                active=sorted(r["broker"] for r in rows if r["confirms"]),
                first_confirm=min(firsts) if firsts else None,
                last_confirm=max(lasts) if lasts else None,
                records=sum(r["records"] for r in rows),
            )
        )
    failovers = []
    for before, after in itertools.pairwise(summaries):
        gap = None
        if before.last_confirm is not None and after.first_confirm is not None:
            gap = round(after.first_confirm - before.last_confirm, 6)
        failovers.append(
            Failover(
                from_epoch=before.epoch,
                to_epoch=after.epoch,
                from_active=before.active,
                to_active=after.active,
                last_confirm_before=before.last_confirm,
                first_confirm_after=after.first_confirm,
                gap_seconds=gap,
            )
        )
    return summaries, failovers


def peer_last_epochs(brokers: list[str], epochs: list[dict[str, Any]]) -> dict[str, int]:
    """For each broker, the last epoch of the other broker's log (pairs only)."""
    last: dict[str, int] = {}
    for row in epochs:
        last[row["broker"]] = max(last.get(row["broker"], -1), row["epoch"])
    if len(brokers) != 2:
        return {}
    a, b = brokers
    return {name: last[peer] for name, peer in ((a, b), (b, a)) if peer in last}


# A run's findings as written: each queue's name and its vhost (the state keeps keys).
_WRITTEN_FINDINGS = StructType([*T.FINDINGS_SCHEMA.fields, StructField("vhost", StringType())])


def _summarize(
    spark: SparkSession,
    io: SparkIO,
    manifest: Manifest,
    run: str,
    brokers: list[str],
    params: AuditParams,
    full: bool,
) -> AuditSummary:
    store = io.store
    findings = T.classify_unreplicated(
        _read(spark, _block_paths(io, manifest.blocks, "findings"), T.FINDINGS_SCHEMA),
        peer_last_epochs(brokers, manifest.epochs),
    )
    for table in ("resends", "reorders"):
        findings = findings.unionByName(
            _read(spark, _global_path(io, run, table), T.FINDINGS_SCHEMA)
        )
    findings_key = f"audit/runs/{run}/findings.parquet"
    # Written with each queue's name and vhost (the state keeps queue keys).
    T.split_queue_keys(findings).coalesce(1).write.parquet(io.write(findings_key))
    io.flush()
    written = _read(spark, [io.read(findings_key)], _WRITTEN_FINDINGS)
    kind = F.col("kind")
    by_queue = {
        queue_key(r["queue"], r["vhost"]): r.asDict()
        for r in written.groupBy("queue", "vhost")
        .agg(
            F.sum((kind == FindingKind.LOST.value).cast("long")).alias("lost"),
            F.sum(
                ((kind == FindingKind.UNREPLICATED.value) & ~F.col("settled")).cast("long")
            ).alias("unreplicated_at_end"),
            F.sum(
                (
                    (kind == FindingKind.UNREPLICATED.value) & (F.col("event") == T.CONFIRMED_ALONE)
                ).cast("long")
            ).alias("unreplicated_by_design"),
            F.sum(
                ((kind == FindingKind.UNREPLICATED.value) & (F.col("event") == T.CONFIRMED)).cast(
                    "long"
                )
            ).alias("unreplicated_unexpected"),
            F.sum((kind == FindingKind.RESENT.value).cast("long")).alias("resent"),
            F.sum(F.when(kind == FindingKind.REPLICATED_TWICE.value, F.col("copies"))).alias(
                "replicated_twice"
            ),
            F.sum((kind == FindingKind.REORDERED.value).cast("long")).alias("reordered"),
            F.sum((kind == FindingKind.DIGEST_MISMATCH.value).cast("long")).alias(
                "digest_mismatch"
            ),
        )
        .collect()
    }
    counted = {
        r["queue"]: r.asDict()
        for r in _read(spark, _block_paths(io, manifest.blocks, "counts"), T.COUNTS_SCHEMA)
        .groupBy("queue")
        .agg(*[F.sum(c).alias(c) for c in T.COUNTS_SCHEMA.names if c != "queue"])
        .collect()
    }
    lag_rows = (
        _read(spark, _block_paths(io, manifest.blocks, "lag"), T.LAG_SCHEMA)
        .groupBy("queue", "bucket", "bin")
        .agg(F.sum("n").alias("n"), F.min("lo").alias("lo"), F.max("hi").alias("hi"))
        .collect()
    )
    queues = sorted({*by_queue, *counted} - {None})
    per_queue: list[QueueSummary] = []
    totals = Counts()
    lag_by: dict[tuple[str, float], list[tuple[int, int, float, float]]] = defaultdict(list)
    for r in lag_rows:
        lag_by[(r["queue"], r["bucket"])].append((r["bin"], r["n"], r["lo"], r["hi"]))
    for queue in queues:
        values = {**counted.get(queue, {}), **by_queue.get(queue, {})}
        counts = Counts(**{k: int(v or 0) for k, v in values.items() if k in Counts.model_fields})
        for field in Counts.model_fields:
            setattr(totals, field, getattr(totals, field) + getattr(counts, field))
        rows = [x for (q, _), xs in lag_by.items() if q == queue for x in xs]
        vhost, name = split_queue_key(queue)
        per_queue.append(QueueSummary(queue=name, vhost=vhost, counts=counts, lag=_stats(rows)))
    overall = _stats([x for xs in lag_by.values() for x in xs])
    buckets: dict[float, list[tuple[int, int, float, float]]] = defaultdict(list)
    for (_, bucket), xs in lag_by.items():
        buckets[bucket] += xs
    over_time = [
        LagBucket(start=b, lag=stats)
        for b in sorted(buckets)
        if (stats := _stats(buckets[b])) is not None
    ]
    _write_lag_table(store, f"audit/runs/{run}/lag.parquet", lag_by)
    epochs, failovers = _epochs_and_failovers(manifest.epochs)
    starts = [e["first_time"] for e in manifest.epochs if e["first_time"] is not None]
    ends = [e["last_time"] for e in manifest.epochs if e["last_time"] is not None]
    verdict, failures = verdict_of(totals)
    return AuditSummary(
        run_id=run,
        verdict=verdict,
        failures=failures,
        mode="full" if full else "incremental",
        store=store.url,
        brokers=brokers,
        segments_read=0,
        segments_total=0,
        events_read=0,
        window_start=min(starts) if starts else None,
        window_end=max(ends) if ends else None,
        totals=totals,
        queues=per_queue,
        lag=overall,
        lag_over_time=over_time,
        bucket_seconds=params.bucket_seconds,
        epochs=epochs,
        failovers=failovers,
        findings_path=findings_key,
        lag_path=f"audit/runs/{run}/lag.parquet",
    )


def _stats(rows: list[tuple[int, int, float, float]]) -> LagStats | None:
    if not rows:
        return None
    merged: dict[int, int] = defaultdict(int)
    for b, n, _, _ in rows:
        merged[b] += n
    return lag_stats(merged.items(), min(r[2] for r in rows), max(r[3] for r in rows))


def _write_lag_table(
    store: Store, key: str, lag_by: Mapping[tuple[str, float], list[tuple[int, int, float, float]]]
) -> None:
    """Lag percentiles per queue and time bucket, as Parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = []
    for (queue, bucket), xs in sorted(lag_by.items()):
        stats = _stats(xs)
        if stats is not None:
            vhost, name = split_queue_key(queue)
            rows.append(
                {"queue": name, "vhost": vhost, "bucket_start": bucket, **stats.model_dump()}
            )
    schema = pa.schema(
        [("queue", pa.string()), ("vhost", pa.string())]
        + [("bucket_start", pa.float64()), ("count", pa.int64())]
        + [(n, pa.float64()) for n in ("p50", "p95", "p99", "max", "min")]
    )
    out = io_.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), out)
    store.write_bytes(key, out.getvalue())


def _collect_garbage(store: Store, manifest: Manifest) -> None:
    """Remove state no block refers to any more, and results of runs beyond KEEP_RUNS."""
    live = {*manifest.blocks.values(), manifest.globals_run}
    for run in store.children("audit/state"):
        if run not in live:
            store.delete_prefix(f"audit/state/{run}")
    keep = set(manifest.runs)
    for run in store.children("audit/runs"):
        if run not in keep:
            store.delete_prefix(f"audit/runs/{run}")


def summary_json(summary: AuditSummary) -> str:
    """The summary as printed by the CLI."""
    return json.dumps(json.loads(summary.model_dump_json()), indent=1)
