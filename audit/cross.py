"""The cross-site audit: did the other DR site get every message a site confirmed, once?

Two stores, one per site (each holding its pair's shipped logs), read whole (no
incremental state: a run reads every segment of both). A site's own messages
are its records without `origin` (what clients did there); what it applied from
the other site carries the other site's mirror id (`origin`, audit log format 4).
The mirror keeps the source's queue and replication id, so (queue, replication
id) names a message on both sites. Both directions are checked, so a run after a
switchover (A then B as the source) audits both halves. Definitions:
docs/audit.md, "Across sites".
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING

from pyspark.sql import functions as F

from twinmq.audit import transforms as T
from twinmq.audit.job import SparkIO, _read
from twinmq.audit.schema import spark_schema
from twinmq.audit.store import Store
from twinmq.audit.summary import (
    CrossSiteCounts,
    CrossSiteFinding,
    CrossSiteQueue,
    CrossSiteSummary,
    FindingKind,
    LagStats,
    SiteInfo,
    cross_site_verdict,
    lag_stats,
)

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

SITES = ("a", "b")
MAX_FINDINGS = 1000  # listed in the summary; every finding is counted
_STORED = (T.CONFIRMED, T.CONFIRMED_ALONE, T.REPLICATED)
_CONFIRMS = (T.CONFIRMED, T.CONFIRMED_ALONE)


def _other(site: str) -> str:
    return "b" if site == "a" else "a"


def _min_time(site: str, condition: Column) -> Column:
    return F.min(F.when((F.col("site") == site) & condition, F.col("time")))


def _any(site: str, condition: Column) -> Column:
    return F.max(F.when((F.col("site") == site) & condition, 1).otherwise(0)) > 0


def per_message(records: DataFrame) -> DataFrame:
    """One row per (queue, replication id) with what each site did with it.

    `<s>_confirm`: first confirm at site s to a client publisher (no origin);
    `<s>_applied`: first copy s stored from the other site; `<s>_settle`: first
    settle by a client at s; `<s>_settle_applied`: s applied the other's settle;
    `<s>_local`: s stored it itself (a copy of its own, or its passive's).
    """
    local, applied = F.col("origin").isNull(), F.col("origin").isNotNull()
    event = F.col("event")
    aggs: list[Column] = []
    for s in SITES:
        aggs += [
            _min_time(s, local & event.isin(*_CONFIRMS)).alias(f"{s}_confirm"),
            _min_time(s, applied & event.isin(*_STORED)).alias(f"{s}_applied"),
            _min_time(s, local & (event == T.DEQUEUED)).alias(f"{s}_settle"),
            _any(s, applied & (event == T.DEQUEUED)).alias(f"{s}_settle_applied"),
            _any(s, local & event.isin(*_STORED)).alias(f"{s}_local"),
        ]
    return records.groupBy("queue", "replication_id").agg(*aggs)


def classify(messages: DataFrame, acked: dict[str, float | None]) -> DataFrame:
    """Per message: `home` (the site that confirmed it; the earlier if both did), `t_confirm`,
    `present` on the other site, `lag`, `kind` (lost, in flight or None) and the settle's
    `settled_at`, `t_settle` and `settle_kind` (unsettled, in flight or None)."""

    def pick(home: Column, column: str) -> Column:
        return F.when(home == "a", F.col(f"a_{column}")).otherwise(F.col(f"b_{column}"))

    def other(home: Column, column: str) -> Column:
        return F.when(home == "a", F.col(f"b_{column}")).otherwise(F.col(f"a_{column}"))

    def acked_of(site: Column) -> Column:
        a, b = acked["a"], acked["b"]
        return F.when(site == "a", F.lit(a).cast("double")).otherwise(F.lit(b).cast("double"))

    a_first = F.col("a_confirm").isNotNull() & (
        F.col("b_confirm").isNull() | (F.col("a_confirm") <= F.col("b_confirm"))
    )
    home = F.when(a_first, "a").when(F.col("b_confirm").isNotNull(), "b")
    frame = messages.withColumn("home", home)
    h = F.col("home")
    present = other(h, "applied").isNotNull() | other(h, "settle_applied")
    t_confirm = pick(h, "confirm")
    ack = acked_of(h)
    kind = (
        F.when(h.isNull() | present, F.lit(None).cast("string"))
        .when(ack.isNotNull() & (t_confirm <= ack), FindingKind.MIRROR_LOST.value)
        .otherwise(FindingKind.MIRROR_IN_FLIGHT.value)
    )
    # A settle by a client at one site must reach the other wherever that one holds a copy.
    a_settled_first = F.col("a_settle").isNotNull() & (
        F.col("b_settle").isNull() | (F.col("a_settle") <= F.col("b_settle"))
    )
    settled_at = F.when(a_settled_first, "a").when(F.col("b_settle").isNotNull(), "b")
    frame = frame.withColumn("settled_at", settled_at)
    st = F.col("settled_at")
    t_settle = pick(st, "settle")
    holds = other(st, "applied").isNotNull() | other(st, "local")
    settled_there = other(st, "settle_applied") | other(st, "settle").isNotNull()
    settle_ack = acked_of(st)
    settle_kind = (
        F.when(st.isNull() | ~holds | settled_there, F.lit(None).cast("string"))
        .when(settle_ack.isNotNull() & (t_settle <= settle_ack), FindingKind.MIRROR_UNSETTLED.value)
        .otherwise("settle-in-flight")
    )
    return frame.select(
        "queue",
        "replication_id",
        "home",
        t_confirm.alias("t_confirm"),
        present.alias("present"),
        (other(h, "applied") - t_confirm).alias("lag"),
        kind.alias("kind"),
        "settled_at",
        t_settle.alias("t_settle"),
        settle_kind.alias("settle_kind"),
    )


def acked_points(messages: DataFrame) -> dict[str, float | None]:
    """Per site X, the confirm or settle time at X of the newest change the other site applied.

    A site's events reach the other in the order of its group commits, and a record's
    time is its batch's completion (in commit order), so everything X did up to that
    time was applied there too: absent and older is lost, absent and newer in flight.
    """
    aggs = []
    for s in SITES:
        o = _other(s)
        aggs += [
            F.max(F.when(F.col(f"{o}_applied").isNotNull(), F.col(f"{s}_confirm"))).alias(
                f"{s}_by_copy"
            ),
            F.max(F.when(F.col(f"{o}_settle_applied"), F.col(f"{s}_settle"))).alias(
                f"{s}_by_settle"
            ),
        ]
    row = messages.agg(*aggs).first()
    assert row is not None  # a global aggregate has one row, even over no messages
    points: dict[str, float | None] = {}
    for s in SITES:
        values = [v for v in (row[f"{s}_by_copy"], row[f"{s}_by_settle"]) if v is not None]
        points[s] = max(values) if values else None
    return points


def duplicates(records: DataFrame) -> DataFrame:
    """(site, broker, queue, replication_id, copies): one message applied twice by a broker."""
    stored = records.where(F.col("origin").isNotNull() & F.col("event").isin(*_STORED))
    return (
        stored.groupBy("site", "broker", "queue", "replication_id")
        .agg((F.count("*") - 1).alias("copies"))
        .where(F.col("copies") > 0)
    )


def run_cross_site(
    spark: SparkSession, store_a: Store, store_b: Store, *, run_id: str | None = None
) -> CrossSiteSummary:
    """Audit site A's store against site B's; the summary is written to A's store under
    `audit/cross/<run>/summary.json` and returned."""
    started = time.monotonic()
    run = run_id or time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + uuid.uuid4().hex[:6]
    ios = {"a": SparkIO(spark, store_a), "b": SparkIO(spark, store_b)}
    try:
        frames, infos = [], []
        for site, io in ios.items():
            segments = io.store.segments()
            frame = _read(spark, [io.read(s.key) for s in segments], spark_schema())
            frames.append(frame.withColumn("site", F.lit(site)))
            infos.append((site, io.store.location, sorted({s.broker for s in segments}),
                          len(segments)))  # fmt: skip
        records = frames[0].unionByName(frames[1]).cache()
        origins = {
            site: sorted(
                r["origin"]
                for r in records.where(F.col("site") == site)
                .select("origin")
                .where(F.col("origin").isNotNull())
                .distinct()
                .collect()
            )
            for site in SITES
        }
        messages = per_message(records).cache()
        acked = acked_points(messages)
        judged = classify(messages, acked).cache()
        dups = duplicates(records).cache()
        summary = _summarize(run, judged, dups, acked, infos, origins)
        summary.seconds = round(time.monotonic() - started, 3)
        store_a.write_json(f"audit/cross/{run}/summary.json", summary.model_dump(mode="json"))
        store_a.write_json("audit/cross/latest.json", summary.model_dump(mode="json"))
        records.unpersist()
        return summary
    finally:
        for io in ios.values():
            io.close()


def _summarize(
    run: str,
    judged: DataFrame,
    dups: DataFrame,
    acked: dict[str, float | None],
    infos: list[tuple[str, str, list[str], int]],
    origins: dict[str, list[str]],
) -> CrossSiteSummary:
    kind, settle_kind = F.col("kind"), F.col("settle_kind")

    def count_if(condition: Column) -> Column:
        return F.sum(F.when(condition, 1).otherwise(0))

    counted = judged.groupBy("queue").agg(
        count_if(F.col("home").isNotNull()).alias("messages"),
        count_if(F.col("home").isNotNull() & F.col("present")).alias("mirrored"),
        count_if(kind == FindingKind.MIRROR_LOST.value).alias("lost"),
        count_if(kind == FindingKind.MIRROR_IN_FLIGHT.value).alias("in_flight"),
        count_if(F.col("settled_at").isNotNull()).alias("settled"),
        count_if(settle_kind == FindingKind.MIRROR_UNSETTLED.value).alias("unsettled_on_mirror"),
        count_if(settle_kind == "settle-in-flight").alias("settles_in_flight"),
    )
    per_queue = {r["queue"]: r.asDict() for r in counted.collect()}
    dup_rows = dups.collect()
    for r in dup_rows:
        per_queue.setdefault(r["queue"], {"queue": r["queue"]})
        row = per_queue[r["queue"]]
        row["duplicated"] = row.get("duplicated", 0) + r["copies"]
    hist = T.lag_histogram(
        judged.where(F.col("lag").isNotNull()).withColumn("origin", F.col("home")), 1e12
    ).collect()
    lag_rows: dict[str, list[tuple[int, int, float, float]]] = {}
    for r in hist:
        lag_rows.setdefault(r["queue"], []).append((r["bin"], r["n"], r["lo"], r["hi"]))
    queues = []
    totals = CrossSiteCounts()
    for name in sorted(per_queue):
        values = {k: v or 0 for k, v in per_queue[name].items() if k != "queue"}
        counts = CrossSiteCounts(**values)
        for field in CrossSiteCounts.model_fields:
            setattr(totals, field, getattr(totals, field) + getattr(counts, field))
        queues.append(CrossSiteQueue(queue=name, counts=counts, lag=_stats(lag_rows.get(name))))
    all_lag = [row for rows in lag_rows.values() for row in rows]
    findings = [
        CrossSiteFinding(
            kind=FindingKind.MIRROR_DUPLICATE,
            queue=r["queue"],
            replication_id=r["replication_id"],
            site=r["site"],
            broker=r["broker"],
            copies=r["copies"],
        )
        for r in dup_rows[:MAX_FINDINGS]
    ]
    absent = kind.isin(FindingKind.MIRROR_LOST.value, FindingKind.MIRROR_IN_FLIGHT.value)
    listed = judged.where(absent | (settle_kind == FindingKind.MIRROR_UNSETTLED.value))
    for r in listed.orderBy("queue", "replication_id").limit(MAX_FINDINGS).collect():
        if r["kind"] is not None:
            findings.append(CrossSiteFinding(
                kind=FindingKind(r["kind"]), queue=r["queue"], replication_id=r["replication_id"],
                site=r["home"], time=r["t_confirm"],
            ))  # fmt: skip
        if r["settle_kind"] == FindingKind.MIRROR_UNSETTLED.value:
            findings.append(CrossSiteFinding(
                kind=FindingKind.MIRROR_UNSETTLED, queue=r["queue"],
                replication_id=r["replication_id"], site=r["settled_at"], time=r["t_settle"],
            ))  # fmt: skip
    verdict, failures = cross_site_verdict(totals)
    return CrossSiteSummary(
        run_id=run,
        verdict=verdict,
        failures=failures,
        sites=[
            SiteInfo(
                name=site,
                store=store,
                brokers=brokers,
                segments=n,
                origins=origins[site],
                acked_until=acked[site],
            )
            for site, store, brokers, n in infos
        ],
        totals=totals,
        queues=queues,
        lag=_stats(all_lag),
        findings=findings[:MAX_FINDINGS],
    )


def _stats(rows: list[tuple[int, int, float, float]] | None) -> LagStats | None:
    if not rows:
        return None
    merged: dict[int, int] = {}
    for b, n, _, _ in rows:
        merged[b] = merged.get(b, 0) + n
    return lag_stats(merged.items(), min(r[2] for r in rows), max(r[3] for r in rows))
