"""The cross-site audit: did every other DR site get every message a site confirmed, once?

One store per site (each holding its pair's shipped logs): two for a DR source and
its mirror or two bidirectional sites, three or more for a ring or a full mesh. A
message is named by its **identity**: its home site (where a client published it),
its queue and its replication id there. A site's own records name it directly; what
a site applied from another carries the mirror id of the site it came from
(`origin`, audit log format 4) and, on a bidirectional site whose ids are mapped per
origin, the message's own origin and id there (`message_origin`, `origin_id`, format
5); a one-way mirror keeps the source's replication id. Mirror ids are tied to the
audited sites by `cross_sites.resolve_site_ids`. A settle names the site's local id,
resolved through the site's stored copies (`locals`). Every ordered pair of sites is
checked (`cross_judge.judge`), so a run after a switchover (A then B as the source),
over two bidirectional sites, or over a ring or mesh audits every direction.

Runs are incremental: the state (per identity, mergeable folds of what each site
did: first times and flags; applied copies per broker; the local ids of copies)
lives under `audit/cross/state/<run>/` of the first store, committed by
`audit/cross/manifest.json`, written last; a run reads only the segments the
manifest does not list and judges the folded state, so it gives what a run over
every segment gives. Definitions: docs/audit.md, "Across sites".
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from pydantic import BaseModel, Field
from pyspark.sql import functions as F

from twinmq.audit import transforms as T
from twinmq.audit.cross_judge import (
    IDENTITY,
    SETTLE_IN_FLIGHT,
    STORED,
    acked_points,
    copies,
    judge,
    merge_messages,
    per_message,
)
from twinmq.audit.cross_sites import resolve_site_ids, site_names
from twinmq.audit.job import SparkIO, _read
from twinmq.audit.records import split_queue_key
from twinmq.audit.schema import spark_schema
from twinmq.audit.store import SegmentName, Store
from twinmq.audit.summary import (
    CrossSiteCounts,
    CrossSiteDirection,
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

MAX_FINDINGS = 1000  # listed in the summary; every finding is counted
PREFIX = "audit/cross"
MANIFEST = f"{PREFIX}/manifest.json"
STATE_FORMAT = 1  # a manifest of another format makes the next run a full one


class CrossManifest(BaseModel):
    """What the cross-site audit has read, and where its state lives (`audit/cross/`)."""

    format: int = STATE_FORMAT
    mirror_store: str = Field(description="The other site's store the state was built from")
    more_stores: list[str] = Field(
        default_factory=list, description="The stores of sites c, d, ... (three sites or more)"
    )
    state_run: str = Field(description="The run whose `state/<run>/` holds the state")
    segments: dict[str, list[str]] = Field(description="Per site, the segment keys read")
    origins: dict[str, list[str]] = Field(description="Per site, the mirror ids it applied from")
    runs: list[str] = Field(default_factory=list)


def _state(run: str, table: str) -> str:
    return f"{PREFIX}/state/{run}/{table}"


def identify(
    records: DataFrame, locals_: DataFrame | None, site_of: Mapping[str, str]
) -> tuple[DataFrame, DataFrame]:
    """Each record with its message's identity (`home`, `hid`), and the new local ids.

    A stored record: format 5's `message_origin` and `origin_id` (home: the site that
    mirror id is, `site_of`; an id of no audited site is the recording site's own, as a
    client's publish batched with an apply carries), else with an `origin` the site it
    came from under the same id (a one-way mirror keeps it), else this site. A settle:
    the identity of the site's stored copy of (queue, replication id) (`locals_` and
    this run's copies), else this site's own message. Returns the records and `(site,
    queue, replication_id, home, hid)` of this run's stored copies that are not the
    site's own messages."""
    site, mo, origin = F.col("site"), F.col("message_origin"), F.col("origin")

    def home_of(mirror_id: Column) -> Column:
        """The site a mirror id is, else this one."""
        expr: Column = site
        for value, name in sorted(site_of.items()):
            expr = F.when(mirror_id == value, F.lit(name)).otherwise(expr)
        return expr

    stored = (
        records.where(F.col("event").isin(*STORED))
        .withColumn(
            "home",
            F.when(mo.isNotNull(), home_of(mo))
            .when(origin.isNotNull(), home_of(origin))
            .otherwise(site),
        )
        .withColumn(
            "hid", F.when(mo.isNotNull(), F.col("origin_id")).otherwise(F.col("replication_id"))
        )
    )
    key = ["site", "queue", "replication_id"]
    new_locals = (
        stored.where((F.col("home") != site) | (F.col("hid") != F.col("replication_id")))
        .select(*key, "home", "hid")
        .distinct()
    )
    known = new_locals if locals_ is None else new_locals.unionByName(locals_)
    known = known.groupBy(*key).agg(F.first("home").alias("l_home"), F.first("hid").alias("l_hid"))
    settles = (
        records.where(F.col("event") == T.DEQUEUED)
        .join(known, key, "left")
        .withColumn("home", F.coalesce(F.col("l_home"), site))
        .withColumn("hid", F.coalesce(F.col("l_hid"), F.col("replication_id")))
        .drop("l_home", "l_hid")
    )
    return stored.unionByName(settles), new_locals


def _load_manifest(store: Store) -> CrossManifest | None:
    if not store.exists(MANIFEST):
        return None
    try:
        manifest = CrossManifest.model_validate(store.read_json(MANIFEST))
    except ValueError:
        return None  # unreadable: start over (a full run rebuilds everything)
    return manifest if manifest.format == STATE_FORMAT else None


def _late(manifest: CrossManifest, site: str, new: list[SegmentName]) -> bool:
    """Whether a new segment is older than one already read from its broker (shipped late):
    its settles may name copies whose local ids are not carried yet, so the run is full."""
    top: dict[str, int] = {}
    for key in manifest.segments.get(site, []):
        name = SegmentName.parse_stored(key.rsplit("/", 1)[-1])
        if name is not None:
            top[name.broker] = max(top.get(name.broker, -1), name.seq)
    return any(s.seq < top.get(s.broker, -1) for s in new)


def run_cross_site(
    spark: SparkSession,
    store_a: Store,
    *others: Store,
    run_id: str | None = None,
    full: bool = False,
    site_ids: Mapping[str, str] | None = None,
) -> CrossSiteSummary:
    """Audit site A's store against the other sites' (`b`, `c`, ...: one for a DR pair of
    sites, two or more for a ring or a mesh): the segments not read yet, folded into the
    state under A's `audit/cross/state/`; the summary is written to A's store under
    `audit/cross/<run>/summary.json` and returned. `full` ignores the state. `site_ids`
    (site name -> its mirror id) ties the logs' mirror ids to sites where the logs alone
    cannot (`cross_sites.resolve_site_ids`: a ring of three)."""
    started = time.monotonic()
    run = run_id or time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + uuid.uuid4().hex[:6]
    sites = site_names(1 + len(others))
    stores = dict(zip(sites, (store_a, *others), strict=True))
    ios = {site: SparkIO(spark, store) for site, store in stores.items()}
    try:
        manifest = None if full else _load_manifest(store_a)
        if manifest is not None and [manifest.mirror_store, *manifest.more_stores] != [
            s.location for s in others
        ]:
            manifest = None  # another set of sites: start over
        listed = {site: io.store.segments() for site, io in ios.items()}
        new = {
            site: [
                s for s in segs if manifest is None or s.key not in manifest.segments.get(site, [])
            ]
            for site, segs in listed.items()
        }
        if manifest is not None and any(_late(manifest, s, new[s]) for s in sites):
            manifest, new = None, listed
        frames = []
        for site, io in ios.items():
            frame = T.with_queue_keys(
                _read(spark, [io.read(s.key) for s in new[site]], spark_schema())
            )
            frames.append(frame.withColumn("site", F.lit(site)))
        records = frames[0]
        for frame in frames[1:]:
            records = records.unionByName(frame)
        records = records.cache()
        origins = {
            site: set(manifest.origins.get(site, [])) if manifest else set() for site in sites
        }
        for r in (
            records.where(F.col("origin").isNotNull()).select("site", "origin").distinct().collect()
        ):
            origins[r["site"]].add(r["origin"])
        sorted_origins = {site: sorted(values) for site, values in origins.items()}
        site_of = resolve_site_ids(sites, sorted_origins, site_ids)

        carried = None if manifest is None else manifest.state_run
        io_a = ios["a"]

        def state(table: str) -> DataFrame | None:
            return (
                None if carried is None else spark.read.parquet(io_a.read(_state(carried, table)))
            )

        ident, new_locals = identify(records, state("locals"), site_of)
        ident = ident.cache()
        messages = merge_messages(
            [p for p in (state("messages"), per_message(ident, sites)) if p is not None], sites
        )
        copies_now = copies(ident)
        old_copies = state("copies")
        if old_copies is not None:
            copies_now = (
                copies_now.unionByName(old_copies)
                .groupBy("site", "broker", *IDENTITY)
                .agg(F.sum("n").alias("n"))
            )
        old_locals = state("locals")
        locals_all = (
            new_locals if old_locals is None else new_locals.unionByName(old_locals).distinct()
        )
        for table, frame in (
            ("messages", messages),
            ("copies", copies_now),
            ("locals", locals_all),
        ):
            frame.write.parquet(io_a.write(_state(run, table)))
        io_a.flush()
        ident.unpersist()
        records.unpersist()
        # Judged from the state just written (what the next run carries).
        messages = spark.read.parquet(io_a.read(_state(run, "messages"))).cache()
        copies_now = spark.read.parquet(io_a.read(_state(run, "copies")))
        acked = acked_points(messages, sites)
        judged = judge(messages, acked, sites).cache()
        dups = (
            copies_now.where(F.col("n") > 1)
            .select("site", "broker", "queue", F.col("hid").alias("replication_id"), "home",
                    (F.col("n") - 1).alias("copies"))
        )  # fmt: skip
        done = manifest.segments if manifest is not None else {s: [] for s in sites}
        mirror_ids = {site: mirror_id for mirror_id, site in site_of.items()}
        infos = [
            SiteInfo(
                name=site, store=ios[site].store.location, mirror_id=mirror_ids.get(site),
                brokers=sorted({s.broker for s in listed[site]}),
                segments=len(done.get(site, [])) + len(new[site]), segments_read=len(new[site]),
                origins=sorted_origins[site], acked_until=_oldest(site, sites, acked),
            )
            for site in sites
        ]  # fmt: skip
        summary = _summarize(run, judged, dups.cache(), acked, infos)
        summary.incremental = manifest is not None
        summary.seconds = round(time.monotonic() - started, 3)
        store_a.write_json(f"{PREFIX}/{run}/summary.json", summary.model_dump(mode="json"))
        store_a.write_json(f"{PREFIX}/latest.json", summary.model_dump(mode="json"))
        messages.unpersist()
        judged.unpersist()
        runs = (manifest.runs if manifest is not None else []) + [run]
        store_a.write_json(
            MANIFEST,
            CrossManifest(
                mirror_store=others[0].location,
                more_stores=[s.location for s in others[1:]],
                state_run=run,
                segments={s: sorted(set(done.get(s, [])) | {n.key for n in new[s]}) for s in sites},
                origins=sorted_origins,
                runs=runs[-100:],
            ).model_dump(mode="json"),
        )
        # Committed: the state of other runs (the previous one, a crashed one) goes.
        for name in store_a.children(f"{PREFIX}/state"):
            if name != run:
                store_a.delete_prefix(f"{PREFIX}/state/{name}")
        return summary
    finally:
        for io in ios.values():
            io.close()


def _oldest(
    site: str, sites: Sequence[str], acked: Mapping[tuple[str, str], float | None]
) -> float | None:
    """A site's acknowledged point for the summary: the oldest of its points towards each
    other site (every other site applied what it did up to then); None if one has none."""
    points = [acked[(site, t)] for t in sites if t != site]
    return None if any(p is None for p in points) else min(p for p in points if p is not None)


def _summarize(
    run: str,
    judged: DataFrame,
    dups: DataFrame,
    acked: Mapping[tuple[str, str], float | None],
    infos: list[SiteInfo],
) -> CrossSiteSummary:
    """Counts per queue and ordered pair of sites (a direction), folded into the totals.

    `messages`, `mirrored` (held by every other site) and `settled` count messages once;
    `lost`, `in_flight`, `duplicated`, `unsettled_on_mirror` and `settles_in_flight` count
    per site that lacks or holds the copy, so they add up over the directions."""
    kind, settle_kind = F.col("kind"), F.col("settle_kind")
    home, target, settled_at = F.col("home"), F.col("target"), F.col("settled_at")

    def count_if(condition: Column) -> Column:
        return F.sum(F.when(condition, 1).otherwise(0))

    pair_rows = (
        judged.where(home.isNotNull() & (target != home))
        .groupBy("queue", "home", "target")
        .agg(
            F.count("*").alias("messages"),
            count_if(F.col("present")).alias("mirrored"),
            count_if(kind == FindingKind.MIRROR_LOST.value).alias("lost"),
            count_if(kind == FindingKind.MIRROR_IN_FLIGHT.value).alias("in_flight"),
        )
        .collect()
    )
    settle_rows = (
        judged.where(settled_at.isNotNull() & (target != settled_at))
        .groupBy("queue", "settled_at", "target")
        .agg(
            F.count("*").alias("settled"),
            count_if(settle_kind == FindingKind.MIRROR_UNSETTLED.value).alias(
                "unsettled_on_mirror"
            ),
            count_if(settle_kind == SETTLE_IN_FLIGHT).alias("settles_in_flight"),
        )
        .collect()
    )
    # Each message once: on its home's row (messages, mirrored everywhere), on the row of
    # the site that settled it first (settled).
    once_rows = (
        judged.where((home.isNotNull() & (target == home)) | (target == settled_at))
        .groupBy("queue")
        .agg(
            count_if(target == home).alias("messages"),
            count_if((target == home) & F.col("everywhere")).alias("mirrored"),
            count_if(target == settled_at).alias("settled"),
        )
        .collect()
    )
    # (queue, source site, target site) -> counts of that direction
    cells: dict[tuple[str, str, str], CrossSiteCounts] = {}

    def cell(queue: str, source: str, to: str) -> CrossSiteCounts:
        return cells.setdefault((queue, source, to), CrossSiteCounts())

    for r in pair_rows:
        c = cell(r["queue"], r["home"], r["target"])
        c.messages, c.mirrored = r["messages"], r["mirrored"]
        c.lost, c.in_flight = r["lost"], r["in_flight"]
    for r in settle_rows:
        c = cell(r["queue"], r["settled_at"], r["target"])
        c.settled, c.unsettled_on_mirror = r["settled"], r["unsettled_on_mirror"]
        c.settles_in_flight = r["settles_in_flight"]
    dup_rows = dups.collect()
    duplicated_at: dict[str, int] = {}
    for r in dup_rows:
        cell(r["queue"], r["home"], r["site"]).duplicated += r["copies"]
        duplicated_at[r["site"]] = duplicated_at.get(r["site"], 0) + r["copies"]
    hist = T.lag_histogram(
        judged.where(F.col("lag").isNotNull()).withColumn("origin", home),
        1e12,
        ("origin", "target"),
    ).collect()
    lag_rows: dict[tuple[str, str, str], list[tuple[int, int, float, float]]] = {}
    for r in hist:
        lag_rows.setdefault((r["queue"], r["origin"], r["target"]), []).append(
            (r["bin"], r["n"], r["lo"], r["hi"])
        )
    names = [i.name for i in infos]
    pairs = [(x, t) for x in names for t in names if x != t]
    per_pair: dict[tuple[str, str], CrossSiteCounts] = {p: CrossSiteCounts() for p in pairs}
    per_queue: dict[str, CrossSiteCounts] = {}
    for (queue, source, to), counts in cells.items():
        _add(per_pair[(source, to)], counts)
        _add(per_queue.setdefault(queue, CrossSiteCounts()), counts, _PER_COPY)
    for r in once_rows:
        c = per_queue.setdefault(r["queue"], CrossSiteCounts())
        c.messages, c.mirrored, c.settled = r["messages"], r["mirrored"], r["settled"]
    totals = CrossSiteCounts()
    for counts in per_queue.values():
        _add(totals, counts)

    # Histogram rows grouped by queue and by direction (they add up: percentiles of a sum).
    lag_by_queue: dict[str, list[tuple[int, int, float, float]]] = {}
    lag_by_pair: dict[tuple[str, str], list[tuple[int, int, float, float]]] = {}
    for (queue, source, to), rows in lag_rows.items():
        lag_by_queue.setdefault(queue, []).extend(rows)
        lag_by_pair.setdefault((source, to), []).extend(rows)
    queues = []
    for key in sorted(per_queue):
        vhost, name = split_queue_key(key)
        queues.append(CrossSiteQueue(queue=name, vhost=vhost, counts=per_queue[key],
                                     lag=_stats(lag_by_queue.get(key))))  # fmt: skip
    directions = [
        CrossSiteDirection(
            source=x, target=t, counts=per_pair[(x, t)], acked_until=acked[(x, t)],
            lag=_stats(lag_by_pair.get((x, t))),
        )
        for x, t in pairs
    ]  # fmt: skip
    for info in infos:
        info.duplicated = duplicated_at.get(info.name, 0)
    all_lag = [row for rows in lag_rows.values() for row in rows]
    findings = [
        CrossSiteFinding(
            kind=FindingKind.MIRROR_DUPLICATE,
            queue=split_queue_key(r["queue"])[1],
            vhost=split_queue_key(r["queue"])[0],
            replication_id=r["replication_id"],
            home=r["home"],
            site=r["site"],
            broker=r["broker"],
            copies=r["copies"],
        )
        for r in dup_rows[:MAX_FINDINGS]
    ]
    absent = kind.isin(FindingKind.MIRROR_LOST.value, FindingKind.MIRROR_IN_FLIGHT.value)
    listed = judged.where(absent | (settle_kind == FindingKind.MIRROR_UNSETTLED.value))
    for r in listed.orderBy("queue", "replication_id", "target").limit(MAX_FINDINGS).collect():
        if r["kind"] is not None:
            findings.append(CrossSiteFinding(
                kind=FindingKind(r["kind"]), queue=split_queue_key(r["queue"])[1],
                vhost=split_queue_key(r["queue"])[0], replication_id=r["replication_id"],
                home=r["home"], site=r["home"], target=r["target"], time=r["t_confirm"],
            ))  # fmt: skip
        if r["settle_kind"] == FindingKind.MIRROR_UNSETTLED.value:
            findings.append(CrossSiteFinding(
                kind=FindingKind.MIRROR_UNSETTLED, queue=split_queue_key(r["queue"])[1],
                vhost=split_queue_key(r["queue"])[0],
                replication_id=r["replication_id"], home=r["home"], site=r["settled_at"],
                target=r["target"], time=r["t_settle"],
            ))  # fmt: skip
    verdict, failures = cross_site_verdict(totals, directions)
    return CrossSiteSummary(
        run_id=run,
        verdict=verdict,
        failures=failures,
        sites=infos,
        totals=totals,
        directions=directions,
        queues=queues,
        lag=_stats(all_lag),
        findings=findings[:MAX_FINDINGS],
    )


_PER_COPY = ("lost", "in_flight", "duplicated", "unsettled_on_mirror", "settles_in_flight")
"""The counts that add up over directions (a copy missing or left at one site each)."""


def _add(
    target: CrossSiteCounts, counts: CrossSiteCounts, fields: Sequence[str] | None = None
) -> None:
    for field in fields if fields is not None else CrossSiteCounts.model_fields:
        setattr(target, field, getattr(target, field) + getattr(counts, field))


def _stats(rows: list[tuple[int, int, float, float]] | None) -> LagStats | None:
    if not rows:
        return None
    merged: dict[int, int] = {}
    for b, n, _, _ in rows:
        merged[b] = merged.get(b, 0) + n
    return lag_stats(merged.items(), min(r[2] for r in rows), max(r[3] for r in rows))
