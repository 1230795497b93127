"""Incremental runs (watermark in the store) give exactly the results of a full re-run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark")

from audit_scenario import build
from pyspark.sql import SparkSession
from pyspark.testing import assertDataFrameEqual

from twinmq.audit.job import MANIFEST, AuditParams, run_audit
from twinmq.audit.store import Store, ship
from twinmq.audit.summary import AuditSummary

pytestmark = [pytest.mark.spark, pytest.mark.slow]  # a JVM: minutes on 2 cores

PARAMS = AuditParams(block_bits=4, bucket_seconds=2.0)
RUN_FIELDS = {"run_id", "mode", "segments_read", "events_read", "seconds", "findings_path",
              "lag_path"}  # fmt: skip


def _results(
    spark: SparkSession, store: Store, summary: AuditSummary
) -> tuple[Any, dict[str, Any]]:
    findings = spark.read.parquet(store.spark_uri(summary.findings_path))
    return findings, summary.model_dump(exclude=RUN_FIELDS)


def test_incremental_runs_equal_a_full_run(tmp_path: Path, spark: SparkSession) -> None:
    scenario = build()
    store = Store(str(tmp_path / "store"))
    stages = [{"a": 1, "b": 1}, {"a": 1, "b": 4}, {"a": 9, "b": 9}]
    summaries = []
    for upto in stages:
        for directory in scenario.log.write(tmp_path / "brokers", upto=upto).values():
            ship(directory, store)
        summaries.append(run_audit(spark, store, PARAMS))
    assert [s.mode for s in summaries] == ["full", "incremental", "incremental"]
    assert sum(s.events_read for s in summaries) == scenario.log.count()
    assert summaries[-1].segments_read < summaries[-1].segments_total
    manifest = store.read_json(MANIFEST)
    assert len(manifest["segments"]) == summaries[-1].segments_total

    incremental_findings, incremental = _results(spark, store, summaries[-1])
    full = run_audit(spark, store, PARAMS, full=True)
    assert full.mode == "full" and full.events_read == scenario.log.count()
    full_findings, full_summary = _results(spark, store, full)
    assertDataFrameEqual(incremental_findings, full_findings)
    assert incremental == full_summary
    assert full_summary["totals"]["lost"] == 2  # the scenario's faults, as in test_audit_job

    # Nothing new: a run reads nothing and reports the same.
    again = run_audit(spark, store, PARAMS)
    assert (again.mode, again.segments_read, again.events_read) == ("incremental", 0, 0)
    assert _results(spark, store, again)[1] == full_summary


def test_a_segment_shipped_late_makes_the_next_run_full(
    tmp_path: Path, spark: SparkSession
) -> None:
    scenario = build()
    store = Store(str(tmp_path / "store"))
    dirs = scenario.log.write(tmp_path / "brokers")
    late = dirs["a"] / "a-e000001-00000002.jsonl"
    held = late.read_bytes()
    late.unlink()
    for directory in dirs.values():
        ship(directory, store)
    first = run_audit(spark, store, PARAMS)
    late.write_bytes(held)
    ship(dirs["a"], store)
    second = run_audit(spark, store, PARAMS)
    assert (first.mode, second.mode) == ("full", "full")
    assert second.events_read == scenario.log.count()
    assert second.totals.lost == 2


def test_a_run_that_dies_before_its_commit_changes_nothing(
    tmp_path: Path, spark: SparkSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    """State written by a run that never wrote its manifest is never read."""
    scenario = build()
    store = Store(str(tmp_path / "store"))
    for directory in scenario.log.write(tmp_path / "brokers", upto={"a": 1, "b": 1}).values():
        ship(directory, store)
    first = run_audit(spark, store, PARAMS)
    for directory in scenario.log.write(tmp_path / "brokers").values():
        ship(directory, store)

    real = Store.write_json

    def crash(self: Store, key: str, value: Any) -> None:
        if key == MANIFEST:
            raise OSError("killed before the commit")
        real(self, key, value)

    monkeypatch.setattr(Store, "write_json", crash)
    with pytest.raises(OSError, match="before the commit"):
        run_audit(spark, store, PARAMS)
    monkeypatch.undo()
    assert store.read_json(MANIFEST)["globals_run"] == first.run_id  # the watermark held

    after = run_audit(spark, store, PARAMS)
    assert after.mode == "incremental" and after.events_read == scenario.log.count() - (
        first.events_read
    )
    findings, summary = _results(spark, store, after)
    full = run_audit(spark, store, PARAMS, full=True)
    full_findings, full_summary = _results(spark, store, full)
    assertDataFrameEqual(findings, full_findings)
    assert summary == full_summary
    live = {store.read_json(MANIFEST)["globals_run"], *store.read_json(MANIFEST)["blocks"].values()}
    assert set(store.children("audit/state")) == live  # the dead run's state was collected
