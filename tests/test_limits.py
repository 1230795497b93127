"""Limits against exhaustion, with clear errors: connections (total and per user), queues."""

from __future__ import annotations

import json
from pathlib import Path

import pika
import pika.exceptions
import pytest

from twinmq.testing.launcher import BrokerProcess


def connect(broker: BrokerProcess, user: str = "guest") -> pika.BlockingConnection:
    return pika.BlockingConnection(
        pika.ConnectionParameters(
            host="127.0.0.1", port=broker.port,
            credentials=pika.PlainCredentials(user, f"{user}-pw" if user != "guest" else "guest"),
            connection_attempts=1,
        )
    )  # fmt: skip


def test_connections_beyond_the_limit_are_closed_at_once_and_counted(tmp_path: Path) -> None:
    with BrokerProcess(tmp_path, name="lim", extra_args=["--max-connections", "2"]).start() as b:
        first, second = connect(b), connect(b)
        with pytest.raises(pika.exceptions.AMQPConnectionError):
            connect(b)
        first.close()
        third = connect(b)  # a freed slot is usable again
        third.close()
        second.close()
        assert 'twinmq_connections_refused_total{limit="total"} 1.0' in b.admin.metrics()
        assert b.log_path is not None and "the limit of 2 is reached" in b.log_path.read_text()


def test_a_user_at_its_connection_limit_is_refused_with_530_and_others_are_not(
    tmp_path: Path,
) -> None:
    users = tmp_path / "users.json"
    users.write_text(json.dumps({"users": [{"name": "app", "password": "app-pw"},
                                           {"name": "guest", "password": "guest"}]}))  # fmt: skip
    args = ["--users-file", str(users), "--max-connections-per-user", "1"]
    with BrokerProcess(tmp_path / "data", name="lim", extra_args=args).start() as b:
        held = connect(b, "app")
        with pytest.raises(pika.exceptions.ProbableAccessDeniedError) as caught:
            connect(b, "app")
        assert "530" in str(caught.value)
        assert "user 'app' has reached its limit of 1 connections" in str(caught.value)
        connect(b, "guest").close()  # another user is not counted against app
        held.close()
        connect(b, "app").close()


def test_a_queue_declare_beyond_the_queue_limit_is_refused_with_406(tmp_path: Path) -> None:
    with BrokerProcess(tmp_path, name="lim", extra_args=["--max-queues", "2"]).start() as b:
        conn = connect(b)
        ch = conn.channel()
        ch.queue_declare("one")
        ch.queue_declare("two")
        ch.queue_declare("two")  # an existing queue at the limit: still declare-ok
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as caught:
            ch.queue_declare("three")
        assert caught.value.reply_code == 406
        assert "queue limit (2) is reached" in caught.value.reply_text
        ch = conn.channel()
        ch.queue_delete("one")
        ch.queue_declare("three")
        conn.close()
