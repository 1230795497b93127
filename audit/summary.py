"""What an audit run reports: the summary model, finding kinds and lag statistics.

Pure Python (no Spark): the job fills these in, the CLI prints them and the
operator will read `summary.json` back with `AuditSummary.model_validate_json`.
Definitions of every count: docs/audit.md.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Sequence

from pydantic import BaseModel, Field


class FindingKind(enum.StrEnum):
    """One row of the findings table is one of these."""

    LOST = "lost"  # confirmed on both disks, absent from the other broker after a failover
    UNREPLICATED = "unreplicated"  # on its origin broker only, no failover since (yet)
    RESENT = "resent"  # a client published the same message id again: another replication id
    REPLICATED_TWICE = "replicated-twice"  # one replication id stored twice by one broker
    REORDERED = "reordered"  # stored after a later message of the same publisher stream
    DIGEST_MISMATCH = "digest-mismatch"  # the brokers hold different bodies for one message
    # The cross-site audit (a DR source and its mirror; audit/cross.py):
    MIRROR_LOST = "mirror-lost"  # confirmed at a site, absent on the other past its acked point
    MIRROR_IN_FLIGHT = "mirror-in-flight"  # absent on the other site, newer than its acked point
    MIRROR_DUPLICATE = "mirror-duplicate"  # one message applied twice by a broker of the mirror
    MIRROR_UNSETTLED = "mirror-unsettled"  # settled at one site, still held by the other


FAILING_KINDS = frozenset(
    {FindingKind.LOST, FindingKind.REPLICATED_TWICE, FindingKind.REORDERED,
     FindingKind.DIGEST_MISMATCH, FindingKind.MIRROR_LOST, FindingKind.MIRROR_DUPLICATE,
     FindingKind.MIRROR_UNSETTLED}
)  # fmt: skip
"""Kinds that make the verdict FAIL; the others are reported and do not."""


class Verdict(enum.StrEnum):
    """PASS: nothing in FAILING_KINDS was found."""

    PASS = "PASS"
    FAIL = "FAIL"


# -- lag: a mergeable log-scale histogram ---------------------------------------------------

LAG_RESOLUTION = 1e-6
"""Lags closer to zero than this (seconds) fall in bin 0."""
LAG_GROWTH = 1.01
"""Each bin is 1 % wider than the one before it: percentiles within 0.5 %."""


def lag_bin(lag: float) -> int:
    """The histogram bin of a lag in seconds (negative bins for negative lags)."""
    magnitude = abs(lag)
    if magnitude < LAG_RESOLUTION:
        return 0
    index = 1 + math.floor(math.log(magnitude / LAG_RESOLUTION) / math.log(LAG_GROWTH))
    return index if lag > 0 else -index


def bin_value(index: int) -> float:
    """A bin's representative lag: the geometric middle of its bounds (0 for bin 0)."""
    if index == 0:
        return 0.0
    magnitude = LAG_RESOLUTION * math.pow(LAG_GROWTH, abs(index) - 0.5)
    return magnitude if index > 0 else -magnitude


class LagStats(BaseModel):
    """Replication lag of a set of messages, in seconds (see docs/audit.md)."""

    count: int
    p50: float
    p95: float
    p99: float
    max: float
    min: float


def lag_stats(bins: Iterable[tuple[int, int]], lo: float, hi: float) -> LagStats | None:
    """Percentiles (nearest rank) from (bin, count) pairs; exact min and max given."""
    ordered = sorted((b, n) for b, n in bins if n)
    total = sum(n for _, n in ordered)
    if not total:
        return None

    def quantile(q: float) -> float:
        rank = max(1, math.ceil(q * total))
        seen = 0
        for b, n in ordered:
            seen += n
            if seen >= rank:
                return min(max(bin_value(b), lo), hi)
        return hi

    return LagStats(
        count=total, p50=quantile(0.50), p95=quantile(0.95), p99=quantile(0.99), max=hi, min=lo
    )


# -- the summary -----------------------------------------------------------------------------


class Counts(BaseModel):
    """Counts for one queue or for all of them."""

    messages: int = Field(0, description="Messages with a confirmed or confirmed-alone record")
    confirmed: int = Field(0, description="... confirmed on both disks")
    confirmed_alone: int = Field(0, description="... confirmed by a degraded active alone")
    replicated: int = Field(0, description="... of which the other broker stored a copy")
    replica_only: int = Field(
        0,
        description="Stored as replicated, with no confirm record anywhere (the active died "
        "before confirming, or before writing its last records)",
    )
    lost: int = 0
    unreplicated_at_end: int = Field(
        0, description="On one broker only and not settled there by the end of the window"
    )
    unreplicated_by_design: int = Field(
        0, description="Confirmed alone and never stored by the other broker"
    )
    unreplicated_unexpected: int = Field(
        0, description="Confirmed on both disks, no record on the other broker, no failover since"
    )
    resent: int = Field(0, description="Extra copies published again by a client")
    replicated_twice: int = Field(0, description="Extra copies of one replication id")
    reordered: int = 0
    digest_mismatch: int = 0


class QueueSummary(BaseModel):
    """One queue's counts and replication lag."""

    queue: str
    vhost: str = Field("/", description="The queue's vhost")
    counts: Counts
    lag: LagStats | None = None


class EpochSummary(BaseModel):
    """An epoch seen in the logs: who was active, from when to when."""

    epoch: int
    active: list[str] = Field(description="Brokers with confirmed records in this epoch")
    first_confirm: float | None = None
    last_confirm: float | None = None
    records: int = 0


class Failover(BaseModel):
    """A change of epoch, and the gap in confirms around it."""

    from_epoch: int
    to_epoch: int
    from_active: list[str]
    to_active: list[str]
    last_confirm_before: float | None
    first_confirm_after: float | None
    gap_seconds: float | None = Field(
        description="first confirm of the new epoch - last confirm of the old one"
    )


class LagBucket(BaseModel):
    """Replication lag of the messages confirmed in one time bucket (all queues)."""

    start: float
    lag: LagStats


class AuditSummary(BaseModel):
    """The result of an audit run, written to the store as `summary.json`."""

    run_id: str
    verdict: Verdict
    failures: list[str] = Field(description="Why the verdict is FAIL (empty for PASS)")
    mode: str = Field(description="full or incremental")
    store: str
    brokers: list[str]
    segments_read: int = Field(description="Segments read by this run")
    segments_total: int = Field(description="Segments audited so far")
    events_read: int = Field(description="Records read by this run")
    window_start: float | None = None
    window_end: float | None = None
    totals: Counts
    queues: list[QueueSummary]
    lag: LagStats | None = None
    lag_over_time: list[LagBucket] = Field(default_factory=list)
    bucket_seconds: float
    epochs: list[EpochSummary] = Field(default_factory=list)
    failovers: list[Failover] = Field(default_factory=list)
    findings_path: str = Field(description="Store key of this run's findings (Parquet)")
    lag_path: str = Field(description="Store key of lag per queue and time bucket (Parquet)")
    seconds: float = Field(0.0, description="Wall time of the run")


def verdict_of(totals: Counts) -> tuple[Verdict, list[str]]:
    """FAIL with its reasons if any failing kind was counted."""
    reasons = [
        f"{value} {label}"
        for value, label in (
            (totals.lost, "confirmed messages lost"),
            (totals.replicated_twice, "copies replicated twice"),
            (totals.reordered, "messages reordered"),
            (totals.digest_mismatch, "bodies differing between the brokers"),
        )
        if value
    ]
    return (Verdict.FAIL if reasons else Verdict.PASS), reasons


# -- the cross-site audit (a DR source and its mirror) ---------------------------------------


class CrossSiteCounts(BaseModel):
    """Counts of the cross-site audit, for one queue or all (docs/audit.md, "Across sites")."""

    messages: int = Field(0, description="Messages confirmed at a site to a client publisher")
    mirrored: int = Field(0, description="... of which the other site holds (or settled) a copy")
    lost: int = Field(0, description="... absent on the other site, older than its acked point")
    in_flight: int = Field(0, description="... absent on the other site, newer than that point")
    duplicated: int = Field(0, description="Extra copies applied by one broker of a mirror")
    settled: int = Field(0, description="Messages settled by a client at one site")
    unsettled_on_mirror: int = Field(
        0, description="... still held by the other site, settled before its acked point"
    )
    settles_in_flight: int = Field(0, description="... still held there, settled after it")


class CrossSiteQueue(BaseModel):
    """One queue of the cross-site audit."""

    queue: str
    vhost: str = Field("/", description="The queue's vhost")
    counts: CrossSiteCounts
    lag: LagStats | None = Field(None, description="Publish at a site -> applied at the other")


class CrossSiteDirection(BaseModel):
    """One direction of the cross-site audit: what `source` did, checked at `target`.

    Messages are counted at their home site (where a client published them), settles
    where a client made them, extra copies at their home (the copies are at `target`).
    """

    source: str = Field(description="A site of the audit: 'a', 'b', ...")
    target: str
    counts: CrossSiteCounts
    lag: LagStats | None = Field(None, description="Publish at source -> applied at target")
    acked_until: float | None = Field(
        None,
        description="Confirm or settle time at source of the newest change of its that "
        "target applied: what is older and absent there is lost, what is newer in flight",
    )


class SiteInfo(BaseModel):
    """One site of the cross-site audit: its store and what its logs show."""

    name: str = Field(description="'a' (--store), then 'b', 'c', ... (each --mirror-store)")
    store: str
    mirror_id: str | None = Field(
        None, description="Its mirror id, named (--site-ids) or told by the logs"
    )
    brokers: list[str]
    segments: int = Field(description="Segments audited so far (this run and carried state)")
    segments_read: int = Field(0, description="... of which this run read (new ones)")
    origins: list[str] = Field(description="Mirror ids of the sites whose events it applied")
    acked_until: float | None = Field(
        None,
        description="Confirm or settle time at this site of the newest change the other site "
        "applied: what is older and absent there is lost, what is newer in flight (with "
        "three sites or more the oldest of its directions' points, None if one has none)",
    )
    duplicated: int = Field(
        0, description="Extra copies its brokers stored of other sites' messages"
    )


class CrossSiteFinding(BaseModel):
    """One message the cross-site audit reports."""

    kind: FindingKind
    queue: str
    vhost: str = Field("/", description="The queue's vhost")
    replication_id: int = Field(description="The message's replication id at its home site")
    home: str | None = Field(None, description="Its home site: where a client published it")
    site: str = Field(
        description="Where it was confirmed (lost, in flight), settled (unsettled) or "
        "copied twice (duplicate)"
    )
    target: str | None = Field(
        None, description="The site that lacks it (lost, in flight) or still holds it (unsettled)"
    )
    time: float | None = None
    broker: str | None = Field(None, description="The mirror's broker (duplicated)")
    copies: int | None = None


class CrossSiteSummary(BaseModel):
    """The result of a cross-site audit run (`audit/cross/<run>/summary.json` in --store)."""

    run_id: str
    verdict: Verdict
    failures: list[str]
    sites: list[SiteInfo]
    totals: CrossSiteCounts
    directions: list[CrossSiteDirection] = Field(
        default_factory=list,
        description="Per ordered pair of sites (a -> b, b -> a; with three a -> b, a -> c, ...)",
    )
    queues: list[CrossSiteQueue]
    lag: LagStats | None = None
    findings: list[CrossSiteFinding] = Field(
        default_factory=list, description="The first findings (all counted in totals)"
    )
    incremental: bool = Field(False, description="Whether the run carried earlier state")
    seconds: float = 0.0


def cross_site_verdict(
    totals: CrossSiteCounts, directions: Sequence[CrossSiteDirection] = ()
) -> tuple[Verdict, list[str]]:
    """FAIL with its reasons if a message was lost, duplicated or left unsettled. With
    three sites or more (more than two directions) each reason says where: `source ->
    target: count` for each direction that has some."""
    where = len(directions) > 2
    other = "another site" if where else "the other site"
    reasons = []
    for field, label in (
        ("lost", f"confirmed messages missing on {other}"),
        ("duplicated", "copies applied twice on a mirror"),
        ("unsettled_on_mirror", f"settled messages still held by {other}"),
    ):
        value = getattr(totals, field)
        if not value:
            continue
        reason = f"{value} {label}"
        if where:
            parts = [f"{d.source} -> {d.target}: {getattr(d.counts, field)}"
                     for d in directions if getattr(d.counts, field)]  # fmt: skip
            reason += f" ({', '.join(parts)})"
        reasons.append(reason)
    return (Verdict.FAIL if reasons else Verdict.PASS), reasons
