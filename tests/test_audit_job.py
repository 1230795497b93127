"""The audit job on synthetic logs with exactly known faults: all found, nothing else."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark")

from audit_scenario import Scenario, build
from pyspark.sql import Row, SparkSession
from pyspark.sql import functions as F
from pyspark.testing import assertDataFrameEqual

from twinmq.audit import transforms as T
from twinmq.audit.job import AuditParams, run_audit
from twinmq.audit.store import Store, ship
from twinmq.audit.summary import AuditSummary, LagStats, Verdict

pytestmark = [pytest.mark.spark, pytest.mark.slow]  # a JVM: minutes on 2 cores

PARAMS = AuditParams(block_bits=4, bucket_seconds=2.0)


def audited(tmp_path: Path, spark: SparkSession, scenario: Scenario) -> tuple[Store, AuditSummary]:
    """Write the scenario's logs, ship them, run the audit."""
    store = Store(str(tmp_path / "store"))
    for directory in scenario.log.write(tmp_path / "brokers").values():
        ship(directory, store)
    return store, run_audit(spark, store, PARAMS)


@pytest.fixture(scope="module")
def result(
    tmp_path_factory: pytest.TempPathFactory, spark: SparkSession
) -> tuple[Scenario, Store, AuditSummary]:
    scenario = build()
    store, summary = audited(tmp_path_factory.mktemp("audit"), spark, scenario)
    return scenario, store, summary


def test_every_injected_fault_is_found_and_nothing_else(
    spark: SparkSession, result: tuple[Scenario, Store, AuditSummary]
) -> None:
    scenario, store, summary = result
    findings = spark.read.parquet(store.spark_uri(summary.findings_path))
    expected = spark.createDataFrame(
        [
            Row(kind=k, queue=q, broker=b, replication_id=r)
            for k, q, b, r in scenario.expected.findings
        ],
        "kind string, queue string, broker string, replication_id long",
    )
    assertDataFrameEqual(findings.select("kind", "queue", "broker", "replication_id"), expected)


def test_finding_details(spark: SparkSession, result: tuple[Scenario, Store, AuditSummary]) -> None:
    _, store, summary = result
    found = spark.read.parquet(store.spark_uri(summary.findings_path)).collect()
    rows = {(r["kind"], r["message_id"]): r for r in found if r["message_id"] is not None}
    reorder = rows[("reordered", "p1:35")]
    assert (reorder["stream"], reorder["seq"], reorder["after_seq"]) == ("p1", 35, 36)
    resent = rows[("resent", "p1:20")]
    assert resent["copies"] == 1 and resent["first_replication_id"] < resent["replication_id"]
    assert rows[("replicated-twice", "p1:25")]["copies"] == 1
    unreplicated = sorted((r["event"], r["settled"]) for r in found if r["kind"] == "unreplicated")
    assert unreplicated == [
        ("confirmed", False), ("confirmed-alone", False), ("confirmed-alone", True),
    ]  # fmt: skip
    assert {r["settled"] for r in found if r["kind"] == "lost"} == {True}  # discarded on `a`


def test_summary_counts_and_verdict(result: tuple[Scenario, Store, AuditSummary]) -> None:
    scenario, store, summary = result
    e = scenario.expected
    t = summary.totals
    assert summary.verdict == Verdict.FAIL
    assert (t.lost, t.resent, t.replicated_twice, t.reordered, t.digest_mismatch) == (2, 1, 1, 1, 1)
    assert (t.unreplicated_at_end, t.unreplicated_by_design, t.unreplicated_unexpected) == (2, 2, 1)
    assert (t.messages, t.confirmed, t.confirmed_alone, t.replicated) == (
        e.messages, e.confirmed, e.confirmed_alone, e.replicated,
    )  # fmt: skip
    assert {q.queue for q in summary.queues} == {"q1", "q2"}
    q1 = next(q for q in summary.queues if q.queue == "q1")
    assert (q1.counts.lost, q1.counts.reordered, q1.counts.resent) == (2, 1, 1)
    assert summary.brokers == ["a", "b"]
    assert summary.events_read == scenario.log.count()
    assert AuditSummary.model_validate_json(store.read_bytes("audit/latest.json")) == summary


def _close(actual: LagStats | None, values: list[float]) -> None:
    assert actual is not None
    ordered = sorted(values)

    def rank(q: float) -> float:
        return ordered[max(1, math.ceil(q * len(ordered))) - 1]

    assert actual.count == len(values)
    assert actual.max == pytest.approx(max(values), abs=1e-9)
    assert actual.min == pytest.approx(min(values), abs=1e-9)
    for q, got in ((0.5, actual.p50), (0.95, actual.p95), (0.99, actual.p99)):
        assert got == pytest.approx(rank(q), rel=0.006, abs=1e-6), q


def test_lag_percentiles(result: tuple[Scenario, Store, AuditSummary]) -> None:
    scenario, _, summary = result
    _close(summary.lag, scenario.expected.lags)
    for q in summary.queues:
        _close(q.lag, scenario.expected.lags_by_queue[q.queue])
    assert summary.lag is not None and summary.lag.max == pytest.approx(2.0 + 0.01 * 6, abs=0.02)
    assert len(summary.lag_over_time) >= 2
    assert sum(b.lag.count for b in summary.lag_over_time) == len(scenario.expected.lags)


def test_epochs_and_failover(result: tuple[Scenario, Store, AuditSummary]) -> None:
    scenario, _, summary = result
    assert [(e.epoch, e.active) for e in summary.epochs] == [(1, ["a"]), (2, ["b"])]
    (failover,) = summary.failovers
    assert (failover.from_active, failover.to_active) == (["a"], ["b"])
    assert failover.gap_seconds == pytest.approx(3.0, abs=1e-6)
    assert failover.last_confirm_before == pytest.approx(scenario.expected.last_confirm_e1)


def test_a_clean_log_passes(tmp_path: Path, spark: SparkSession) -> None:
    scenario = Scenario()
    for n in range(1, 50):
        scenario.guarded(1, "a", "b", "q", f"p:{n}")
    _, summary = audited(tmp_path, spark, scenario)
    assert summary.verdict == Verdict.PASS and summary.failures == []
    assert summary.totals.messages == 49 and summary.totals.replicated == 49


# -- single transforms -------------------------------------------------------------------------


def _events(spark: SparkSession, rows: list[tuple[Any, ...]]) -> Any:
    from twinmq.audit.schema import spark_schema

    # Rows give the record's fields before `origin` and provenance: a pair's logs have no
    # DR fields (`origin`, `message_origin`, `origin_id`), and their queues are `/`'s.
    return spark.createDataFrame([(*r[:-2], None, None, None, None, *r[-2:]) for r in rows],
                                 spark_schema())  # fmt: skip


def test_stream_copies_and_reorders(spark: SparkSession) -> None:
    E1 = 1 << 40
    events = _events(
        spark,
        [
            ("a", 1, "q", E1 | 1, "p:2", "d", "confirmed", 1.0, 1, 0),
            ("a", 1, "q", E1 | 2, "p:1", "d", "confirmed", 1.0, 1, 1),
            ("a", 1, "q", E1 | 3, "uuid-like-0001", "d", "confirmed", 1.0, 1, 2),
            ("a", 1, "q", E1 | 4, None, "d", "confirmed", 1.0, 1, 3),
        ],
    )
    copies = T.stream_copies(T.message_aggregates(events, ["a", "b"]), T.DEFAULT_STREAM_PATTERN)
    assertDataFrameEqual(
        copies.select("replication_id", "stream", "seq"),
        [
            Row(replication_id=E1 | 1, stream="p", seq=2),
            Row(replication_id=E1 | 2, stream="p", seq=1),
            Row(replication_id=E1 | 3, stream="", seq=E1 | 3),
            Row(replication_id=E1 | 4, stream="", seq=E1 | 4),
        ],
    )
    state = spark.createDataFrame([], T.STREAM_STATE_SCHEMA)
    found, new_state = T.find_reorders(copies, state, ["a", "b"])
    assertDataFrameEqual(
        found.select("replication_id", "seq", "after_seq"),
        [Row(replication_id=E1 | 2, seq=1, after_seq=2)],
    )
    assertDataFrameEqual(new_state.select("max_seq"), [Row(max_seq=2), Row(max_seq=E1 | 4)])


def test_digests_of_one_kind_are_compared_and_of_two_kinds_are_not(spark: SparkSession) -> None:
    # CRC-32 digests (8 hex digits) since format 2, BLAKE2b-64 (16) before: a message
    # recorded by an old and a new broker (an upgrade) has one of each, never comparable.
    E1 = 1 << 40
    crc, crc2, blake, blake2 = "0000000a", "0000000b", "00000000000000aa", "00000000000000bb"
    pairs = {1: (crc, crc), 2: (crc, crc2), 3: (blake, crc), 4: (blake, blake2), 5: (crc, "")}
    rows = []
    for n, (on_a, on_b) in pairs.items():
        rows.append(("a", 1, "q", E1 | n, None, on_a, "confirmed", 1.0, 1, n))
        rows.append(("b", 1, "q", E1 | n, None, on_b, "replicated", 1.0, 1, n))
    events = _events(spark, rows)
    for aggregates in (
        T.message_aggregates(events, ["a", "b"]),
        T.merge_aggregates(T.partial_aggregates(events, ["a", "b"])),
    ):
        differ = aggregates.where(T.digests_differ(F.col("digest_min"), F.col("digest_max")))
        assert sorted(r["replication_id"] for r in differ.collect()) == [E1 | 2, E1 | 4]
