"""The admin HTTP API and logins from a users file, against a real broker process."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pika
import pika.exceptions
import pytest

from twinmq.broker.api import BrokerStatus
from twinmq.broker.auth import hash_password
from twinmq.broker.launcher import BrokerProcess

TOKEN = "t0ken"


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> BrokerProcess:
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
        extra_args=["--users-file", str(users)], env={"TWINMQ_ADMIN_TOKEN": TOKEN},
    )  # fmt: skip
    with broker:
        yield broker


def get(broker: BrokerProcess, path: str, token: str | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(broker.admin_url + path)
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=5) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_health_and_readiness_are_open(secured: BrokerProcess) -> None:
    assert get(secured, "/healthz")[0] == 200
    assert get(secured, "/readyz")[0] == 200


def test_status_needs_the_bearer_token(secured: BrokerProcess) -> None:
    assert get(secured, "/status")[0] == 401
    assert get(secured, "/status", "wrong")[0] == 401
    code, body = get(secured, "/status", TOKEN)
    assert code == 200
    status = BrokerStatus.model_validate_json(body)
    assert (status.name, status.role, status.ready) == ("secured", "active", True)


def test_status_counts_connections_and_queue_messages(secured: BrokerProcess) -> None:
    conn = pika.BlockingConnection(
        pika.ConnectionParameters(
            port=secured.port, credentials=pika.PlainCredentials("app", "app-pass")
        )
    )
    ch = conn.channel()
    ch.queue_declare("status.q", durable=True)
    ch.confirm_delivery()
    for _ in range(3):
        ch.basic_publish("", "status.q", b"x", pika.BasicProperties(delivery_mode=2))
    status = BrokerStatus.model_validate_json(get(secured, "/status", TOKEN)[1])
    assert status.connections >= 1 and status.channels >= 1
    queue = next(q for q in status.queues if q.name == "status.q")
    assert (queue.messages, queue.durable) == (3, True)
    conn.close()


def test_metrics_are_prometheus_text_with_broker_series(secured: BrokerProcess) -> None:
    assert get(secured, "/metrics")[0] == 401
    code, body = get(secured, "/metrics", TOKEN)
    text = body.decode()
    assert code == 200
    for series in (
        "twinmq_connections", "twinmq_channels", "twinmq_queue_messages_ready",
        "twinmq_messages_published_total", "twinmq_confirm_latency_seconds_bucket",
        "twinmq_journal_fsync_seconds_bucket",
    ):  # fmt: skip
        assert series in text, series


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


def test_unknown_admin_path_is_404(secured: BrokerProcess) -> None:
    assert get(secured, "/nope", TOKEN)[0] == 404
