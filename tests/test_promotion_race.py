"""A promotion while the passive's replica is mid-handshake or mid-catch-up (commit 371afd0).

`POST /role active` stops the passive's replica task; a second role change that runs
while that stop awaits (the Lease keeper fencing a broker it did not know was promoted,
in `make demo`; here an operator's retried promotion) stopped it a second time, and the
two stops met a cleared task: POST /role answered 500 and the backup was never
promoted. Real brokers (`testing/pair.py`); each cycle kills the active, sends the same
promotion twice in one instant on two connections opened beforehand, and requires a 200
(the other answer a 200 or a 409 for the epoch now taken), never an error, and an active
broker; then the old active rejoins as the passive of the next cycle. On the broker code
of 371afd0^ it fails in its first cycle (`[200, 500]`, three runs of three).
"""

from __future__ import annotations

import socket

import pytest
from test_catchup import PIPE, bodies, catchup, publish
from test_catchup import pair as pair  # the fixture: small catch-up chunks

from twinmq.broker.api import RoleRequest
from twinmq.broker.names import ACTIVE, ADMIN_TOKEN_ENV
from twinmq.testing.launcher import BrokerProcess
from twinmq.testing.pair import Pair, status
from twinmq.testing.waiting import wait_for

CYCLES = 6  # alternately mid-handshake and mid-catch-up


def promote_twice_at_once(broker: BrokerProcess, epoch: int) -> list[int]:
    """Two identical `POST /role` active at `epoch`, written back to back on two connections
    opened beforehand (so the broker reads both in one turn of its loop); their HTTP codes."""
    body = RoleRequest(role=ACTIVE, epoch=epoch).model_dump_json().encode()
    token = broker.env.get(ADMIN_TOKEN_ENV)
    head = (
        f"POST /role HTTP/1.1\r\nHost: {broker.host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n"
        + (f"Authorization: Bearer {token}\r\n" if token else "")
        + "\r\n"
    )
    request = head.encode() + body
    connections = [
        socket.create_connection((broker.host, broker.admin_port), timeout=30) for _ in range(2)
    ]
    try:
        for connection in connections:
            connection.sendall(request)
        return [_status_code(connection) for connection in connections]
    finally:
        for connection in connections:
            connection.close()


def _status_code(connection: socket.socket) -> int:
    """The status code of the HTTP response on `connection`."""
    data = b""
    while b"\r\n" not in data:
        more = connection.recv(4096)
        if not more:
            break
        data += more
    return int(data.split(b" ", 2)[1])


def _mid_handshake(pair: Pair) -> None:
    """Partition the link: the passive finds it silent, drops it and connects again, and
    its new connection hangs waiting for the active's CHALLENGE."""
    passive, link = pair.passive, pair.link
    link.partition()
    wait_for(
        "the passive's link lost",
        lambda: not (status(passive) or {}).get("replication", {}).get("link_connected", True),
        20,
    )
    accepted = link.accepted
    wait_for("the passive connecting again", lambda: link.accepted > accepted, 20)


def _mid_catch_up(pair: Pair) -> None:
    """Restart the passive behind a backlog through a thin link and partition the link
    once the catch-up is under way (chunks on its disk, more to come)."""
    active, passive = pair.active, pair.passive
    passive.kill()
    publish(active, "backlog", bodies("backlog", 300))
    pair.link.throttle(PIPE)
    passive.start()

    def under_way() -> bool:
        state = catchup(active)
        return state is not None and state["in_progress"] and state["acked_chunks"] >= 1

    wait_for("a catch-up under way", under_way, 30, interval=0.02)
    pair.link.partition()


@pytest.mark.slow  # six failovers, about 20 s
def test_a_promotion_mid_handshake_or_mid_catch_up_answers_200_and_the_broker_is_active(
    pair: Pair,
) -> None:
    for cycle in range(CYCLES):
        if cycle % 2:
            _mid_catch_up(pair)
        else:
            _mid_handshake(pair)
        old, new = pair.active, pair.passive
        old.kill()  # the failover's kill -9: the passive is left as it was, mid-way
        codes = promote_twice_at_once(new, pair.epoch + 1)
        assert 200 in codes and set(codes) <= {200, 409}, f"cycle {cycle}: {codes}"
        role = (status(new) or {}).get("role")
        assert role == ACTIVE, f"cycle {cycle}: {new.name} is {role} after {codes}"
        # The rig's bookkeeping (a third, idempotent promotion at the same epoch; the link
        # to the new active), then the old active rejoins as its passive.
        pair.promote_passive()
        pair.link.heal()
        pair.rejoin(old)
        pair.wait_healthy(30)
