"""`amq.peer`: peer status messages on every server, read by a plain AMQP subscriber."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from federationsites import bind_queue, federated, get_all, links, wait_running

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
        # cut during its handshake may add a pair in between).
        seen = _events(central, 2)
        assert seen[0]["event"] == "peer-disconnected" and seen[0]["peer"] == "remote"
        assert seen[-1]["event"] == "peer-connected" and seen[-1]["peer"] == "remote"
        assert all(event["server_id"] == "central" for event in seen)


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
