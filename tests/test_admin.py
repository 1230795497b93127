"""The admin HTTP API, through the one admin client, and logins from a users file, against
real broker processes on loopback."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pika
import pika.exceptions
import pytest
from pika.adapters.blocking_connection import BlockingChannel

from twinmq.broker.admin_client import (
    AdminClient,
    AdminError,
    AdminTimeout,
    AdminUnreachable,
    Call,
    Forbidden,
    StaleEpoch,
    SyncAdminClient,
    Unauthorized,
)
from twinmq.broker.auth import hash_password
from twinmq.broker.names import ACTIVE, ADMIN_TOKEN_ENV, PASSIVE, setting_env
from twinmq.testing.launcher import BrokerProcess, free_port

TOKEN = "t0ken"
READ_TOKEN = "r3ad-only"


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    root = tmp_path_factory.mktemp("secured")
    users = root / "users.json"
    users.write_text(
        json.dumps(
            {
                "users": [
                    {"name": "app", "password_hash": hash_password("app-pass")},
                    {"name": "guest", "password": "guest"},
                ]
            }
        )
    )
    broker = BrokerProcess(
        root / "data", name="secured",
        extra_args=["--users-file", str(users)],
        env={ADMIN_TOKEN_ENV: TOKEN, setting_env("admin_read_token"): READ_TOKEN},
    )  # fmt: skip
    with broker:
        yield broker


def client(broker: BrokerProcess, token: str | None = None) -> SyncAdminClient:
    return SyncAdminClient(broker.admin_url, token)


def test_health_and_readiness_are_open(secured: BrokerProcess) -> None:
    with client(secured) as anonymous:
        assert anonymous.readiness().ready
        assert anonymous.send(Call("GET", "/healthz", lambda r: r.json())) == {"status": "ok"}


def test_status_needs_the_bearer_token(secured: BrokerProcess) -> None:
    for token in (None, "wrong"):
        with client(secured, token) as refused, pytest.raises(Unauthorized) as caught:
            refused.status()
        assert caught.value.status == 401
        assert caught.value.body is not None and caught.value.body.error == "unauthorized"
    # The launcher's own client carries the broker's TWINMQ_ADMIN_TOKEN.
    status = secured.admin.status()
    assert (status.name, status.role, status.ready) == ("secured", ACTIVE, True)


def test_the_read_only_token_reads_status_and_metrics_and_may_not_change_a_role(
    secured: BrokerProcess,
) -> None:
    with client(secured, READ_TOKEN) as monitor:
        assert monitor.status().role == ACTIVE
        assert "twinmq_" in monitor.metrics()
        with pytest.raises(Forbidden) as caught:
            monitor.set_role(PASSIVE, 10**6)
    assert caught.value.status == 403
    assert caught.value.body is not None and caught.value.body.error == "forbidden"
    assert secured.admin.status().role == ACTIVE, "the read-only token changed the role"


def _published(
    broker: BrokerProcess, queue: str, count: int
) -> tuple[pika.BlockingConnection, BlockingChannel]:
    """A connection of user `app` that declared `queue` and published `count` confirmed messages."""
    conn = pika.BlockingConnection(
        pika.ConnectionParameters(
            port=broker.port, credentials=pika.PlainCredentials("app", "app-pass")
        )
    )
    ch = conn.channel()
    ch.queue_declare(queue, durable=True)
    ch.confirm_delivery()
    for _ in range(count):
        ch.basic_publish("", queue, b"x", pika.BasicProperties(delivery_mode=2))
    return conn, ch


def test_status_counts_connections_and_queue_messages(secured: BrokerProcess) -> None:
    conn, _ = _published(secured, "status.q", 3)
    status = secured.admin.status()
    assert status.connections >= 1 and status.channels >= 1
    queue = next(q for q in status.queues if q.name == "status.q")
    assert (queue.messages, queue.durable) == (3, True)
    conn.close()


def test_metrics_are_prometheus_text_with_broker_series(secured: BrokerProcess) -> None:
    with client(secured) as anonymous, pytest.raises(Unauthorized):
        anonymous.metrics()
    text = secured.admin.metrics()
    for series in (
        "twinmq_connections", "twinmq_channels", "twinmq_queue_messages_ready",
        "twinmq_messages_published_total", "twinmq_confirm_latency_seconds_bucket",
        "twinmq_journal_fsync_seconds_bucket",
    ):  # fmt: skip
        assert series in text, series


def _counter_values(text: str) -> dict[str, float]:
    """Unlabelled and labelled sample lines of Prometheus text, by their full name."""
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def test_the_per_message_counters_count_each_publish_confirm_delivery_and_ack(
    secured: BrokerProcess,
) -> None:
    names = (
        "twinmq_messages_published_total", "twinmq_messages_delivered_total",
        "twinmq_messages_acknowledged_total", 'twinmq_confirms_total{outcome="ack"}',
    )  # fmt: skip
    before = _counter_values(secured.admin.metrics())
    conn, ch = _published(secured, "counted.q", 7)
    for _ in range(7):
        method, _, _ = ch.basic_get("counted.q")
        assert method is not None
        ch.basic_ack(method.delivery_tag)
    conn.close()
    after = _counter_values(secured.admin.metrics())
    assert [after[n] - before.get(n, 0.0) for n in names] == [7.0, 7.0, 7.0, 7.0]


def test_users_file_login_and_wrong_password(secured: BrokerProcess) -> None:
    ok = pika.BlockingConnection(
        pika.ConnectionParameters(
            port=secured.port, credentials=pika.PlainCredentials("app", "app-pass")
        )
    )
    ok.close()
    with pytest.raises(pika.exceptions.ProbableAuthenticationError):
        pika.BlockingConnection(
            pika.ConnectionParameters(
                port=secured.port,
                credentials=pika.PlainCredentials("app", "nope"),
                connection_attempts=1,
            )
        )


def test_unknown_admin_path_is_an_admin_error_with_status_404(secured: BrokerProcess) -> None:
    with pytest.raises(AdminError) as caught:
        secured.admin.send(Call("GET", "/nope", lambda r: r.text))
    assert caught.value.status == 404
    assert not isinstance(caught.value, (Unauthorized, StaleEpoch, AdminUnreachable))


# -- role changes, refusals and failures to answer ---------------------------------------


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[BrokerProcess]:
    """An open (loopback, no token) active broker in epoch 5."""
    with BrokerProcess(tmp_path / "data", name="b5", extra_args=["--epoch", "5"]) as b:
        yield b


def test_a_stale_epoch_is_refused_as_stale_epoch_and_changes_nothing(
    broker: BrokerProcess,
) -> None:
    with pytest.raises(StaleEpoch) as caught:
        broker.admin.set_role(PASSIVE, 3)
    assert caught.value.status == 409
    assert "epoch 3 is stale" in str(caught.value)
    status = broker.admin.status()
    assert (status.role, status.epoch) == (ACTIVE, 5)


def test_a_role_change_answers_with_the_new_status(broker: BrokerProcess) -> None:
    status = broker.admin.set_role(PASSIVE, 6)
    assert (status.role, status.epoch) == (PASSIVE, 6)
    readiness = broker.admin.readiness()  # 503 is an answer, not an error
    assert not readiness.ready and readiness.reason and "passive" in readiness.reason


def test_a_paused_broker_is_a_timeout_and_a_closed_port_is_unreachable(
    broker: BrokerProcess,
) -> None:
    broker.signal(signal.SIGSTOP)
    try:
        with pytest.raises(AdminTimeout):
            broker.admin.status(timeout=0.5)
    finally:
        broker.signal(signal.SIGCONT)
    assert broker.admin.status().name == "b5"  # the pool recovers from the timed-out call
    with SyncAdminClient(f"http://127.0.0.1:{free_port()}") as nobody:
        with pytest.raises(AdminUnreachable) as caught:
            nobody.status()
        assert not isinstance(caught.value, AdminTimeout)


def test_the_async_client_shares_one_pool_between_brokers(
    broker: BrokerProcess, secured: BrokerProcess
) -> None:
    async def both() -> tuple[str, str]:
        async with httpx.AsyncClient() as pool:
            open_ = AdminClient(broker.admin_url, http=pool)
            guarded = AdminClient(secured.admin_url, TOKEN, http=pool)
            a, b = await asyncio.gather(open_.status(), guarded.status())
            with pytest.raises(StaleEpoch):
                await open_.set_role(PASSIVE, 4)
            await open_.aclose()  # the pool is the caller's: still usable afterwards
            assert (await guarded.status()).name == "secured"
            return a.name, b.name

    assert asyncio.run(both()) == ("b5", "secured")
