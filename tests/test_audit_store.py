"""The audit store and the shipper: a filesystem store, and S3 against a real moto server."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from twinmq.audit.records import AuditBatch, AuditEvent, AuditRecord  # noqa: E402
from twinmq.audit.schema import arrow_schema  # noqa: E402
from twinmq.audit.store import (  # noqa: E402
    LEDGER,
    SegmentName,
    ShipError,
    ShipReport,
    Store,
    prune_shipped,
    read_ledger,
    segment_to_parquet,
    ship,
)
from twinmq.testing.waiting import wait_for  # noqa: E402


def _line(broker: str, epoch: int, rid: int, event: str = "confirmed", t: float = 1.0) -> str:
    record = AuditRecord(
        broker=broker, epoch=epoch, queue="q", replication_id=(epoch << 40) | rid,
        message_id=None if rid % 2 else f"p:{rid}", digest="" if event == "dequeued" else "ab",
        event=event, time=t,
    )  # fmt: skip
    return record.model_dump_json() + "\n"


def _write_segment(audit_dir: Path, broker: str, epoch: int, seq: int, rids: range) -> Path:
    audit_dir.mkdir(parents=True, exist_ok=True)
    path = audit_dir / f"{broker}-e{epoch:06d}-{seq:08d}.jsonl"
    path.write_text("".join(_line(broker, epoch, r) for r in rids))
    return path


def _read(store: Store, name: SegmentName) -> Any:
    with store.fs.open(store.path(name.key), "rb") as f:
        return pq.read_table(f)


# -- a filesystem store ---------------------------------------------------------------------
def test_shipped_segments_past_retention_are_deleted_and_nothing_else(tmp_path: Path) -> None:
    audit = tmp_path / "audit"
    for seq in (1, 2, 3):
        _write_segment(audit, "a", 1, seq, range(seq * 10, seq * 10 + 3))
    (audit / "a-e000001-00000004.jsonl.open").write_text(_line("a", 1, 99))
    store = Store(str(tmp_path / "store"))
    other = Store(str(tmp_path / "other"))
    assert len(ship(audit, store).shipped) == 3
    _write_segment(audit, "a", 1, 5, range(50, 52))  # closed after the pass: not shipped
    now = (audit / "a-e000001-00000005.jsonl").stat().st_mtime

    young = ShipReport()
    prune_shipped(audit, store, 3600, young, now)
    assert young.deleted == []  # all within the retention
    unknown = ShipReport()
    prune_shipped(audit, other, 0, unknown, now)
    assert unknown.deleted == []  # nothing shipped to that store: an audit needs them all

    report = ShipReport()
    prune_shipped(audit, store, 0, report, now + 1)
    assert report.deleted == ["a-e000001-00000001", "a-e000001-00000002", "a-e000001-00000003"]
    assert sorted(p.name for p in audit.iterdir() if not p.name.startswith(".")) == [
        "a-e000001-00000004.jsonl.open", "a-e000001-00000005.jsonl",
    ]  # fmt: skip
    assert (audit / LEDGER).read_text() == ""  # no line for a segment no longer here
    # The store keeps everything; shipping again ships the new one only, and the newest
    # segment stays once shipped: the broker's next number comes after it, never one
    # already taken in the store.
    assert len(store.segments()) == 3
    assert ship(audit, store).shipped == ["a-e000001-00000005"]
    again = ShipReport()
    prune_shipped(audit, store, 0, again, now + 1)
    assert again.deleted == []
    assert (audit / "a-e000001-00000005.jsonl").exists()


def test_a_segment_the_store_no_longer_holds_is_kept_and_shipped_again(
    tmp_path: Path,
) -> None:
    # The ledger says shipped, but the store at that location was emptied (a bucket
    # re-created, a store volume lost) or now holds other content under the name: the
    # local copy is the only one and must not be deleted.
    audit = tmp_path / "audit"
    for seq in (1, 2, 3, 4):
        _write_segment(audit, "a", 1, seq, range(seq * 10, seq * 10 + 3))
    store = Store(str(tmp_path / "store"))
    assert len(ship(audit, store).shipped) == 4
    store.fs.rm(store.path(SegmentName("a", seq=1, epoch=1).key))  # lost
    other = tmp_path / "elsewhere"
    _write_segment(other, "a", 1, 2, range(77, 78))
    store.write_bytes(
        SegmentName("a", seq=2, epoch=1).key,
        segment_to_parquet(SegmentName("a", seq=2, epoch=1), (other / "a-e000001-00000002.jsonl")
                           .read_bytes()),
    )  # fmt: skip

    report = ShipReport()
    prune_shipped(audit, store, 0, report, 1e12)
    assert report.deleted == ["a-e000001-00000003"]  # held by the store; 4 is the newest
    assert report.missing == ["a-e000001-00000001", "a-e000001-00000002"]
    assert (audit / "a-e000001-00000001.jsonl").exists()
    assert (audit / "a-e000001-00000002.jsonl").exists()
    # Their ledger lines are gone: the next pass ships the lost one again and refuses the
    # one whose name holds other content (as for a reset data directory) until resolved.
    assert read_ledger(audit / LEDGER, store) == {"a-e000001-00000004"}
    with pytest.raises(ShipError, match="other content"):
        ship(audit, store)  # after shipping the lost one
    assert store.exists(SegmentName("a", seq=1, epoch=1).key)
    store.fs.rm(store.path(SegmentName("a", seq=2, epoch=1).key))
    assert ship(audit, store).shipped == ["a-e000001-00000002"]
    again = ShipReport()
    prune_shipped(audit, store, 0, again, 1e12)
    assert again.deleted == ["a-e000001-00000001", "a-e000001-00000002"]
    assert again.missing == []


def test_a_broker_numbers_segments_after_the_newest_kept_one(tmp_path: Path) -> None:
    from twinmq.broker.auditlog import AuditLog

    audit = tmp_path / "audit"
    for seq in (1, 2, 3):
        _write_segment(audit, "a", 1, seq, range(seq, seq + 1))
    store = Store(str(tmp_path / "store"))
    ship(audit, store)
    prune_shipped(audit, store, 0, ShipReport(), 1e12)
    log = AuditLog(audit, "a", lambda: 1, lambda _qid: "q", lambda: False)
    assert log._seq == 4  # not 1: that name is taken in the store


def test_segments_are_shipped_once_as_parquet_with_provenance(tmp_path: Path) -> None:
    audit = tmp_path / "a" / "audit"
    _write_segment(audit, "a", 1, 1, range(1, 4))
    _write_segment(audit, "a", 2, 2, range(1, 3))
    (audit / "a-e000002-00000003.jsonl.open").write_text(_line("a", 2, 9))
    store = Store(str(tmp_path / "store"))

    report = ship(audit, store)
    assert report.shipped == ["a-e000001-00000001", "a-e000002-00000002"]
    assert [s.key for s in store.segments()] == [
        "segments/a/a-e000001-00000001.parquet", "segments/a/a-e000002-00000002.parquet",
    ]  # fmt: skip
    table = _read(store, store.segments()[0])
    assert table.schema.equals(arrow_schema(), check_metadata=False)
    assert table.column("replication_id").to_pylist() == [(1 << 40) | r for r in (1, 2, 3)]
    assert table.column("message_id").to_pylist() == [None, "p:2", None]
    assert table.column("segment_seq").to_pylist() == [1, 1, 1]
    assert table.column("line").to_pylist() == [0, 1, 2]

    again = ship(audit, store)  # idempotent: nothing new
    assert again.shipped == [] and len(again.already) == 2


def test_the_shipper_sidecar_ships_a_last_time_and_exits_on_sigterm(tmp_path: Path) -> None:
    # As PID 1 of a sidecar (the pod sets `command`, no init) SIGTERM must end it, after a
    # last pass for the segment the broker closed on its own way out.
    audit = tmp_path / "a" / "audit"
    _write_segment(audit, "a", 1, 1, range(1, 4))
    store = Store(str(tmp_path / "store"))
    shipper = subprocess.Popen(
        [sys.executable, "-m", "twinmq.cli.audit", "audit-ship", "--store", store.url,
         "--audit-dir", str(audit), "--every", "3600"],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_for("the first pass to ship", store.segments, 60)
        assert len(store.segments()) == 1
        _write_segment(audit, "a", 1, 2, range(4, 6))  # closed by the broker's shutdown
        shipper.terminate()
        assert shipper.wait(timeout=60) == 0
    finally:
        shipper.kill()
    assert [s.key for s in store.segments()] == [
        "segments/a/a-e000001-00000001.parquet", "segments/a/a-e000001-00000002.parquet",
    ]  # fmt: skip


def test_shipping_to_a_second_store_ships_everything_there_too(tmp_path: Path) -> None:
    audit = tmp_path / "audit"
    _write_segment(audit, "a", 1, 1, range(1, 4))
    _write_segment(audit, "a", 1, 2, range(4, 6))
    first, second = Store(str(tmp_path / "first")), Store(str(tmp_path / "second"))
    assert len(ship(audit, first).shipped) == 2

    report = ship(audit, second)
    assert report.shipped == ["a-e000001-00000001", "a-e000001-00000002"]
    assert [s.key for s in second.segments()] == [s.key for s in first.segments()]
    # Each store is remembered on its own; one store named two ways is one store.
    assert ship(audit, first).shipped == ship(audit, second).shipped == []
    assert ship(audit, Store("file://" + str(tmp_path / "second"))).shipped == []


def test_a_ledger_line_without_a_store_is_checked_in_the_store(tmp_path: Path) -> None:
    audit = tmp_path / "audit"
    _write_segment(audit, "a", 1, 1, range(1, 4))
    (audit / ".shipped").write_text("a-e000001-00000001\n")  # written before stores were named
    store = Store(str(tmp_path / "store"))
    assert ship(audit, store).shipped == ["a-e000001-00000001"]
    assert ship(audit, store).already == ["a-e000001-00000001"]


def test_two_brokers_and_epochs_never_collide(tmp_path: Path) -> None:
    store = Store("file://" + str(tmp_path / "store"))
    for broker in ("a", "b"):
        for epoch, seq in ((1, 1), (2, 2), (2, 3)):
            _write_segment(tmp_path / broker, broker, epoch, seq, range(seq, seq + 2))
        ship(tmp_path / broker, store)
    assert len({s.key for s in store.segments()}) == 6


def test_a_lost_ledger_is_rebuilt_by_digest_and_reused_names_are_refused(tmp_path: Path) -> None:
    audit = tmp_path / "audit"
    _write_segment(audit, "a", 1, 1, range(1, 4))
    store = Store(str(tmp_path / "store"))
    ship(audit, store)
    (audit / ".shipped").unlink()  # crash between the upload and the ledger
    assert ship(audit, store).already == ["a-e000001-00000001"]

    # A wiped data directory starts its sequence again: same name, other content.
    (audit / ".shipped").unlink()
    _write_segment(audit, "a", 1, 1, range(7, 9))
    with pytest.raises(ShipError, match="other content"):
        ship(audit, store)
    assert _read(store, store.segments()[0]).num_rows == 3  # never replaced


def test_a_crash_mid_write_leaves_nothing_visible(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    audit = tmp_path / "audit"
    _write_segment(audit, "a", 1, 1, range(1, 4))
    store = Store(str(tmp_path / "store"))

    def crash(src: object, dst: object) -> None:
        raise OSError("power cut")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="power cut"):
        ship(audit, store)
    monkeypatch.undo()
    assert store.segments() == []
    assert not list((tmp_path / "store").rglob("*.parquet"))
    assert ship(audit, store).shipped == ["a-e000001-00000001"]  # shipped on the next pass


def test_a_malformed_segment_is_refused(tmp_path: Path) -> None:
    audit = tmp_path / "audit"
    audit.mkdir()
    (audit / "a-e000001-00000001.jsonl").write_text('{"broker": "a", "nonsense": 1}\n')
    with pytest.raises(ShipError):
        ship(audit, Store(str(tmp_path / "store")))


def test_manifest_json_is_replaced_atomically(tmp_path: Path) -> None:
    store = Store(str(tmp_path))
    store.write_json("audit/manifest.json", {"run": 1})
    store.write_json("audit/manifest.json", {"run": 2})
    assert store.read_json("audit/manifest.json") == {"run": 2}
    assert store.read_json("audit/missing.json") is None
    assert [p.name for p in (tmp_path / "audit").iterdir()] == ["manifest.json"]


# -- S3 through a real S3-compatible server (moto in server mode) ----------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`moto_server` as a child process on loopback; yields its endpoint URL."""
    pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    port = _free_port()
    log = open(tmp_path_factory.mktemp("moto") / "moto.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip

    def serving() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        except OSError:
            return False
        return True

    try:
        wait_for("the moto server to listen", serving, 30)
    except TimeoutError:
        proc.kill()
        raise
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


def s3_options(endpoint: str) -> dict[str, Any]:
    """s3fs options for the local moto server (its fixed test credentials)."""
    return {
        "key": "testing", "secret": "testing",
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
    }  # fmt: skip


@pytest.fixture
def s3_store(s3_server: str, request: pytest.FixtureRequest) -> Store:
    """A fresh bucket on the moto server, as a store with a prefix."""
    bucket = "audit-" + request.node.name.replace("_", "-")[:40].lower()
    _s3_client(s3_server).create_bucket(Bucket=bucket)
    return Store(f"s3://{bucket}/pair-1", s3_options(s3_server))


def _s3_client(endpoint: str) -> Any:
    import boto3

    return boto3.client(
        "s3", aws_access_key_id="testing", aws_secret_access_key="testing",
        endpoint_url=endpoint, region_name="us-east-1",
    )  # fmt: skip


def test_s3_store_ships_lists_and_is_idempotent(tmp_path: Path, s3_store: Store) -> None:
    for broker in ("a", "b"):
        _write_segment(tmp_path / broker, broker, 1, 1, range(1, 5))
        _write_segment(tmp_path / broker, broker, 2, 2, range(1, 3))
        assert len(ship(tmp_path / broker, s3_store).shipped) == 2
    names = s3_store.segments()
    assert [n.stem for n in names] == [
        "a-e000001-00000001", "a-e000002-00000002", "b-e000001-00000001", "b-e000002-00000002",
    ]  # fmt: skip
    assert _read(s3_store, names[0]).num_rows == 4
    (tmp_path / "a" / ".shipped").unlink()
    assert ship(tmp_path / "a", s3_store).already == [n.stem for n in names[:2]]
    s3_store.write_json("audit/manifest.json", {"run": "x"})
    assert s3_store.read_json("audit/manifest.json") == {"run": "x"}
    assert json.loads(s3_store.read_bytes("audit/manifest.json")) == {"run": "x"}


def test_s3_an_interrupted_multipart_upload_is_never_visible(s3_store: Store) -> None:
    """What a crash mid-upload leaves on S3: an incomplete multipart upload, not an object."""
    name = SegmentName("a", seq=1, epoch=1)
    bucket, prefix = s3_store.root.split("/", 1)
    client = _s3_client(s3_store.storage_options["client_kwargs"]["endpoint_url"])
    key = f"{prefix}/{name.key}"
    upload = client.create_multipart_upload(Bucket=bucket, Key=key)
    client.upload_part(
        Bucket=bucket, Key=key, UploadId=upload["UploadId"], PartNumber=1, Body=b"x" * 1024
    )
    # The shipper crashed here: the upload is never completed.
    assert s3_store.segments() == []
    assert not s3_store.exists(name.key)
    assert client.list_multipart_uploads(Bucket=bucket)["Uploads"]


@pytest.mark.spark
@pytest.mark.slow
def test_the_audit_job_reads_and_writes_an_s3_store(
    tmp_path: Path, s3_store: Store, spark: Any
) -> None:
    """The whole audit against the S3 store: segments in, state and results out."""
    from audit_scenario import build

    from twinmq.audit.job import MANIFEST, AuditParams, run_audit
    from twinmq.audit.summary import AuditSummary

    scenario = build()
    for directory in scenario.log.write(tmp_path / "brokers", upto={"a": 1, "b": 1}).values():
        ship(directory, s3_store)
    params = AuditParams(block_bits=4, bucket_seconds=2.0)
    first = run_audit(spark, s3_store, params, work_dir=tmp_path / "work1")
    for directory in scenario.log.write(tmp_path / "brokers").values():
        ship(directory, s3_store)
    summary = run_audit(spark, s3_store, params, work_dir=tmp_path / "work2")
    assert (first.mode, summary.mode) == ("full", "incremental")
    t = summary.totals
    assert (t.lost, t.resent, t.replicated_twice, t.reordered, t.digest_mismatch) == (2, 1, 1, 1, 1)
    assert AuditSummary.model_validate_json(s3_store.read_bytes("audit/latest.json")) == summary
    assert s3_store.read_json(MANIFEST)["globals_run"] == summary.run_id
    findings = s3_store.keys(summary.findings_path)
    assert any(k.endswith(".parquet") for k in findings)
    with s3_store.fs.open(s3_store.path(summary.lag_path), "rb") as f:
        assert pq.read_table(f).num_rows > 0


def test_both_line_formats_ship_as_the_same_records_in_log_order(tmp_path: Path) -> None:
    # Format 1 (a record per line, still read) and format 2 (a batch per line), mixed.
    audit = tmp_path / "a" / "audit"
    audit.mkdir(parents=True)
    batch = AuditBatch(
        broker="a", epoch=1, queue="q", event=AuditEvent.CONFIRMED, time=1.0,
        replication_ids=[(1 << 40) | 2, (1 << 40) | 3], message_ids=[None, "p:3"],
        digests=["0000000b", "0000000c"],
    )  # fmt: skip
    dequeued = AuditBatch(
        broker="a", epoch=1, queue="q", event=AuditEvent.DEQUEUED, time=2.0,
        replication_ids=[(1 << 40) | 1, (1 << 40) | 2],
    )  # fmt: skip
    (audit / "a-e000001-00000001.jsonl").write_text(
        _line("a", 1, 1) + batch.model_dump_json(exclude_none=True) + "\n"
        + dequeued.model_dump_json(exclude_none=True) + "\n"
    )  # fmt: skip
    store = Store(str(tmp_path / "store"))
    ship(audit, store)
    rows = _read(store, store.segments()[0]).to_pylist()
    assert [(r["replication_id"] & 0xFF, r["event"], r["line"]) for r in rows] == [
        (1, "confirmed", 0), (2, "confirmed", 1), (3, "confirmed", 2),
        (1, "dequeued", 3), (2, "dequeued", 4),
    ]  # fmt: skip
    assert [(r["message_id"], r["digest"]) for r in rows] == [
        (None, "ab"), (None, "0000000b"), ("p:3", "0000000c"), (None, ""), (None, ""),
    ]  # fmt: skip


def test_format_3_lines_ship_as_the_records_their_runs_and_hex_digests_stand_for(
    tmp_path: Path,
) -> None:
    # Format 3 (ids as [first, count] runs, digests as one hex string) after format 2.
    audit = tmp_path / "a" / "audit"
    audit.mkdir(parents=True)
    listed = AuditBatch(
        broker="a", epoch=1, queue="q", event=AuditEvent.CONFIRMED, time=1.0,
        replication_ids=[1, 2], digests=["0000000b", "0000000c"],
    )  # fmt: skip
    runs = AuditBatch(
        broker="a", epoch=1, queue="q", event=AuditEvent.CONFIRMED, time=2.0,
        replication_id_runs=[(3, 2), (9, 1)], message_ids=["p:3", None, "p:9"],
        digests_hex="0000000d0000000e0000000f",
    )  # fmt: skip
    dequeued = AuditBatch(
        broker="a", epoch=1, queue="q", event=AuditEvent.DEQUEUED, time=3.0,
        replication_id_runs=[(1, 3)],
    )  # fmt: skip
    (audit / "a-e000001-00000001.jsonl").write_text(
        "".join(b.model_dump_json(exclude_none=True) + "\n" for b in (listed, runs, dequeued))
    )
    store = Store(str(tmp_path / "store"))
    ship(audit, store)
    rows = _read(store, store.segments()[0]).to_pylist()
    assert [(r["replication_id"], r["event"], r["message_id"], r["digest"]) for r in rows] == [
        (1, "confirmed", None, "0000000b"), (2, "confirmed", None, "0000000c"),
        (3, "confirmed", "p:3", "0000000d"), (4, "confirmed", None, "0000000e"),
        (9, "confirmed", "p:9", "0000000f"),
        (1, "dequeued", None, ""), (2, "dequeued", None, ""), (3, "dequeued", None, ""),
    ]  # fmt: skip
    assert [r["line"] for r in rows] == list(range(8))


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ('"replication_id_runs":[[1,2]],"digests_hex":"0000000b"', "digests does not match"),
        ('"replication_id_runs":[[1,2]],"digests_hex":"0000000b000c"', "8 hex digits"),
        ('"replication_id_runs":[[1,0]]', "not a \\[first, count\\] pair"),
        ('"replication_ids":[1],"replication_id_runs":[[1,1]]', "exactly one of"),
        ('"replication_ids":[1],"digests":["0000000b"],"digests_hex":"0000000b"', "both"),
    ],
)
def test_a_format_3_line_of_the_wrong_shape_is_refused(
    tmp_path: Path, fields: str, error: str
) -> None:
    audit = tmp_path / "a" / "audit"
    audit.mkdir(parents=True)
    (audit / "a-e000001-00000001.jsonl").write_text(
        '{"broker":"a","epoch":1,"queue":"q","event":"confirmed","time":1.0,' + fields + "}\n"
    )
    with pytest.raises(ShipError, match=error):
        ship(audit, Store(str(tmp_path / "store")))


def test_a_batch_line_whose_lists_disagree_is_refused(tmp_path: Path) -> None:
    audit = tmp_path / "a" / "audit"
    audit.mkdir(parents=True)
    (audit / "a-e000001-00000001.jsonl").write_text(
        '{"broker":"a","epoch":1,"queue":"q","event":"confirmed","time":1.0,'
        '"replication_ids":[1,2],"digests":["0000000b"]}\n'
    )
    with pytest.raises(ShipError, match="digests does not match"):
        ship(audit, Store(str(tmp_path / "store")))
