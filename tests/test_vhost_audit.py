"""The audit log names a queue of another vhost unambiguously (format 6: a `vhost` member),
the audit job keeps two vhosts' queues of one name apart, and old logs still read.

A `/` queue named like an old writer's name of another vhost's queue (`orders (vhost
tenant-a)`) is the forgery the old naming allowed: it must stay `/`'s own queue.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pika
import pytest

from twinmq.audit.records import (
    AuditEvent,
    AuditRecord,
    queue_key,
    segment_records,
    split_queue_key,
)
from twinmq.testing.launcher import BrokerProcess
from twinmq.testing.pair import Pair

FORGED = "orders (vhost tenant-a)"  # a `/` queue named as the old writer named tenant-a's


def _users(path: Path) -> Path:
    path.write_text(
        json.dumps(
            {
                "users": [{"name": "admin", "password": "admin-pw"}],
                "vhosts": [{"name": "/"}, {"name": "tenant-a"}],
                "permissions": [
                    {"user": "admin", "vhost": v, "configure": ".*", "write": ".*", "read": ".*"}
                    for v in ("/", "tenant-a")
                ],
            }
        )
    )
    return path


def _publish(broker: BrokerProcess, vhost: str, queue: str, count: int) -> None:
    conn = pika.BlockingConnection(
        pika.ConnectionParameters(
            host="127.0.0.1", port=broker.port, virtual_host=vhost,
            credentials=pika.PlainCredentials("admin", "admin-pw"), connection_attempts=1,
        )
    )  # fmt: skip
    ch = conn.channel()
    ch.queue_declare(queue, durable=True)
    ch.confirm_delivery()
    for n in range(count):
        ch.basic_publish(
            "", queue, f"{vhost}/{queue}/{n}".encode(),
            pika.BasicProperties(delivery_mode=2, message_id=f"{vhost}:{n}"),
        )  # fmt: skip
    conn.close()


def _logged(broker: BrokerProcess) -> list[AuditRecord]:
    """The records of a stopped broker's audit segments."""
    return [
        r
        for path in sorted((broker.data_dir / "audit").glob("*.jsonl*"))
        for r in segment_records(path.read_bytes())
    ]


def _by_queue(records: list[AuditRecord]) -> dict[tuple[str | None, str], set[int]]:
    out: dict[tuple[str | None, str], set[int]] = {}
    for r in records:
        if r.event is not AuditEvent.DEQUEUED:
            out.setdefault((r.vhost, r.queue), set()).add(r.replication_id)
    return out


def _pair_run(root: Path) -> tuple[BrokerProcess, BrokerProcess]:
    """A pair with two vhosts: `/`'s FORGED queue (2 messages) and tenant-a's `orders`
    (3); returns the stopped brokers."""
    users = _users(root / "users.json")
    with Pair(
        root / "pair", broker_args=["--users-file", str(users), "--audit-segment-seconds", "1"]
    ) as pair:
        _publish(pair.active, "/", FORGED, 2)
        _publish(pair.active, "tenant-a", "orders", 3)
        pair.wait_healthy(10)
        brokers = pair.active, pair.passive
    return brokers


def test_a_queue_of_another_vhost_is_logged_with_its_vhost_and_no_slash_queue_forges_it(
    tmp_path: Path,
) -> None:
    active, passive = _pair_run(tmp_path)
    for broker in (active, passive):
        queues = _by_queue(_logged(broker))
        counts = {k: len(v) for k, v in queues.items()}
        assert counts == {(None, FORGED): 2, ("tenant-a", "orders"): 3}
    # The lines themselves: the name as it is, the vhost beside it; `/`'s forged-looking
    # name carries `"vhost": "/"`, so no reader takes it for tenant-a's.
    lines = [
        json.loads(line)
        for path in sorted((active.data_dir / "audit").glob("*.jsonl*"))
        for line in path.read_bytes().splitlines()
    ]
    assert {(d["queue"], d.get("vhost")) for d in lines} == {(FORGED, "/"), ("orders", "tenant-a")}


@pytest.mark.spark
@pytest.mark.slow  # a JVM: minutes on 2 cores
def test_the_audit_job_counts_two_vhosts_queues_apart(tmp_path: Path, spark: Any) -> None:
    from twinmq.audit.job import AuditParams, run_audit
    from twinmq.audit.store import Store, ship
    from twinmq.audit.summary import Verdict

    active, passive = _pair_run(tmp_path)
    store = Store(str(tmp_path / "store"))
    for broker in (active, passive):
        assert ship(broker.data_dir / "audit", store).shipped
    summary = run_audit(spark, store, AuditParams(bucket_seconds=1.0))
    assert summary.verdict == Verdict.PASS, summary.failures
    assert {(q.vhost, q.queue): q.counts.messages for q in summary.queues} == {
        ("/", FORGED): 2,
        ("tenant-a", "orders"): 3,
    }


def test_logs_written_before_format_6_still_read() -> None:
    """Format 5 lines and format 1 records: a `/` queue as it was, another vhost's from its
    old qualified name (ambiguous then; read as the old writer meant it)."""
    old = b"\n".join(
        json.dumps(line).encode()
        for line in (
            {"broker": "a", "epoch": 1, "queue": "orders", "event": "confirmed",
             "time": 1.0, "replication_id_runs": [[1, 2]], "digests_hex": "00000000" * 2},
            {"broker": "a", "epoch": 1, "queue": "orders (vhost tenant-a)",
             "event": "confirmed", "time": 1.0, "replication_id_runs": [[3, 1]],
             "digests_hex": "00000000"},
            {"broker": "a", "epoch": 1, "queue": "jobs (vhost b)", "replication_id": 4,
             "message_id": None, "digest": "00000000", "event": "confirmed", "time": 1.0},
        )
    )  # fmt: skip
    records = segment_records(old)
    assert [(r.vhost, r.queue, r.replication_id) for r in records] == [
        (None, "orders", 1), (None, "orders", 2), ("tenant-a", "orders", 3), ("b", "jobs", 4),
    ]  # fmt: skip


def test_queue_keys_tell_every_vhost_and_name_apart() -> None:
    names = [("/", "orders"), ("tenant-a", "orders"), ("/", '\x00["tenant-a","orders"]'),
             ("/", "\x00"), ("a\x00b", "c"), ("a", "b\x00c"), (None, "orders")]  # fmt: skip
    keys = [queue_key(q, v) for v, q in names]
    assert keys[0] == "orders" == keys[6]  # `/`'s keys are its names, as before
    assert len(set(keys[:6])) == 6
    for (vhost, queue), key in zip(names, keys, strict=True):
        assert split_queue_key(key) == (vhost or "/", queue)
