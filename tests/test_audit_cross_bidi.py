"""The cross-site audit of two bidirectional sites, run incrementally, on real brokers.

Two real sites both writable, each mirroring to the other (`mirrorsites.Ring`, audit
segments closed every second): clients publish with confirms on both at once to one
queue, and consume and ack on both (a settle on one site settles the message on the
other, whichever site published it). Each site's audit log is shipped to its store
and audited with real Spark, twice: after a first stage of traffic, then after a
second one, the second run reading only the new segments plus the carried state;
it says what a from-scratch run over every segment says, and a run that dies before
its manifest changes nothing. Then one applied copy is removed from each site's
store: exactly one loss per direction is found.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark")

import pika
import pyarrow as pa
import pyarrow.parquet as pq
from mirrorsites import Ring, channel, publish_counted, take
from pyspark.sql import SparkSession

from twinmq.audit.cross import MANIFEST, PREFIX, run_cross_site
from twinmq.audit.store import Store, ship
from twinmq.audit.summary import CrossSiteSummary, FindingKind, Verdict

pytestmark = [pytest.mark.spark, pytest.mark.slow]  # a JVM, two broker sites, five runs

QUEUE = "orders"
SITE_IDS = {"a": "site-a", "b": "site-b"}
_PERSISTENT = pika.BasicProperties(delivery_mode=2)


def _traffic(ring: Ring, stage: int, counts: dict[str, int]) -> None:
    """Both sites publish at once (their batches mix with what they apply), then consume."""
    a, b = ring.sites
    confirmed = {"a": [0], "b": [0]}
    threads = [
        threading.Thread(
            target=publish_counted, args=(site, QUEUE, f"{name}{stage}", 300, confirmed[name])
        )
        for name, site in (("a", a), ("b", b))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    ring.caught_up()
    counts["consumed"] += take(a, QUEUE, 40) + take(b, QUEUE, 40)
    ring.caught_up()
    for name in ("a", "b"):
        counts[name] += confirmed[name][0]


def _ship(root: Path, stores: tuple[Store, Store]) -> None:
    for name, store in zip(("site-a", "site-b"), stores, strict=True):
        ship(root / name / "data" / "audit", store)


class Crash(RuntimeError):
    """The run dies before its commit."""


@pytest.fixture(scope="module")
def audited(tmp_path_factory: pytest.TempPathFactory, spark: SparkSession) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("bidi-audit")
    stores = (Store(str(root / "store-a")), Store(str(root / "store-b")))
    counts = {"a": 0, "b": 0, "consumed": 0}
    with Ring(root, 2, extra_args=["--audit-segment-seconds", "1"]) as ring:
        _traffic(ring, 1, counts)
        time.sleep(2.5)  # the segments age out and close (checked every second)
        _ship(root, stores)
        first = run_cross_site(spark, *stores)
        _traffic(ring, 2, counts)
    _ship(root, stores)  # the brokers closed their last segments as they stopped
    # A run that dies before writing its manifest (its state is written by then).
    original = Store.write_json

    def crash(self: Store, key: str, value: Any) -> None:
        if key == MANIFEST:
            raise Crash(key)
        original(self, key, value)

    patch = pytest.MonkeyPatch()
    patch.setattr(Store, "write_json", crash)
    with pytest.raises(Crash):
        run_cross_site(spark, *stores, run_id="crashed")
    patch.undo()
    assert stores[0].children(f"{PREFIX}/state") != [first.run_id]  # its files are there
    second = run_cross_site(spark, *stores)
    return {"root": root, "stores": stores, "counts": counts, "first": first, "second": second}


def _show(summary: CrossSiteSummary) -> None:
    print(summary.model_dump_json(indent=1))  # shown on failure


def _comparable(summary: CrossSiteSummary) -> dict[str, Any]:
    data = summary.model_dump(exclude={"run_id", "seconds", "incremental"})
    for site in data["sites"]:
        site.pop("segments_read")
    return data


def test_two_writable_sites_audit_pass_in_both_directions(audited: dict[str, Any]) -> None:
    summary: CrossSiteSummary = audited["second"]
    counts = audited["counts"]
    _show(summary)
    t = summary.totals
    assert summary.verdict == Verdict.PASS, summary.failures
    assert (t.lost, t.duplicated, t.unsettled_on_mirror, t.in_flight) == (0, 0, 0, 0)
    assert t.messages == t.mirrored == counts["a"] + counts["b"] == 1200
    by = {d.source: d for d in summary.directions}
    assert (by["a"].target, by["b"].target) == ("b", "a")
    assert by["a"].counts.messages == counts["a"] and by["b"].counts.messages == counts["b"]
    assert by["a"].lag is not None and by["b"].lag is not None
    assert by["a"].lag.count == counts["a"] and by["b"].lag.count == counts["b"]
    # A client's settle batched with an apply is recorded as applied (docs/audit.md):
    # counted settles are at most the consumed ones, and none is left unsettled.
    assert 0 < t.settled <= counts["consumed"] and t.settles_in_flight == 0
    assert summary.sites[0].origins == ["site-b"] and summary.sites[1].origins == ["site-a"]


def test_an_incremental_run_reads_only_new_segments_and_equals_a_full_run(
    audited: dict[str, Any], spark: SparkSession
) -> None:
    first: CrossSiteSummary = audited["first"]
    second: CrossSiteSummary = audited["second"]
    a, b = audited["stores"]
    assert not first.incremental and second.incremental
    assert all(0 < s.segments_read < s.segments for s in second.sites)
    assert all(s.segments_read + f.segments == s.segments
               for s, f in zip(second.sites, first.sites, strict=True))  # fmt: skip
    # The crashed run's state was never referenced, and was collected after the commit.
    assert a.read_json(MANIFEST)["state_run"] == second.run_id
    assert a.children(f"{PREFIX}/state") == [second.run_id]
    full = run_cross_site(spark, a, b, full=True)
    assert not full.incremental and all(s.segments_read == s.segments for s in full.sites)
    assert _comparable(full) == _comparable(second)
    # Nothing new: a run reads nothing and says the same.
    again = run_cross_site(spark, a, b)
    assert again.incremental and all(s.segments_read == 0 for s in again.sites)
    assert _comparable(again) == _comparable(full)


def _without_a_copy(store: Store, home: str, root: Path) -> tuple[Store, int]:
    """`store` with every record of one copy it applied of `home`'s messages removed; the
    message's id at home."""
    tables = {s.key: pq.read_table(store.path(s.key)) for s in store.segments()}
    applied = [
        (table["replication_id"][i].as_py(), table["origin_id"][i].as_py())
        for table in tables.values()
        for i, (morigin, event) in enumerate(
            zip(table["message_origin"].to_pylist(), table["event"].to_pylist(), strict=True)
        )
        if morigin == SITE_IDS[home] and event in ("confirmed", "confirmed-alone")
    ]
    local, hid = applied[len(applied) // 3]  # a first-stage message: long acknowledged
    altered = Store(str(root / f"{store.location.rsplit('/', 1)[-1]}-altered"))
    for key, table in tables.items():
        keep = [r != local for r in table["replication_id"].to_pylist()]
        table = table.filter(pa.array(keep, type=pa.bool_()))
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink)
        altered.write_bytes(key, sink.getvalue().to_pybytes())
    return altered, hid


def test_a_copy_lost_in_each_direction_is_found_and_nothing_else(
    audited: dict[str, Any], spark: SparkSession, tmp_path: Path
) -> None:
    a, b = audited["stores"]
    b_altered, from_a = _without_a_copy(b, "a", tmp_path)  # A's message, missing on B
    a_altered, from_b = _without_a_copy(a, "b", tmp_path)  # B's message, missing on A
    summary = run_cross_site(spark, a_altered, b_altered)
    _show(summary)
    t = summary.totals
    assert summary.verdict == Verdict.FAIL
    assert (t.lost, t.duplicated, t.unsettled_on_mirror, t.in_flight) == (2, 0, 0, 0)
    found = {(f.kind, f.home, f.replication_id) for f in summary.findings}
    assert found == {(FindingKind.MIRROR_LOST, "a", from_a), (FindingKind.MIRROR_LOST, "b", from_b)}
    assert [d.counts.lost for d in summary.directions] == [1, 1]


def test_empty_stores_audit_pass_and_their_empty_state_carries(
    spark: SparkSession, tmp_path: Path
) -> None:
    a, b = Store(str(tmp_path / "a")), Store(str(tmp_path / "b"))
    first = run_cross_site(spark, a, b)
    second = run_cross_site(spark, a, b)
    assert (first.incremental, second.incremental) == (False, True)
    assert second.verdict == Verdict.PASS and second.totals.messages == 0


def test_a_copy_dead_lettered_by_a_consumer_of_the_other_site_is_no_loss(
    spark: SparkSession, tmp_path: Path
) -> None:
    # A's messages, rejected by a consumer on B into a dead-letter queue: the dead-lettered
    # copy is a new message of B's (docs/audit.md), confirmed there and mirrored to A,
    # and the rejects are B's settles of A's messages; nothing is lost or left unsettled.
    stores = (Store(str(tmp_path / "store-a")), Store(str(tmp_path / "store-b")))
    with Ring(tmp_path, 2, extra_args=["--audit-segment-seconds", "1"]) as ring:
        a, b = ring.sites
        connection, ch = channel(a)
        ch.queue_declare("dead", durable=True)
        ch.queue_declare("work", durable=True, arguments={
            "x-dead-letter-exchange": "", "x-dead-letter-routing-key": "dead",
        })  # fmt: skip
        ch.confirm_delivery()
        for i in range(10):
            ch.basic_publish("", "work", f"w-{i}".encode(), _PERSISTENT)
        connection.close()
        ring.caught_up()
        connection, ch = channel(b)
        rejected = 0
        while (got := ch.basic_get("work"))[0] is not None:
            ch.basic_reject(got[0].delivery_tag, requeue=False)
            rejected += 1
        connection.close()
        assert rejected == 10
        ring.caught_up()
        # Later traffic both ways: each site's acknowledged point passes the moves.
        counts = {"a": 0, "b": 0, "consumed": 0}
        _traffic(ring, 1, counts)
        time.sleep(2.5)
    for name, store in zip(("site-a", "site-b"), stores, strict=True):
        ship(tmp_path / name / "data" / "audit", store)
    summary = run_cross_site(spark, *stores)
    _show(summary)
    t = summary.totals
    assert summary.verdict == Verdict.PASS, summary.failures
    assert (t.lost, t.duplicated, t.unsettled_on_mirror, t.in_flight) == (0, 0, 0, 0)
    assert t.messages == t.mirrored == counts["a"] + counts["b"] + 2 * rejected
