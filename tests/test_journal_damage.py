"""A broker over a corrupt journal: real broker processes, pika clients, the admin API, the CLI.

It starts and serves what it could read, says so loudly (`/status`, metrics, an
error log line), keeps the damaged file in quarantine/, stays *damaged* until
`twinmq-broker journal repair`, refuses activation without force, and as a
forced active never makes its passive discard what it lost.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pika
import pytest
from jepsen import queue_counts

from twinmq.broker.admin_client import metric_samples
from twinmq.broker.journal.ops import TAG_MSG, decode_group
from twinmq.broker.journal.segment import HEADER, REC
from twinmq.testing.launcher import BrokerProcess
from twinmq.testing.pair import Pair, post_role, status
from twinmq.testing.queues import drain
from twinmq.testing.waiting import wait_for

QUEUE = "damage.q"


def _publish(broker: BrokerProcess, bodies: list[bytes]) -> None:
    """Persistent publishes, each confirmed before this returns."""
    connection = pika.BlockingConnection(pika.URLParameters(broker.url))
    try:
        channel = connection.channel()
        channel.queue_declare(QUEUE, durable=True)
        channel.confirm_delivery()
        for body in bodies:
            channel.basic_publish("", QUEUE, body, pika.BasicProperties(delivery_mode=2))
    finally:
        connection.close()


def _bodies(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}-{i:03d}".encode() + b"." * 200 for i in range(n)]


def _records(data: bytes) -> list[tuple[int, set[bytes]]]:
    """(offset, message bodies) of every intact record behind the header, up to a torn tail."""
    pos, records = HEADER.size, []
    while pos + REC.size <= len(data):
        length, _ = REC.unpack_from(data, pos)
        end = pos + REC.size + length
        if end > len(data):
            break  # a torn tail
        ops = decode_group(data, pos + REC.size, end)
        records.append((pos, {op[3].body for op in ops if op[0] == TAG_MSG and op[3]}))
        pos = end
    return records


def _corrupt(
    journal: Path, where: str = "record", which: str = "oldest"
) -> tuple[Path, bytes, set[bytes]]:
    """Flip a bit in the header or in a record with valid records after it, of the oldest
    or the newest segment. Returns the segment, its damaged bytes and the bodies lost."""
    segments = sorted(journal.glob("*.seg"))
    victim = segments[0] if which == "oldest" else segments[-1]
    data = bytearray(victim.read_bytes())
    records = _records(bytes(data))
    assert len(records) >= 3, "want a record with valid records after it"
    if where == "header":
        data[12] ^= 0x01  # the segment number
        lost: set[bytes] = set()
    else:
        start, lost = records[len(records) // 2]
        data[start + REC.size + 40] ^= 0x04
    victim.write_bytes(bytes(data))
    return victim, bytes(data), lost


def _corrupt_a_record(journal: Path) -> tuple[Path, bytes, set[bytes]]:
    return _corrupt(journal, "record", "oldest")


def _metrics(broker: BrokerProcess) -> dict[str, float]:
    return metric_samples(broker.admin.metrics())


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "twinmq.broker.main", "journal", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _damaged_data_dir(
    tmp_path: Path, where: str = "record", which: str = "oldest"
) -> tuple[BrokerProcess, list[bytes], Path, bytes, set[bytes]]:
    """A broker's data dir with 60 confirmed messages in four segments, one of them damaged
    (the broker stopped)."""
    broker = BrokerProcess(
        tmp_path / "data", name="damaged", extra_args=["--segment-bytes", "4096"]
    )
    sent = _bodies("m", 60)
    with broker:
        _publish(broker, sent)
    victim, damaged, lost = _corrupt(broker.data_dir / "journal", where, which)
    return broker, sent, victim, damaged, lost


# Every position is covered fast at the journal level (test_journal_corruption.py); here
# one runs by default and the rest with the slow tests.
@pytest.mark.parametrize(
    ("where", "which"),
    [
        ("record", "oldest"),
        pytest.param("record", "last", marks=pytest.mark.slow),
        pytest.param("header", "oldest", marks=pytest.mark.slow),
        pytest.param("header", "last", marks=pytest.mark.slow),
    ],
)
def test_a_broker_restarted_over_a_corrupt_journal_serves_and_reports_it(
    tmp_path: Path, where: str, which: str
) -> None:
    broker, sent, victim, damaged, lost = _damaged_data_dir(tmp_path, where, which)
    assert len(list((broker.data_dir / "journal").glob("*.seg"))) >= 3
    with broker.start():
        journal = (status(broker) or {})["journal"]
        assert journal["damaged"] is True
        assert [c["segment"] for c in journal["corruption"]] == [victim.name]
        assert journal["corruption"][0]["quarantined_as"].endswith(victim.name)
        assert journal["quarantined_files"] == 1
        metrics = _metrics(broker)
        assert metrics["twinmq_journal_corruption_events_total"] == 1
        assert metrics["twinmq_journal_quarantined_files"] == 1
        assert metrics["twinmq_broker_damaged"] == 1
        _publish(broker, [b"after"])
        assert drain(broker.url, QUEUE) == [b for b in sent if b not in lost] + [b"after"]
    kept = broker.data_dir / "quarantine" / victim.name
    assert kept.read_bytes() == damaged, "the damaged file was changed"
    assert not victim.exists()
    assert broker.log_path is not None
    log = broker.log_path.read_text()
    assert " ERROR " in log and "journal corruption" in log and victim.name in log
    # The journal is clean now, but the broker stays damaged until someone repairs it.
    with broker.start():
        journal = (status(broker) or {})["journal"]
        assert journal["damaged"] is True and len(journal["corruption"]) == 1


def test_a_torn_tail_is_a_warning_and_does_not_damage_the_broker(tmp_path: Path) -> None:
    broker = BrokerProcess(tmp_path / "data", name="torn")
    sent = _bodies("m", 20)
    with broker:
        _publish(broker, sent)
    last = sorted((broker.data_dir / "journal").glob("*.seg"))[-1]
    with last.open("ab") as f:
        f.write(b"\x10\x00\x00\x00partial")  # a crash in the middle of a group commit
    with broker.start():
        journal = (status(broker) or {})["journal"]
        assert journal["damaged"] is False and journal["corruption"] == []
        assert _metrics(broker)["twinmq_broker_damaged"] == 0
        assert drain(broker.url, QUEUE) == sent
    assert broker.log_path is not None
    log = broker.log_path.read_text()
    assert " WARNING " in log and "torn tail" in log and " ERROR " not in log
    assert not (broker.data_dir / "quarantine").exists()


def test_a_damaged_broker_refuses_activation_without_force(tmp_path: Path) -> None:
    broker, _, _, _, _ = _damaged_data_dir(tmp_path)
    broker.extra_args = ["--role", "passive"]
    with broker.start():
        code, body = post_role(broker, "active", 1)
        assert code == 409 and body["error"] == "broker damaged", body
        assert "force" in body["detail"]
        assert (status(broker) or {})["role"] == "passive"
        code, body = post_role(broker, "active", 1, force=True)
        assert code == 200 and body["role"] == "active", body
        assert body["journal"]["damaged"] is True


def test_journal_check_exit_codes_and_report(tmp_path: Path) -> None:
    broker = BrokerProcess(tmp_path / "data", name="checked")
    with broker:
        _publish(broker, _bodies("m", 30))
    data = broker.data_dir
    clean = _cli("check", str(data))
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert "30 live messages" in clean.stdout and "result: clean" in clean.stdout

    last = sorted((data / "journal").glob("*.seg"))[-1]
    with last.open("ab") as f:
        f.write(b"\x10\x00\x00\x00partial")  # a group torn while being written
    torn = _cli("check", str(data))
    assert torn.returncode == 1, torn.stdout
    assert "torn tail" in torn.stdout

    victim, _, lost = _corrupt_a_record(data / "journal")
    before = {p.name: p.read_bytes() for p in (data / "journal").glob("*.seg")}
    corrupt = _cli("check", "--json", str(data))
    assert corrupt.returncode == 2, corrupt.stdout + corrupt.stderr
    report = json.loads(corrupt.stdout)
    assert report["result"] == "corrupt" and report["corrupt_stretches"] == 1
    (segment,) = [s for s in report["segments"] if s["corruption"]]
    assert segment["name"] == victim.name
    assert report["live_messages"] == 30 - len(lost)
    assert {p.name: p.read_bytes() for p in (data / "journal").glob("*.seg")} == before
    assert "CORRUPT at offset" in _cli("check", str(data)).stdout

    assert _cli("check").returncode == 64
    assert _cli("check", str(tmp_path / "nowhere")).returncode == 65


def test_journal_repair_quarantines_and_clears_the_damaged_marker(tmp_path: Path) -> None:
    broker, sent, victim, damaged, lost = _damaged_data_dir(tmp_path)
    data = broker.data_dir
    repaired = _cli("repair", str(data))
    assert repaired.returncode == 0, repaired.stdout + repaired.stderr
    assert f"corruption: {victim.name}" in repaired.stdout
    assert "quarantined: " in repaired.stdout
    assert (data / "quarantine" / victim.name).read_bytes() == damaged
    after = _cli("check", str(data))
    assert after.returncode == 0, after.stdout
    assert f"{len(sent) - len(lost)} live messages" in after.stdout

    # A broker that found the damage itself is marked; check says so until repair.
    broker2, _, _, _, _ = _damaged_data_dir(tmp_path / "second")
    broker2.start()  # finds the corruption, quarantines it, marks itself damaged
    broker2.stop()
    marked = _cli("check", str(broker2.data_dir))
    assert marked.returncode == 2 and "damaged marker" in marked.stdout
    cleared = _cli("repair", str(broker2.data_dir))
    assert cleared.returncode == 0 and "cleared the damaged marker" in cleared.stdout
    assert _cli("check", str(broker2.data_dir)).returncode == 0
    with broker2.start():
        assert (status(broker2) or {})["journal"]["damaged"] is False


def _passive_holds(pair: Pair, count: int) -> bool:
    counts = queue_counts(status(pair.passive), QUEUE)
    return counts is not None and sum(counts) == count


@pytest.mark.parametrize("timeout", [1.0])
def test_a_forced_damaged_active_never_makes_its_passive_discard(
    tmp_path: Path, timeout: float
) -> None:
    """Broker a loses a record to corruption; forced active, its passive b keeps everything."""
    with Pair(tmp_path, replication_timeout=timeout) as pair:
        a, b = pair.active, pair.passive
        sent = _bodies("m", 60)
        _publish(a, sent)
        assert _passive_holds(pair, 60)
        a.kill()
        _, _, lost = _corrupt_a_record(a.data_dir / "journal")
        assert lost
        a.extra_args = [*pair.args("active"), "--role", "passive"]  # comes back, no peer
        a.start()
        pair.epoch += 1
        code, body = post_role(a, "active", pair.epoch)
        assert code == 409 and body["error"] == "broker damaged", body
        code, body = post_role(a, "active", pair.epoch, force=True)
        assert code == 200, body
        pair.wait_healthy(15)
        assert _passive_holds(pair, 60), "catch-up made the passive discard what a lost"
        assert a.log_path is not None
        assert "discarded 0" in a.log_path.read_text()
        # The proof: b, promoted, still has every confirmed message.
        a.kill()
        wait_for("b ready", lambda: (s := status(b)) and s["replication"]["ready"], 5)
        pair.promote_passive()
        assert sorted(drain(b.url, QUEUE)) == sorted(sent)


@pytest.mark.parametrize("timeout", [1.0])
def test_a_damaged_broker_back_as_passive_is_healed_by_catch_up(
    tmp_path: Path, timeout: float
) -> None:
    with Pair(tmp_path, replication_timeout=timeout) as pair:
        a, b = pair.active, pair.passive
        sent = _bodies("m", 60)
        _publish(a, sent)
        a.kill()
        wait_for("b ready", lambda: (s := status(b)) and s["replication"]["ready"], 5)
        pair.promote_passive()
        _, _, lost = _corrupt_a_record(a.data_dir / "journal")
        assert lost
        a.extra_args = pair.args("passive")
        a.start()
        pair.wait_healthy(15)
        assert _passive_holds(pair, 60)  # a got back what it lost
        assert (status(a) or {})["journal"]["damaged"] is False
        b.kill()
        wait_for("a ready", lambda: (s := status(a)) and s["replication"]["ready"], 5)
        pair.promote_passive()  # no force needed: a was made whole by the catch-up
        assert sorted(drain(a.url, QUEUE)) == sorted(sent)
        assert (status(a) or {})["journal"]["healed_by"] == "b"


def test_the_operator_reports_a_damaged_broker_and_where_its_damaged_file_went(
    tmp_path: Path,
) -> None:
    from twinmq.operator.failover import BrokerView, Decision
    from twinmq.operator.main import conditions, damage_of, damaged_condition
    from twinmq.operator.models import BrokerClusterStatus, BrokerSummary
    from twinmq.operator.probe import view_of

    broker, _, victim, _, _ = _damaged_data_dir(tmp_path)
    broker.extra_args = ["--role", "passive"]
    with broker.start():
        report = broker.admin.status()
    view = view_of(report, "backup", None)
    assert view.damaged and not view.ready
    gone = BrokerView("primary", reachable=False)
    found = damage_of(BrokerClusterStatus(), {"primary": gone, "backup": view},
                      {"primary": None, "backup": report})  # fmt: skip
    assert list(found) == ["backup"]
    moved = report.journal.corruption[0].quarantined_as
    assert moved is not None and moved.endswith(victim.name) and moved in found["backup"]
    assert "since 20" in found["backup"]
    status = BrokerClusterStatus(
        brokers=[BrokerSummary(name="backup", damaged=True, damage=found["backup"])]
    )
    assert damaged_condition(status) == (
        "BrokerDamaged", True, "JournalDamaged", f"backup: {found['backup']}"
    )  # fmt: skip
    (written,) = [
        c
        for c in conditions(
            Decision(), status, {"primary": gone, "backup": view}, 1, [damaged_condition(status)]
        )
        if c.type == "BrokerDamaged"
    ]
    assert (written.status, written.reason) == ("True", "JournalDamaged")  # fmt: skip
    # Unreachable next time: still damaged as far as anyone knows, with the same story.
    unreachable = {"primary": gone, "backup": BrokerView("backup", reachable=False)}
    assert damage_of(status, unreachable, {"primary": None, "backup": None}) == found
    assert damaged_condition(BrokerClusterStatus())[1] is False


def test_a_bit_flipped_in_the_topology_file_is_refused_not_read_as_a_deleted_queue(
    tmp_path: Path,
) -> None:
    """definitions.json is valid JSON after most bit flips: a queue's `qid` 2 read as 6
    made recovery take queue 2 for one deleted before the crash and drop its messages,
    confirmed, silently (and the passive then discarded them too in its catch-up). The
    file carries a checksum: a damaged one stops the start, loudly, and erases nothing."""
    data = tmp_path / "a"
    broker = BrokerProcess(data, name="defsbit").start()
    connection = pika.BlockingConnection(pika.URLParameters(broker.url))
    connection.channel().queue_declare("first.q", durable=True)  # qid 1: QUEUE gets 2
    connection.close()
    bodies = [f"m{i}".encode() for i in range(50)]
    _publish(broker, bodies)
    broker.stop()
    path = data / "journal" / "definitions.json"
    text = path.read_bytes()
    assert text.count(b'"qid": 2') == 1
    path.write_bytes(text.replace(b'"qid": 2', b'"qid": 6'))  # 0x32 -> 0x36: one bit
    with pytest.raises(RuntimeError, match=r"definitions\.json is damaged"):
        BrokerProcess(data, name="defsbit").start()
    path.write_bytes(text)  # the operator restores it (from a backup, or the peer's)
    restarted = BrokerProcess(data, name="defsbit").start()
    try:
        assert drain(restarted.url, QUEUE) == bodies
    finally:
        restarted.stop()
