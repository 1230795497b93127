"""The broker's audit log: records follow the shared schema, segments rotate and close."""

from __future__ import annotations

import re
import struct
from pathlib import Path

import pytest

from twinmq.audit.records import (
    AuditEvent,
    AuditRecord,
    SegmentFormatError,
    body_digest,
    segment_records,
)
from twinmq.broker.auditlog import AuditLog
from twinmq.broker.journal import Settle, StoredMessage
from twinmq.broker.mirror.bidi import IDS_NAME, IDS_QID


def _log(tmp_path: Path, epoch: list[int], replica: bool = False) -> AuditLog:
    return AuditLog(
        tmp_path, "b1", lambda: epoch[0], lambda qid: f"q{qid}", lambda: replica,
        segment_seconds=3600,
    )  # fmt: skip


def _records(directory: Path) -> list[AuditRecord]:
    return [
        r for path in sorted(directory.glob("*.jsonl")) for r in segment_records(path.read_bytes())
    ]


def _message(mid: int, body: bytes) -> StoredMessage:
    header = bytes.fromhex("003c0000") + len(body).to_bytes(8, "big") + b"\x00\x80" + b"\x03m-1"
    return StoredMessage(mid, 7, "", "q7", header, body, None)


def test_records_parse_as_the_shared_model_with_the_right_events(tmp_path: Path) -> None:
    epoch = [3]
    log = _log(tmp_path, epoch)
    log.batch_complete([_message(11, b"hello"), Settle(7, 11)], guarded=True)
    log.batch_complete([_message(12, b"alone")], guarded=False)
    log.close()
    records = _records(tmp_path)
    assert [(r.replication_id, r.event) for r in records] == [
        (11, AuditEvent.CONFIRMED), (11, AuditEvent.DEQUEUED), (12, AuditEvent.CONFIRMED_ALONE),
    ]  # fmt: skip
    first = records[0]
    assert (first.broker, first.epoch, first.queue, first.message_id) == ("b1", 3, "q7", "m-1")
    assert first.digest == body_digest(b"hello")


def test_a_passive_records_replicated(tmp_path: Path) -> None:
    log = _log(tmp_path, [1], replica=True)
    log.batch_complete([_message(5, b"x")], guarded=False)
    log.close()
    assert [r.event for r in _records(tmp_path)] == [AuditEvent.REPLICATED]


def test_each_epoch_gets_its_own_segment_and_open_ones_are_hidden(tmp_path: Path) -> None:
    epoch = [1]
    log = _log(tmp_path, epoch)
    log.batch_complete([_message(1, b"a")], guarded=True)
    log.flush()
    assert not list(tmp_path.glob("*.jsonl"))  # still open: not yet visible to shippers
    epoch[0] = 2
    log.batch_complete([_message(2, b"b")], guarded=True)
    log.close()
    names = sorted(p.name for p in tmp_path.glob("*.jsonl"))
    assert names == ["b1-e000001-00000001.jsonl", "b1-e000002-00000002.jsonl"]
    assert [r.epoch for r in _records(tmp_path)] == [1, 2]


def test_a_segment_left_open_by_a_crash_is_closed_at_its_last_full_line(tmp_path: Path) -> None:
    log = _log(tmp_path, [1])
    log.batch_complete([_message(1, b"a")], guarded=True)
    log.flush()
    open_path = next(tmp_path.glob("*.open"))
    with open(open_path, "a") as f:
        f.write('{"broker":"b1","ep')  # torn by the crash
    restarted = _log(tmp_path, [1])
    assert [r.replication_id for r in _records(tmp_path)] == [1]
    restarted.batch_complete([_message(2, b"b")], guarded=True)
    restarted.close()
    assert [r.replication_id for r in _records(tmp_path)] == [1, 2]


def test_a_batch_is_one_line_per_queue_and_event_and_its_records_keep_their_order(
    tmp_path: Path,
) -> None:
    log = _log(tmp_path, [1])
    plain = bytes.fromhex("003c0000") + (1).to_bytes(8, "big") + b"\x00\x00"
    ops = [
        StoredMessage(1, 7, "", "", plain, b"a", None),
        StoredMessage(2, 8, "", "", plain, b"b", None),
        Settle(7, 1),
        StoredMessage(3, 7, "", "", plain, b"c", None),
        Settle(8, 2),
        Settle(7, 3),
    ]
    log.batch_complete(ops, guarded=False)
    log.close()
    lines = next(tmp_path.glob("*.jsonl")).read_text().splitlines()
    assert len(lines) == 4  # q7 and q8, stored and dequeued
    assert '"message_ids"' not in lines[0]  # no message has one: left out
    records = _records(tmp_path)
    stored = [(r.queue, r.replication_id) for r in records if r.event != AuditEvent.DEQUEUED]
    assert stored == [("q7", 1), ("q7", 3), ("q8", 2)]
    settled = [(r.queue, r.replication_id) for r in records if r.event == AuditEvent.DEQUEUED]
    assert settled == [("q7", 1), ("q7", 3), ("q8", 2)]
    assert [r.digest for r in records[:2]] == [body_digest(b"a"), body_digest(b"c")]
    assert {r.message_id for r in records} == {None}


def test_the_brokers_own_records_in_a_batch_change_none_of_its_lines(tmp_path: Path) -> None:
    """A client batch with the mirror's event (an internal queue's record, after the
    batch's ops or among them) is written as the same batch without it."""
    internal = 2**62 + 1
    event = StoredMessage(90, internal, "", "amq.twinmq.mirror", b"", b"event", None)
    ops = [_message(1, b"a"), _message(2, b"b"), Settle(7, 1), Settle(8, 5), _message(3, b"c")]
    batches = {
        "without": [ops, [Settle(7, 2)]],
        "with": [[*ops, event], [Settle(7, 2), Settle(internal, 90)]],
        "among": [[*ops[:2], event, *ops[2:]], [Settle(internal, 90), Settle(7, 2)]],
    }
    lines = {}
    for name, each in batches.items():
        log = _log(tmp_path / name, [1])
        for batch in each:
            log.batch_complete(batch, guarded=True)
        log.close()
        text = next((tmp_path / name).glob("*.jsonl")).read_text()
        lines[name] = [re.sub(r'"time":[0-9.]+', "", line) for line in text.splitlines()]
    assert lines["with"] == lines["without"] == lines["among"]
    assert len(lines["without"]) == 4  # q7 stored and dequeued, q8 dequeued, q7 dequeued


def test_consecutive_ids_are_one_run_and_others_are_listed_with_their_digests_in_order(
    tmp_path: Path,
) -> None:
    log = _log(tmp_path, [1])
    bodies = [b"m%d" % i for i in range(40)]
    log.batch_complete([_message(100 + i, body) for i, body in enumerate(bodies)], guarded=True)
    log.batch_complete([Settle(7, 139), Settle(7, 100), Settle(7, 120)], guarded=True)
    log.batch_complete([Settle(7, mid) for mid in range(100, 119)], guarded=True)
    log.close()
    lines = next(tmp_path.glob("*.jsonl")).read_text().splitlines()
    assert '"replication_id_runs":[[100,40]]' in lines[0]
    assert '"replication_ids":[139,100,120]' in lines[1]  # not consecutive: listed
    assert '"replication_id_runs":[[100,19]]' in lines[2]
    records = _records(tmp_path)
    stored = [r for r in records if r.event == AuditEvent.CONFIRMED]
    assert [(r.replication_id, r.digest) for r in stored] == [
        (100 + i, body_digest(body)) for i, body in enumerate(bodies)
    ]
    assert {r.message_id for r in stored} == {"m-1"}
    dequeued = [r.replication_id for r in records if r.event == AuditEvent.DEQUEUED]
    assert dequeued == [139, 100, 120, *range(100, 119)]


def test_message_ids_are_read_per_message_when_the_headers_of_a_line_differ(
    tmp_path: Path,
) -> None:
    log = _log(tmp_path, [1])
    plain = bytes.fromhex("003c0000") + (1).to_bytes(8, "big") + b"\x00\x00"
    log.batch_complete(
        [
            StoredMessage(1, 7, "", "", plain, b"a", None),
            _message(2, b"b"),
            StoredMessage(3, 7, "", "", plain, b"c", None),
        ],
        guarded=True,
    )
    log.batch_complete([StoredMessage(4, 7, "", "", plain, b"d", None)], guarded=True)
    log.close()
    lines = next(tmp_path.glob("*.jsonl")).read_text().splitlines()
    assert '"message_ids"' not in lines[1]  # one header, without an id: left out
    assert [r.message_id for r in _records(tmp_path)] == [None, "m-1", None, None]


def test_a_mirror_marks_what_it_applied_with_the_origin_and_nothing_else(tmp_path: Path) -> None:
    mark_qid = 2**62 + 5  # the applied mark's internal queue rides in the apply's batch
    log = AuditLog(
        tmp_path, "m1", lambda: 1,
        lambda qid: "amq.twinmq.mirror-applied.site-a" if qid == mark_qid else f"q{qid}",
        lambda: False, segment_seconds=3600,
    )  # fmt: skip
    mark = StoredMessage(mark_qid + 1, mark_qid, "", "", b"", b"mark", None)
    log.batch_complete([_message(20, b"m"), Settle(7, 3), mark], guarded=True)
    log.batch_complete([_message(21, b"own")], guarded=True)
    log.close()
    records = _records(tmp_path)
    assert [(r.replication_id, r.event, r.origin) for r in records] == [
        (20, AuditEvent.CONFIRMED, "site-a"), (3, AuditEvent.DEQUEUED, "site-a"),
        (21, AuditEvent.CONFIRMED, None),
    ]  # fmt: skip


def test_lines_without_an_origin_still_read(tmp_path: Path) -> None:
    line = (
        b'{"broker":"b","epoch":1,"queue":"q","event":"confirmed","time":1.0,'
        b'"replication_id_runs":[[4,2]],"digests_hex":"0000000100000002"}\n'
    )
    assert [r.origin for r in segment_records(line)] == [None, None]


def test_a_bidirectional_apply_names_each_copys_origin_and_id_there(tmp_path: Path) -> None:
    mark_qid = IDS_QID + 100  # an applied mark's internal queue
    log = AuditLog(
        tmp_path, "b1", lambda: 1,
        lambda qid: {mark_qid: "amq.twinmq.mirror-applied.site-c", IDS_QID: IDS_NAME}.get(
            qid, f"q{qid}"),
        lambda: False, segment_seconds=3600, mirror_id="site-b",
    )  # fmt: skip
    mark = StoredMessage(mark_qid + 1, mark_qid, "", "", b"", b"mark", None)

    def record(mid: int, omid: int, origin: str) -> StoredMessage:
        body = struct.pack("<QQQ", 7, mid, omid) + origin.encode()
        return StoredMessage(900 + mid, IDS_QID, "", IDS_NAME, b"", body, None)

    # Copies of site-a's messages 40, 41 (forwarded by site-c), one of site-c's, and a
    # message of this site's own (no id map record), in one apply; then a client's batch.
    applied = [_message(20, b"x"), _message(21, b"y"), _message(22, b"z"), _message(23, b"own")]
    ids = [record(20, 40, "site-a"), record(21, 41, "site-a"), record(22, 5, "site-c")]
    log.batch_complete([*applied, *ids, mark, Settle(7, 19)], guarded=True)
    log.batch_complete([_message(24, b"client")], guarded=True)
    log.close()
    assert [
        (r.replication_id, r.event.value, r.origin, r.message_origin, r.origin_id)
        for r in _records(tmp_path)
    ] == [
        (20, "confirmed", "site-c", "site-a", 40), (21, "confirmed", "site-c", "site-a", 41),
        (22, "confirmed", "site-c", "site-c", 5), (23, "confirmed", "site-c", "site-b", 23),
        (19, "dequeued", "site-c", None, None), (24, "confirmed", None, None, None),
    ]  # fmt: skip
    text = "".join(p.read_text() for p in tmp_path.glob("*.jsonl"))
    assert '"origin_id_runs":[[40,2]]' in text  # ids there packed as runs too


def test_format_5_origin_ids_must_match_the_replication_ids() -> None:
    line = (
        b'{"broker":"b","epoch":1,"queue":"q","event":"confirmed","time":1.0,'
        b'"replication_id_runs":[[4,2]],"digests_hex":"0000000100000002","origin":"x",'
        b'"message_origin":"x","origin_ids":[9]}\n'
    )
    with pytest.raises(SegmentFormatError, match="origin ids"):
        segment_records(line)
