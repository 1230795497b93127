"""The cross-site audit's folds and judgement over N sites (DataFrame -> DataFrame).

The state holds one row per message identity `(home, queue, hid)` with, per site `s`
of the audit, what `s` did with it (`<s>_confirm`, `<s>_applied`, ...: mergeable
minima and maxima, `per_message`). The judgement (`judge`) spreads each message over
the sites: one row per (message, site), where the row of every site but its home says
whether that site holds it (lost, in flight) and how late it came, and the row of
every site but the one that settled it first says whether that site still holds it
(unsettled). With two sites this is one comparison per message and direction, as it
always was. Definitions: docs/audit.md, "Across sites".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from pyspark.sql import functions as F

from twinmq.audit import transforms as T
from twinmq.audit.summary import FindingKind

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame

STORED = (T.CONFIRMED, T.CONFIRMED_ALONE, T.REPLICATED)
CONFIRMS = (T.CONFIRMED, T.CONFIRMED_ALONE)
IDENTITY = ("home", "queue", "hid")
SETTLE_IN_FLIGHT = "settle-in-flight"
_MIN = ("confirm", "applied", "settle")
_MAX = ("settle_applied", "local")

Acked = Mapping[tuple[str, str], float | None]
"""(site X, site T) -> the confirm or settle time at X of the newest change of X's that T
applied (`acked_points`)."""


def _min_time(site: str, condition: Column) -> Column:
    return F.min(F.when((F.col("site") == site) & condition, F.col("time")))


def _any(site: str, condition: Column) -> Column:
    return F.max(F.when((F.col("site") == site) & condition, 1).otherwise(0))


def per_message(records: DataFrame, sites: Sequence[str]) -> DataFrame:
    """One row per identity with what each site did with it (mergeable: minima, maxima).

    `<s>_confirm`: first confirm at s of its own message (a client publisher was told);
    `<s>_applied`: first copy s stored of another site's message; `<s>_settle`: first
    settle by a client at s (no origin); `<s>_settle_applied` (0/1): s applied another
    site's settle; `<s>_local` (0/1): s stored its own message (a copy of its passive's
    too).
    """
    own = F.col("home") == F.col("site")
    client, applied = F.col("origin").isNull(), F.col("origin").isNotNull()
    event, stored = F.col("event"), F.col("event").isin(*STORED)
    aggs: list[Column] = []
    for s in sites:
        aggs += [
            _min_time(s, own & event.isin(*CONFIRMS)).alias(f"{s}_confirm"),
            _min_time(s, ~own & stored).alias(f"{s}_applied"),
            _min_time(s, client & (event == T.DEQUEUED)).alias(f"{s}_settle"),
            _any(s, applied & (event == T.DEQUEUED)).alias(f"{s}_settle_applied"),
            _any(s, own & stored).alias(f"{s}_local"),
        ]
    return records.groupBy(*IDENTITY).agg(*aggs)


def merge_messages(parts: list[DataFrame], sites: Sequence[str]) -> DataFrame:
    """Fold per-message rows (carried state and this run's) into one row per identity."""
    frame = parts[0]
    for part in parts[1:]:
        frame = frame.unionByName(part)
    aggs: list[Column] = []
    for s in sites:
        aggs += [F.min(f"{s}_{c}").alias(f"{s}_{c}") for c in _MIN]
        aggs += [F.max(f"{s}_{c}").alias(f"{s}_{c}") for c in _MAX]
    return frame.groupBy(*IDENTITY).agg(*aggs)


def copies(records: DataFrame) -> DataFrame:
    """(site, broker, home, queue, hid, n): copies of another site's message a broker stored."""
    stored = records.where((F.col("home") != F.col("site")) & F.col("event").isin(*STORED))
    return stored.groupBy("site", "broker", *IDENTITY).agg(F.count("*").alias("n"))


def acked_points(messages: DataFrame, sites: Sequence[str]) -> dict[tuple[str, str], float | None]:
    """Per pair of sites (X, T), the confirm or settle time at X of the newest change of
    X's that T applied.

    A site's events reach each other site in the order of its group commits (directly in
    a mesh, forwarded in order around a ring) and a record's time is its batch's
    completion, so T applied everything X did up to that time: absent at T and older
    is lost, absent and newer in flight.
    """
    pairs = [(x, t) for x in sites for t in sites if x != t]
    aggs = []
    for i, (x, t) in enumerate(pairs):
        aggs += [
            F.max(F.when(F.col(f"{t}_applied").isNotNull(), F.col(f"{x}_confirm"))).alias(f"c{i}"),
            F.max(F.when(F.col(f"{t}_settle_applied") > 0, F.col(f"{x}_settle"))).alias(f"s{i}"),
        ]
    row = messages.agg(*aggs).first()
    assert row is not None  # a global aggregate has one row, even over no messages
    points: dict[tuple[str, str], float | None] = {}
    for i, pair in enumerate(pairs):
        values = [v for v in (row[f"c{i}"], row[f"s{i}"]) if v is not None]
        points[pair] = max(values) if values else None
    return points


def _of(site: Column, column: str, sites: Sequence[str]) -> Column:
    """`<site>_<column>` of the site named in `site` (a column)."""
    expr = F.when(site == sites[0], F.col(f"{sites[0]}_{column}"))
    for s in sites[1:]:
        expr = expr.when(site == s, F.col(f"{s}_{column}"))
    return expr


def _acked_of(source: Column, target: Column, acked: Acked) -> Column:
    expr: Column = F.lit(None).cast("double")
    for (x, t), value in acked.items():
        if value is not None:
            expr = F.when((source == x) & (target == t), F.lit(value).cast("double")).otherwise(
                expr
            )
    return expr


def judge(messages: DataFrame, acked: Acked, sites: Sequence[str]) -> DataFrame:
    """One row per (message, site `target`): `queue`, `replication_id` (at home), `home`
    (kept when its home site confirmed it), `t_confirm`, `present` (target is not the
    home and holds or settled a copy), `lag` (target's first copy - the confirm), `kind`
    (lost, in flight or None), `everywhere` (every site but the home holds it), and the
    first client settle's `settled_at`, `t_settle` and `settle_kind` at target (unsettled,
    in flight or None)."""
    home = F.when(_of(F.col("home"), "confirm", sites).isNotNull(), F.col("home"))
    frame = messages.withColumn("judged", home)
    h = F.col("judged")
    # The first settle by a client anywhere (ties: the first site in order).
    first = F.least(*(F.col(f"{s}_settle") for s in sites))
    settled_at: Column = F.lit(None).cast("string")
    for s in reversed(sites):
        settled_at = F.when(F.col(f"{s}_settle") == first, F.lit(s)).otherwise(settled_at)
    frame = frame.withColumn("settled_at", settled_at)

    def present_at(s: str) -> Column:
        return F.col(f"{s}_applied").isNotNull() | (F.col(f"{s}_settle_applied") > 0)

    everywhere: Column = F.lit(True)
    for s in sites:
        everywhere = everywhere & ((h == s) | present_at(s))
    frame = frame.withColumn("everywhere", h.isNotNull() & everywhere)
    frame = frame.withColumn("target", F.explode(F.array(*(F.lit(s) for s in sites))))
    target, st = F.col("target"), F.col("settled_at")
    other = target != h
    present = other & (
        _of(target, "applied", sites).isNotNull() | (_of(target, "settle_applied", sites) > 0)
    )
    t_confirm = _of(h, "confirm", sites)
    ack = _acked_of(h, target, acked)
    kind = (
        F.when(h.isNull() | ~other | present, F.lit(None).cast("string"))
        .when(ack.isNotNull() & (t_confirm <= ack), FindingKind.MIRROR_LOST.value)
        .otherwise(FindingKind.MIRROR_IN_FLIGHT.value)
    )
    # A settle by a client at one site must reach every other site that holds a copy.
    t_settle = _of(st, "settle", sites)
    holds = _of(target, "applied", sites).isNotNull() | (_of(target, "local", sites) > 0)
    settled_there = (_of(target, "settle_applied", sites) > 0) | _of(
        target, "settle", sites
    ).isNotNull()
    settle_ack = _acked_of(st, target, acked)
    settle_kind = (
        F.when(st.isNull() | (target == st) | ~holds | settled_there, F.lit(None).cast("string"))
        .when(settle_ack.isNotNull() & (t_settle <= settle_ack), FindingKind.MIRROR_UNSETTLED.value)
        .otherwise(SETTLE_IN_FLIGHT)
    )
    return frame.select(
        "queue",
        F.col("hid").alias("replication_id"),
        F.col("judged").alias("home"),
        "target",
        t_confirm.alias("t_confirm"),
        F.coalesce(present, F.lit(False)).alias("present"),
        F.when(other, _of(target, "applied", sites) - t_confirm).alias("lag"),
        kind.alias("kind"),
        "everywhere",
        "settled_at",
        t_settle.alias("t_settle"),
        settle_kind.alias("settle_kind"),
    )
