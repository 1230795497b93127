"""The audit on real logs: a replicated pair of broker processes through faults must PASS.

The run: `a` active and `b` passive (epoch 1); a publisher with confirms sends
numbered messages (`p1:<n>`) while a consumer acks some; the passive is
SIGSTOPped past the replication timeout (the active degrades: confirmed alone)
and resumed (catch-up); then `a` is killed with SIGKILL, `b` promoted in epoch
2, and `a` restarted as its passive; more traffic; everything is drained and
both brokers stop. Their audit segments are shipped and audited.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

pytest.importorskip("pyspark")

import pika
from pyspark.sql import SparkSession

from twinmq.audit.job import AuditParams, run_audit
from twinmq.audit.store import Store, ship
from twinmq.audit.summary import Verdict
from twinmq.broker.admin_client import AdminUnreachable
from twinmq.broker.api import BrokerStatus
from twinmq.testing.launcher import BrokerProcess
from twinmq.testing.pair import Pair
from twinmq.testing.waiting import wait_for

pytestmark = [pytest.mark.spark, pytest.mark.slow]  # a JVM: minutes on 2 cores

QUEUE = "audit.real"


def _status(broker: BrokerProcess) -> BrokerStatus | None:
    try:
        return broker.admin.status(timeout=2)
    except AdminUnreachable:
        return None


def _ready(broker: BrokerProcess, flag: str = "ready") -> bool:
    s = _status(broker)
    return s is not None and bool(getattr(s.replication, flag))


class Publisher:
    """pika with confirms, numbered message ids."""

    def __init__(self, broker: BrokerProcess) -> None:
        self.connection = pika.BlockingConnection(pika.URLParameters(broker.url))
        self.channel = self.connection.channel()
        self.channel.queue_declare(QUEUE, durable=True)
        self.channel.confirm_delivery()

    def send(self, numbers: range) -> None:
        for n in numbers:
            self.channel.basic_publish(
                "", QUEUE, f"body {n}".encode(),
                pika.BasicProperties(delivery_mode=2, message_id=f"p1:{n}"),
            )  # fmt: skip

    def consume(self, count: int | None = None) -> int:
        got = 0
        while count is None or got < count:
            method, _, _ = self.channel.basic_get(QUEUE)
            if method is None:
                break
            self.channel.basic_ack(method.delivery_tag)
            got += 1
        return got

    def close(self) -> None:
        self.connection.close()


def fault_run(root: Path) -> tuple[BrokerProcess, BrokerProcess]:
    """The run of the module docstring; returns the stopped brokers."""
    with Pair(root, broker_args=["--audit-segment-seconds", "1"], link=False) as pair:
        a, b = pair.active, pair.passive
        client = Publisher(a)
        client.send(range(0, 300))
        client.consume(100)
        # The passive stalls past the replication timeout: the active goes on alone.
        b.signal(signal.SIGSTOP)
        time.sleep(1.5)
        client.send(range(300, 400))
        wait_for("active degraded", lambda: _ready(a, "degraded"))
        client.send(range(400, 450))
        client.consume(20)
        b.signal(signal.SIGCONT)
        wait_for("passive caught up", lambda: _ready(a) and _ready(b))
        client.send(range(450, 600))
        client.close()
        # Failover: a dies, b is promoted in epoch 2, a comes back as b's passive.
        a.kill()
        pair.promote_passive()
        pair.rejoin(a)
        wait_for("a caught up as passive", lambda: _ready(a) and _ready(b))
        client = Publisher(b)
        client.send(range(600, 800))
        client.consume()
        client.close()
        time.sleep(0.5)
    return a, b


def test_a_fault_run_of_a_real_pair_passes(tmp_path: Path, spark: SparkSession) -> None:
    a, b = fault_run(tmp_path / "pair")
    store = Store(str(tmp_path / "store"))
    for broker in (a, b):
        report = ship(broker.data_dir / "audit", store)
        assert report.shipped
    summary = run_audit(spark, store, AuditParams(bucket_seconds=1.0))
    print(summary.model_dump_json(indent=1, exclude={"lag_over_time"}))  # shown on failure
    t = summary.totals
    assert summary.verdict == Verdict.PASS, summary.failures
    assert (t.lost, t.replicated_twice, t.reordered, t.digest_mismatch) == (0, 0, 0, 0)
    # Every publish was confirmed, but SIGKILL took the active's last (unflushed) records:
    # those messages are known from the passive's records only.
    assert t.messages + t.replica_only == 800 and t.messages > 600
    assert t.confirmed_alone > 0  # the stalled passive
    assert [e.epoch for e in summary.epochs] == [1, 2]
    (failover,) = summary.failovers
    assert (failover.from_active, failover.to_active) == (["a"], ["b"])
    assert summary.lag is not None and summary.lag.max > 0  # the catch-up after the stall
