"""`amq.peer`: peer status messages on every server, read by a plain AMQP subscriber."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pika
from federationsites import (
    bind_queue,
    federated,
    federation_file,
    get_all,
    links,
    site,
    wait_running,
)

from twinmq.testing.launcher import BrokerProcess
from twinmq.testing.pair import status
from twinmq.testing.waiting import wait_for


def _watch(broker: BrokerProcess) -> None:
    bind_queue(broker, "peer-watch", "amq.peer", "")


def _events(broker: BrokerProcess, at_least: int) -> list[dict[str, Any]]:
    events = []
    for key, body, _headers in get_all(broker, "peer-watch", at_least):
        event = json.loads(body)
        assert event["event"] == key
        events.append(event)
    return events


def test_a_link_going_down_and_up_is_announced_on_amq_peer_on_both_sides(
    tmp_path: Path,
) -> None:
    with federated(tmp_path, "market", "topic", proxied=True, forward=True) as sites:
        central, remote, proxy = sites.central, sites.remote, sites.proxy
        assert proxy is not None
        wait_running(remote, "market")
        _watch(central)
        _watch(remote)
        proxy.cut()
        wait_for("the link down", lambda: links(remote)["market"]["state"] != "running")
        proxy.heal()
        wait_running(remote, "market")
        down, up = _events(remote, 2)
        assert (down["event"], down["peer"], down["link"], down["server_id"]) == (
            "link-down", "central", "market", "remote",
        )  # fmt: skip
        assert down["reason"]
        assert (up["event"], up["peer"], up["link"]) == ("link-up", "central", "market")
        # Upstream side: the peer's connection went and came back (a reconnect attempt
        # cut during its handshake may add a pair in between), and the remote's link-up
        # came too, sent by the link to central's amq.peer (seed 002's direction).
        everything = _events(central, 3)
        seen = [event for event in everything if not event["to_peer"]]
        assert seen[0]["event"] == "peer-disconnected" and seen[0]["peer"] == "remote"
        assert seen[-1]["event"] == "peer-connected" and seen[-1]["peer"] == "remote"
        assert all(event["server_id"] == "central" for event in seen)
        sent = [event for event in everything if event["to_peer"]]
        assert [(e["event"], e["server_id"], e["peer"], e["link"]) for e in sent] == [
            ("link-up", "remote", "central", "market")
        ]


def test_a_running_link_reports_its_lag_and_both_epochs_periodically_on_amq_peer(
    tmp_path: Path,
) -> None:
    with federated(
        tmp_path, "market", "topic", forward=True, settings={"status-interval-seconds": 0.5}
    ) as sites:
        remote = sites.remote
        wait_running(remote, "market")
        _watch(remote)
        central_status, remote_status = status(sites.central), status(remote)
        assert central_status is not None and remote_status is not None
        central_epoch, remote_epoch = central_status["epoch"], remote_status["epoch"]
        # Nothing happens on the link: the status comes anyway.
        first, second = _events(remote, 2)[:2]
        for event in (first, second):
            assert (event["event"], event["peer"], event["link"]) == (
                "link-status", "central", "market",
            )  # fmt: skip
            assert (event["epoch"], event["peer_epoch"]) == (remote_epoch, central_epoch)
            assert event["forward_pending"] == 0 and event["upstream_state_seq"] >= 0


def test_a_running_link_sends_its_status_to_the_upstreams_amq_peer(tmp_path: Path) -> None:
    """Seed 002: status goes to the *peer's* amq.peer through the peering. Central's
    subscribers see the remote's link-status (its lag, counts and both epochs) with the
    remote as `server_id`, transient; central counts them."""
    with federated(
        tmp_path, "market", "topic", forward=True, settings={"status-interval-seconds": 0.5}
    ) as sites:
        central, remote = sites.central, sites.remote
        wait_running(remote, "market")
        _watch(central)
        connection = pika.BlockingConnection(pika.URLParameters(central.url))
        try:
            ch = connection.channel()
            got: list[tuple[Any, bytes]] = []
            wait_for(
                "two link-status messages from the remote",
                lambda: (
                    (m := ch.basic_get("peer-watch", auto_ack=True))[0] is not None
                    and got.append((m[1], m[2])) is None
                    and sum(json.loads(b)["event"] == "link-status" for _p, b in got) >= 2
                ),
            )
        finally:
            connection.close()
        central_status, remote_status = status(central), status(remote)
        assert central_status is not None and remote_status is not None
        statuses = [(p, json.loads(b)) for p, b in got if json.loads(b)["event"] == "link-status"]
        for properties, event in statuses:
            assert properties.delivery_mode == 1  # transient: news, not data to keep
            assert (event["server_id"], event["peer"], event["link"], event["to_peer"]) == (
                "remote", "central", "market", True,
            )  # fmt: skip
            assert (event["epoch"], event["peer_epoch"]) == (
                remote_status["epoch"], central_status["epoch"],
            )  # fmt: skip
        assert central_status["federation"]["peer_status_received"] >= 2
        assert central_status["federation"]["peer_status_dropped"] == 0


def test_a_status_the_links_user_may_not_write_to_amq_peer_is_dropped_and_the_link_runs_on(
    tmp_path: Path,
) -> None:
    """The link's user may do everything on central but write to amq.peer: its status
    messages are dropped and counted there, never a 403 that would close the link's
    channel (a status is news, the link is the data)."""
    users = tmp_path / "users.json"
    users.write_text(
        json.dumps(
            {
                "users": [{"name": "guest", "password": "guest", "tags": ["federation"]}],
                "permissions": [
                    {
                        "user": "guest", "vhost": "/", "configure": ".*",
                        "write": "^(?!amq\\.peer$).*", "read": ".*",
                    }
                ],
            }
        )
    )  # fmt: skip
    central = site(tmp_path, "central")
    central.extra_args += ["--users-file", str(users)]
    with central.start():
        config = federation_file(
            tmp_path / "remote.json",
            {"central": f"127.0.0.1:{central.port}"},
            [{"exchange": "market", "upstream": "central", "type": "topic"}],
            {"status-interval-seconds": 0.5},
        )
        with site(tmp_path, "remote", federation=config).start() as remote:
            since = wait_running(remote, "market")["running_since"]
            wait_for(
                "link-status messages dropped on central",
                lambda: (
                    (data := status(central)) is not None
                    and data["federation"]["peer_status_dropped"] >= 2
                ),
            )
            data = status(central)
            assert data is not None and data["federation"]["peer_status_received"] == 0
            link = links(remote)["market"]
            # The same session all along: nothing closed the link's channel.
            assert (link["state"], link["running_since"]) == ("running", since)
