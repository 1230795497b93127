"""The audit's transforms: DataFrame -> DataFrame, parameters passed in, no I/O.

The pipeline (docs/audit.md has the definitions):

    events --partial_aggregates--> one row per event --merge_aggregates--> one row per
    replication id (counts, first times and log positions per broker: mergeable, so a
    run can fold new events into the stored state) --classify_messages--> origin,
    copies, lag --> local_findings, lag_histogram, queue_counts (per message), and the
    cross-message checks find_resends (by message id) and find_reorders (by stream).

Brokers are given as a list of (at most) two names; a broker's *slot* is its
index in that list.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import (
    BooleanType,
    DoubleType,
    LongType,
    StringType,
    StructField,
    StructType,
)

from twinmq.audit.records import DEFAULT_VHOST, QUEUE_KEY_MARK, AuditEvent
from twinmq.audit.summary import LAG_GROWTH, LAG_RESOLUTION, FindingKind

if TYPE_CHECKING:
    import pyarrow as pa

SLOTS = 2
EPOCH_SHIFT = 40
"""A replication id is `epoch << 40 | n` (broker/epoch.py)."""
DEFAULT_STREAM_PATTERN = r"^(.+)[:#/](\d{1,18})$"
"""A message id `<publisher>:<n>` (or `#`, `/`) puts the message in publisher stream `<publisher>`
at sequence number n."""

CONFIRMED = AuditEvent.CONFIRMED.value
CONFIRMED_ALONE = AuditEvent.CONFIRMED_ALONE.value
REPLICATED = AuditEvent.REPLICATED.value
DEQUEUED = AuditEvent.DEQUEUED.value

AGGREGATE_SCHEMA = StructType(
    [
        StructField("replication_id", LongType(), False),
        StructField("queue", StringType()),
        StructField("message_id", StringType()),
        StructField("digest_min", LongType()),
        StructField("digest_max", LongType()),
    ]
    + [
        StructField(f"{name}{i}", kind)
        for i in range(SLOTS)
        for name, kind in (
            ("s", LongType()),
            ("c", LongType()),
            ("a", LongType()),
            ("d", LongType()),
            ("t", DoubleType()),
            ("p", LongType()),
        )
    ]
)
"""Per replication id and broker slot i: s = stored records (confirmed, confirmed-alone or
replicated), c = confirmed, a = confirmed-alone, d = dequeued, t = time of the first stored
record, p = its position in the broker's log (segment_seq << 32 | line, line being the record's
index in its segment). digest_min/max are the least and greatest `digest_key` of the stored
records (equal: same body; of two kinds of digest: not comparable)."""

FINDINGS_SCHEMA = StructType(
    [
        StructField("kind", StringType(), False),
        StructField("queue", StringType()),
        StructField("broker", StringType()),
        StructField("replication_id", LongType()),
        StructField("message_id", StringType()),
        StructField("epoch", LongType()),
        StructField("time", DoubleType()),
        StructField("event", StringType()),
        StructField("settled", BooleanType()),
        StructField("copies", LongType()),
        StructField("first_replication_id", LongType()),
        StructField("stream", StringType()),
        StructField("seq", LongType()),
        StructField("after_seq", LongType()),
    ]
)
"""One row per finding; columns a kind does not use are null (docs/audit.md)."""

STREAM_STATE_SCHEMA = StructType(
    [
        StructField("key", LongType(), False),
        StructField("last_pos", LongType()),
        StructField("max_seq", LongType()),
    ]
)
"""Per stream (key: 64-bit hash of broker slot, queue and stream name): the last log position
and the highest sequence seen."""


ID_INDEX_SCHEMA = StructType(
    [StructField("replication_id", LongType(), False), StructField("id_key", LongType())]
)
"""The stored state's per-message columns the re-send check scans: id_key (see id_key())."""


def with_queue_keys(events: DataFrame) -> DataFrame:
    """Shipped records with `queue` replaced by the queue's key (`records.queue_key`: its
    name for `/`, NUL and the JSON list of vhost and name otherwise), so that every step
    after it, keyed by `queue`, tells two vhosts' queues of one name apart."""
    queue, vhost = F.col("queue"), F.col("vhost")
    qualified = (vhost.isNotNull() & (vhost != DEFAULT_VHOST)) | queue.startswith(QUEUE_KEY_MARK)
    key = F.concat(
        F.lit(QUEUE_KEY_MARK), F.to_json(F.array(F.coalesce(vhost, F.lit(DEFAULT_VHOST)), queue))
    )
    return events.withColumn("queue", F.when(qualified, key).otherwise(queue))


def split_queue_keys(frame: DataFrame) -> DataFrame:
    """`queue` keys back to the queue's name, with its `vhost` (`/` for a plain name)."""
    queue = F.col("queue")
    qualified = queue.startswith(QUEUE_KEY_MARK)
    parts = F.from_json(F.substring(queue, 2, 1 << 20), "array<string>")
    return frame.withColumn(
        "vhost", F.when(qualified, parts.getItem(0)).otherwise(F.lit(DEFAULT_VHOST))
    ).withColumn("queue", F.when(qualified, parts.getItem(1)).otherwise(queue))


def id_key() -> Column:
    """A 64-bit hash of (queue, message id); null without a message id."""
    return F.when(F.col("message_id").isNotNull(), F.xxhash64("queue", "message_id"))


def _pick(values: Sequence[Column], slot: Column) -> Column:
    """values[slot] for a slot column."""
    return F.element_at(F.array(*values), (slot + 1).cast("int"))


def broker_name(brokers: Sequence[str], slot: Column) -> Column:
    """The broker name of a slot column."""
    return _pick([F.lit(b) for b in brokers], slot)


def _fill_findings(df: DataFrame) -> DataFrame:
    """Add the findings columns a frame lacks (null) and order them as FINDINGS_SCHEMA."""
    return df.select(
        *[
            (F.col(f.name) if f.name in df.columns else F.lit(None)).cast(f.dataType).alias(f.name)
            for f in FINDINGS_SCHEMA.fields
        ]
    )


def rid_epoch(rid: Column) -> Column:
    """The epoch a replication id was assigned in."""
    return F.shiftright(rid, EPOCH_SHIFT)


_SIGN = -(2**63)


def digest_key(digest: Column) -> Column:
    """A 64-bit key of a recorded digest, its sign telling the digest's kind apart.

    CRC-32 digests (8 hex digits, format 2) get non-negative keys, BLAKE2b-64 ones
    (16 hex digits, format 1) negative ones: a message recorded in both formats
    (by an old and a new broker, during an upgrade) has digest_min < 0 <= digest_max,
    which `digests_differ` does not call a mismatch. No digest ('') is no key.
    """
    low = F.xxhash64(digest).bitwiseAND(F.lit(~_SIGN))
    return (
        F.when(F.length(digest) == 0, F.lit(None).cast("long"))
        .when(F.length(digest) == 8, low)
        .otherwise(low.bitwiseOR(F.lit(_SIGN)))
    )


def digests_differ(digest_min: Column, digest_max: Column) -> Column:
    """Two digests of one kind that differ: the brokers stored different bodies."""
    return (digest_min != digest_max) & ((digest_min < 0) == (digest_max < 0))


def block_of(rid: Column, block_bits: int) -> Column:
    """The state block of a replication id (its epoch and the high bits of its number)."""
    return F.shiftright(rid, block_bits)


# -- per replication id: mergeable aggregates --------------------------------------------------


def _slot(brokers: Sequence[str]) -> Column:
    slot = F.lit(None).cast("long")
    for i, name in enumerate(brokers):
        slot = F.when(F.col("broker") == name, F.lit(i)).otherwise(slot)
    return slot


def partial_aggregates(events: DataFrame, brokers: Sequence[str]) -> DataFrame:
    """One row of AGGREGATE_SCHEMA per event (merge_aggregates folds them together)."""
    slot = _slot(brokers)
    stored = F.col("event") != DEQUEUED
    pos = F.shiftleft(F.col("segment_seq"), 32).bitwiseOR(F.col("line"))
    digest = F.when(stored, digest_key(F.col("digest")))
    cols: list[Column] = [
        F.col("replication_id"),
        F.col("queue"),
        F.col("message_id"),
        digest.alias("digest_min"),
        digest.alias("digest_max"),
    ]
    for i in range(SLOTS):
        here = slot == i
        cols += [
            (here & stored).cast("long").alias(f"s{i}"),
            (here & (F.col("event") == CONFIRMED)).cast("long").alias(f"c{i}"),
            (here & (F.col("event") == CONFIRMED_ALONE)).cast("long").alias(f"a{i}"),
            (here & ~stored).cast("long").alias(f"d{i}"),
            F.when(here & stored, F.col("time")).alias(f"t{i}"),
            F.when(here & stored, pos).alias(f"p{i}"),
        ]
    return events.select(*cols)


def merge_aggregates(parts: DataFrame) -> DataFrame:
    """Fold rows of AGGREGATE_SCHEMA by replication id (sums, minima, maxima: associative)."""
    aggs = [
        F.max("queue").alias("queue"),
        F.max("message_id").alias("message_id"),
        F.min("digest_min").alias("digest_min"),
        F.max("digest_max").alias("digest_max"),
    ]
    for i in range(SLOTS):
        aggs += [F.sum(f"{k}{i}").alias(f"{k}{i}") for k in "scad"]
        aggs += [F.min(f"t{i}").alias(f"t{i}"), F.min(f"p{i}").alias(f"p{i}")]
    return parts.groupBy("replication_id").agg(*aggs)


def message_aggregates(events: DataFrame, brokers: Sequence[str]) -> DataFrame:
    """AGGREGATE_SCHEMA rows of a set of events: merge_aggregates(partial_aggregates(events)).

    The same result, computed for speed: the events, narrowed to numbers where
    possible, are shuffled once by replication id; stored records and dequeues
    are aggregated apart and joined without another shuffle. Queue and message
    id are grouping keys (the records of one message agree on them), so every
    aggregation buffer is fixed-width and Spark can hash-aggregate.
    """
    kind = (
        F.when(F.col("event") == CONFIRMED, 0)
        .when(F.col("event") == CONFIRMED_ALONE, 1)
        .when(F.col("event") == REPLICATED, 2)
        .otherwise(3)
    )
    stored = kind < 3
    narrow = events.select(
        "replication_id",
        "queue",
        F.when(stored, F.col("message_id")).alias("message_id"),
        F.when(stored, digest_key(F.col("digest"))).alias("dh"),
        _slot(brokers).cast("int").alias("slot"),
        kind.cast("byte").alias("kind"),
        "time",
        F.shiftleft(F.col("segment_seq"), 32).bitwiseOR(F.col("line")).alias("pos"),
    ).repartition("replication_id")
    here = [F.col("slot") == i for i in range(SLOTS)]
    aggs = [F.min("dh").alias("digest_min"), F.max("dh").alias("digest_max")]
    for i in range(SLOTS):
        aggs += [
            F.sum(here[i].cast("long")).alias(f"s{i}"),
            F.sum((here[i] & (F.col("kind") == 0)).cast("long")).alias(f"c{i}"),
            F.sum((here[i] & (F.col("kind") == 1)).cast("long")).alias(f"a{i}"),
            F.min(F.when(here[i], F.col("time"))).alias(f"t{i}"),
            F.min(F.when(here[i], F.col("pos"))).alias(f"p{i}"),
        ]
    copies = narrow.where(F.col("kind") < 3).groupBy("replication_id", "queue", "message_id")
    dequeues = (
        narrow.where(F.col("kind") == 3)
        .groupBy("replication_id", F.col("queue").alias("dq"))
        .agg(*[F.sum(here[i].cast("long")).alias(f"d{i}") for i in range(SLOTS)])
    )
    joined = copies.agg(*aggs).join(dequeues, "replication_id", "full")
    zero = F.lit(0).cast("long")
    cols: list[Column] = []
    for name in AGGREGATE_SCHEMA.names:
        if name == "queue":
            cols.append(F.coalesce("queue", "dq"))
        elif name[0] in "scad" and name[1:].isdigit():
            cols.append(F.coalesce(F.col(name), zero))
        else:
            cols.append(F.col(name))
    return joined.select(*[c.alias(n) for c, n in zip(cols, AGGREGATE_SCHEMA.names, strict=True)])


# -- per message: origin, copies, lag -----------------------------------------------------------


def classify_messages(aggregates: DataFrame) -> DataFrame:
    """Per replication id: its origin broker slot, event, confirm time, copies and lag.

    The origin is the broker with a confirmed or confirmed-alone record (the
    earlier one if, impossibly, both have one); the other slot is the peer.
    """
    active = [F.col(f"c{i}") + F.col(f"a{i}") > 0 for i in range(SLOTS)]
    origin = F.when(active[0] & (~active[1] | (F.col("t0") <= F.col("t1"))), F.lit(0)).when(
        active[1], F.lit(1)
    )
    o = F.col("origin")
    peer = 1 - o

    def at(name: str, slot: Column) -> Column:
        return _pick([F.col(f"{name}{i}") for i in range(SLOTS)], slot)

    return (
        aggregates.withColumn("origin", origin.cast("long"))
        .withColumn("epoch", rid_epoch(F.col("replication_id")))
        .withColumn(
            "origin_event",
            F.when(o.isNull(), F.lit(None))
            .when(at("c", o) > 0, CONFIRMED)
            .otherwise(CONFIRMED_ALONE),
        )
        .withColumn("t_confirm", at("t", o))
        .withColumn("replicated", at("s", peer) > 0)
        .withColumn("present_elsewhere", at("s", peer) + at("d", peer) > 0)
        .withColumn("lag", F.when(at("s", peer) > 0, at("t", peer) - at("t", o)))
        .withColumn("settled", at("d", o) > 0)
        .withColumn("digest_mismatch", digests_differ(F.col("digest_min"), F.col("digest_max")))
    )


def local_findings(messages: DataFrame, brokers: Sequence[str]) -> DataFrame:
    """Findings about single messages: unreplicated (lost or not is decided later with the
    epochs: `classify_unreplicated`), replicated twice, digest mismatch."""
    unreplicated = messages.where(F.col("origin").isNotNull() & ~F.col("present_elsewhere")).select(
        F.lit(FindingKind.UNREPLICATED.value).alias("kind"),
        "queue",
        broker_name(brokers, F.col("origin")).alias("broker"),
        "replication_id",
        "message_id",
        "epoch",
        F.col("t_confirm").alias("time"),
        F.col("origin_event").alias("event"),
        "settled",
    )
    twice = [
        messages.where(F.col(f"s{i}") > 1).select(
            F.lit(FindingKind.REPLICATED_TWICE.value).alias("kind"),
            "queue",
            F.lit(name).alias("broker"),
            "replication_id",
            "message_id",
            "epoch",
            F.col(f"t{i}").alias("time"),
            (F.col(f"s{i}") - 1).alias("copies"),
        )
        for i, name in enumerate(brokers)
    ]
    mismatch = messages.where(F.col("digest_mismatch")).select(
        F.lit(FindingKind.DIGEST_MISMATCH.value).alias("kind"),
        "queue",
        "replication_id",
        "message_id",
        "epoch",
        F.col("t_confirm").alias("time"),
    )
    out = _fill_findings(unreplicated)
    for frame in [*twice, mismatch]:
        out = out.unionByName(_fill_findings(frame))
    return out


def classify_unreplicated(findings: DataFrame, peer_last_epoch: dict[str, int]) -> DataFrame:
    """Unreplicated findings become `lost` where the loss rule holds (docs/audit.md).

    A message confirmed on both disks by broker X in epoch E, of which the
    other broker has no record at all, is lost once the other broker's log
    goes past epoch E (a failover happened, and its records of epoch E are
    all in). `peer_last_epoch` maps each broker to the last epoch of the
    *other* broker's log.
    """
    last = F.lit(None).cast("long")
    for broker, epoch in peer_last_epoch.items():
        last = F.when(F.col("broker") == broker, F.lit(epoch)).otherwise(last)
    lost = (
        (F.col("kind") == FindingKind.UNREPLICATED.value)
        & (F.col("event") == CONFIRMED)
        & (last > F.col("epoch"))
    )
    return findings.withColumn(
        "kind", F.when(lost, F.lit(FindingKind.LOST.value)).otherwise(F.col("kind"))
    )


def lag_histogram(messages: DataFrame, bucket_seconds: float, by: Sequence[str] = ()) -> DataFrame:
    """Replicated messages' lag as histogram rows (*by, queue, bucket, bin, n, lo, hi).

    Bins grow by LAG_GROWTH from LAG_RESOLUTION (summary.lag_bin); counts add
    up across blocks and runs, so percentiles come out the same however the
    messages were split. `bucket` is the start of the confirm's time bucket.
    """
    lag = F.col("lag")
    magnitude = F.abs(lag)
    index = 1 + F.floor(F.log(magnitude / LAG_RESOLUTION) / F.log(F.lit(LAG_GROWTH)))
    bin_ = F.when(magnitude < LAG_RESOLUTION, F.lit(0)).otherwise(F.signum(lag) * index)
    bucket = F.floor(F.col("t_confirm") / bucket_seconds) * bucket_seconds
    return (
        messages.where(F.col("origin").isNotNull() & lag.isNotNull())
        .groupBy(
            *by, "queue", bucket.cast("double").alias("bucket"), bin_.cast("long").alias("bin")
        )
        .agg(F.count("*").alias("n"), F.min(lag).alias("lo"), F.max(lag).alias("hi"))
    )


LAG_SCHEMA = StructType(
    [
        StructField("queue", StringType()),
        StructField("bucket", DoubleType()),
        StructField("bin", LongType()),
        StructField("n", LongType()),
        StructField("lo", DoubleType()),
        StructField("hi", DoubleType()),
    ]
)


def queue_counts(messages: DataFrame, by: Sequence[str] = ()) -> DataFrame:
    """Per queue: messages with an origin record, by event, how many were replicated, and
    copies without any origin record (`replica_only`)."""
    has_origin = F.col("origin").isNotNull()
    stored = sum((F.col(f"s{i}") for i in range(SLOTS)), F.lit(0)) > 0
    return messages.groupBy(*by, "queue").agg(
        F.sum(has_origin.cast("long")).alias("messages"),
        F.sum((F.col("origin_event") == CONFIRMED).cast("long")).alias("confirmed"),
        F.sum((F.col("origin_event") == CONFIRMED_ALONE).cast("long")).alias("confirmed_alone"),
        F.sum((has_origin & F.col("replicated")).cast("long")).alias("replicated"),
        F.sum((~has_origin & stored).cast("long")).alias("replica_only"),
    )


COUNTS_SCHEMA = StructType(
    [
        StructField("queue", StringType()),
        StructField("messages", LongType()),
        StructField("confirmed", LongType()),
        StructField("confirmed_alone", LongType()),
        StructField("replicated", LongType()),
        StructField("replica_only", LongType()),
    ]
)


def epoch_stats(events: DataFrame) -> DataFrame:
    """Per (epoch, broker): records, first and last record, first and last confirm."""
    confirm = F.col("event").isin(CONFIRMED, CONFIRMED_ALONE)
    return events.groupBy("epoch", "broker").agg(
        F.count("*").alias("records"),
        F.min("time").alias("first_time"),
        F.max("time").alias("last_time"),
        F.min(F.when(confirm, F.col("time"))).alias("first_confirm"),
        F.max(F.when(confirm, F.col("time"))).alias("last_confirm"),
        F.sum(confirm.cast("long")).alias("confirms"),
    )


# -- across messages: client re-sends and reordering -----------------------------------------


def find_resends(messages: DataFrame, brokers: Sequence[str]) -> DataFrame:
    """Messages whose (queue, message id) was published again under another replication id.

    One finding per extra copy: every replication id of the group but the first.
    Candidates are found by a 64-bit hash of (queue, message id) (a narrow
    shuffle); the groups are then formed exactly, on the candidates only.
    """
    base = messages.where(F.col("origin").isNotNull() & F.col("message_id").isNotNull())
    base = base.withColumn("key", F.xxhash64("queue", "message_id"))
    candidates = base.groupBy("key").count().where(F.col("count") > 1).select("key")
    suspects = base.join(candidates, "key", "left_semi")
    groups = (
        suspects.groupBy("queue", "message_id")
        .agg(
            F.count("*").alias("group_size"),
            F.min("replication_id").alias("first_replication_id"),
        )
        .where(F.col("group_size") > 1)
    )
    return _fill_findings(
        suspects.join(groups, ["queue", "message_id"])
        .where(F.col("replication_id") != F.col("first_replication_id"))
        .select(
            F.lit(FindingKind.RESENT.value).alias("kind"),
            "queue",
            broker_name(brokers, F.col("origin")).alias("broker"),
            "replication_id",
            "message_id",
            "epoch",
            F.col("t_confirm").alias("time"),
            F.col("origin_event").alias("event"),
            (F.col("group_size") - 1).alias("copies"),
            "first_replication_id",
        )
    )


def stream_copies(aggregates: DataFrame, pattern: str) -> DataFrame:
    """Every copy a broker stored as the active (broker slot, replication id), with its
    publisher stream and sequence: what the reorder check compares.

    A message id matching `pattern` (groups: stream, sequence number) puts the
    copy in that publisher's stream; any other message is in its queue's
    unnamed stream "" with its replication id as the sequence.

    A passive's copies (`replicated` only) are left out: a passive stores what it is
    sent in the order it arrives (a catch-up's chunks beside the live batches of a
    passive that rejoins during traffic), then sorts its queues by replication id
    (`VirtualHost.restore_order`): its consumers, after a promotion, get the order its
    active stored, which the active's own copies prove. Comparing a passive's log order
    reported every rejoin under traffic as reordered.
    """
    stream = F.regexp_extract(F.col("message_id"), pattern, 1)
    numbered = F.col("message_id").isNotNull() & (stream != "")
    seq = F.when(numbered, F.regexp_extract(F.col("message_id"), pattern, 2).cast("long"))
    per_message = aggregates.select(
        "replication_id",
        "queue",
        "message_id",
        F.when(numbered, stream).otherwise(F.lit("")).alias("stream"),
        F.coalesce(seq, F.col("replication_id")).alias("seq"),
        F.array(
            *[
                F.struct(
                    F.lit(i).cast("long").alias("slot"),
                    (F.col(f"c{i}") + F.col(f"a{i}")).alias("as_active"),
                    F.col(f"p{i}").alias("pos"),
                    F.col(f"t{i}").alias("time"),
                )
                for i in range(SLOTS)
            ]
        ).alias("copies"),
    )
    return (
        per_message.select("*", F.inline("copies"))
        .where(F.col("as_active") > 0)
        .select("slot", "queue", "stream", "seq", "pos", "replication_id", "message_id", "time")
    )


CHECKED_SCHEMA = StructType(
    [
        StructField("is_state", BooleanType(), False),
        StructField("key", LongType()),
        StructField("replication_id", LongType()),
        StructField("after_seq", LongType()),
        StructField("last_pos", LongType()),
        StructField("max_seq", LongType()),
    ]
)
_NONE = -(2**63)


def _running_max(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """mapInArrow: within one partition (whole streams), each copy's highest earlier sequence.

    Input columns: key, pos, seq, replication_id, state_max. Emits the
    reordered copies and one state row per stream (CHECKED_SCHEMA).
    """
    import numpy as np
    import pyarrow as pa

    received = list(batches)
    if not received:
        return
    table = pa.Table.from_batches(received)
    if table.num_rows == 0:
        return
    key = table["key"].to_numpy()
    pos = table["pos"].to_numpy()
    order = np.lexsort((pos, key))
    key, pos = key[order], pos[order]
    seq = table["seq"].to_numpy()[order]
    rid = table["replication_id"].to_numpy()[order]
    prior = table["state_max"].fill_null(_NONE).to_numpy()[order]
    starts = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
    ends = np.r_[starts[1:], len(key)]
    before = np.empty_like(seq)
    for start, end in zip(starts, ends, strict=True):
        running = np.maximum.accumulate(seq[start:end])
        before[start] = prior[start]
        before[start + 1 : end] = np.maximum(running[:-1], prior[start])
    hit = seq < before
    n, m = int(hit.sum()), len(starts)
    schema = checked_arrow_schema()
    none = pa.nulls
    if n:
        yield from pa.Table.from_pydict(
            {
                "is_state": pa.array(np.zeros(n, dtype=bool)),
                "key": pa.array(key[hit]),
                "replication_id": pa.array(rid[hit]),
                "after_seq": pa.array(before[hit]),
                "last_pos": none(n, pa.int64()),
                "max_seq": none(n, pa.int64()),
            },
            schema=schema,
        ).to_batches()
    tops = np.maximum(np.maximum.reduceat(seq, starts), prior[starts])
    yield from pa.Table.from_pydict(
        {
            "is_state": pa.array(np.ones(m, dtype=bool)),
            "key": pa.array(key[starts]),
            "replication_id": none(m, pa.int64()),
            "after_seq": none(m, pa.int64()),
            "last_pos": pa.array(pos[ends - 1]),
            "max_seq": pa.array(tops),
        },
        schema=schema,
    ).to_batches()


def checked_arrow_schema() -> pa.Schema:
    """CHECKED_SCHEMA as Arrow."""
    import pyarrow as pa

    types = {"boolean": pa.bool_(), "bigint": pa.int64()}
    return pa.schema(
        [pa.field(f.name, types[f.dataType.simpleString()], f.nullable) for f in CHECKED_SCHEMA]
    )


def stream_key() -> Column:
    """The key of a copy's stream: a 64-bit hash of broker slot, queue and stream name."""
    return F.xxhash64("slot", "queue", "stream")


def find_reorders(
    copies: DataFrame, state: DataFrame, brokers: Sequence[str]
) -> tuple[DataFrame, DataFrame]:
    """Copies stored after a higher sequence number of their stream on the same broker.

    `copies` (stream_copies) are the copies first seen in this run; `state`
    (STREAM_STATE_SCHEMA) summarizes the copies of earlier runs, which all come
    earlier in each broker's log. Returns the findings and the new state. Each
    stream is checked whole in one task (numpy: sort by log position, running
    maximum); only numbers go through Python.
    """
    keyed = copies.withColumn("key", stream_key())
    prior = state.select("key", F.col("max_seq").alias("state_max"))
    checked = (
        keyed.select("key", "pos", "seq", "replication_id")
        .join(F.broadcast(prior), "key", "left")
        .repartition("key")
        .mapInArrow(_running_max, CHECKED_SCHEMA)
        .persist()
    )
    hits = checked.where(~F.col("is_state")).select("key", "replication_id", "after_seq")
    findings = _fill_findings(
        keyed.join(hits, ["key", "replication_id"]).select(
            F.lit(FindingKind.REORDERED.value).alias("kind"),
            "queue",
            broker_name(brokers, F.col("slot")).alias("broker"),
            "replication_id",
            "message_id",
            rid_epoch(F.col("replication_id")).alias("epoch"),
            "time",
            "stream",
            "seq",
            "after_seq",
        )
    )
    fresh = checked.where(F.col("is_state")).select("key", "last_pos", "max_seq")
    new_state = (
        state.unionByName(fresh)
        .groupBy("key")
        .agg(F.max("last_pos").alias("last_pos"), F.max("max_seq").alias("max_seq"))
    )
    return findings, new_state
