"""Upstream queues of federated exchanges removed from the federation file (issue 15),
with real brokers: deleted on an upstream still named, reported for an upstream gone;
never a queue of another downstream or of a link still configured."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from federationsites import (
    bind_queue,
    federation_file,
    get_all,
    publish_confirmed,
    queue_depth,
    site,
    wait_running,
    wait_upstream_bindings,
)

from twinmq.broker.federation.agent import queue_name
from twinmq.broker.federation.orphans import link_exchange
from twinmq.testing.launcher import BrokerProcess
from twinmq.testing.pair import status
from twinmq.testing.waiting import wait_for


def federation_status(broker: BrokerProcess) -> dict[str, Any]:
    """The `federation` section of `broker`'s `/status` (empty if it does not answer)."""
    data = status(broker)
    return (data or {}).get("federation") or {}


def upstream_queues(broker: BrokerProcess) -> set[str]:
    """The names of the queues on `broker`."""
    data = status(broker)
    assert data is not None
    return {q["name"] for q in data["queues"]}


def test_an_exchange_removed_from_the_file_has_its_upstream_queue_deleted_and_no_other(
    tmp_path: Path,
) -> None:
    central = site(tmp_path, "central")
    central.start()
    address = {"central": f"127.0.0.1:{central.port}"}
    both = [
        {"exchange": "market", "upstream": "central", "type": "direct"},
        {"exchange": "news", "upstream": "central", "type": "direct"},
    ]
    config = federation_file(tmp_path / "remote.json", address, both)
    remote = site(tmp_path, "remote", federation=config)
    # Another downstream federating the same exchange: its queue on central must stay.
    branch = site(
        tmp_path,
        "branch",
        federation=federation_file(tmp_path / "branch.json", address, both[:1]),
    )
    removed, kept = queue_name("market", "remote"), queue_name("news", "remote")
    others = queue_name("market", "branch")
    try:
        remote.start()
        branch.start()
        for exchange in ("market", "news"):
            wait_running(remote, exchange)
            bind_queue(remote, f"{exchange}-in", exchange, "k")
            wait_upstream_bindings(central, queue_name(exchange, "remote"), {(exchange, "k")})
        wait_running(branch, "market")
        bind_queue(branch, "market-in", "market", "k")
        wait_upstream_bindings(central, others, {("market", "k")})
        remote.stop()
        # While remote is down, its market queue upstream collects what it no longer wants.
        publish_confirmed(central, "market", [("k", b"unwanted")])
        wait_for(f"{removed} holds a message", lambda: queue_depth(central, removed) == 1)
        federation_file(tmp_path / "remote.json", address, both[1:])
        remote.start()
        wait_for(
            f"{removed} deleted on central",
            lambda: (
                federation_status(remote).get("upstream_queues_deleted") == [f"central/{removed}"]
            ),
        )
        queues = upstream_queues(central)
        assert removed not in queues
        assert {kept, others} <= queues
        fed = federation_status(remote)
        assert fed["upstream_queues_pending"] == []
        assert fed["upstream_queues_left"] == []
        # The link still configured delivers, and so does the other downstream's.
        wait_running(remote, "news")
        publish_confirmed(central, "news", [("k", b"news")])
        publish_confirmed(central, "market", [("k", b"market")])
        assert [body for _, body, _ in get_all(remote, "news-in", at_least=1)] == [b"news"]
        market = [body for _, body, _ in get_all(branch, "market-in", at_least=2)]
        assert market == [b"unwanted", b"market"]
        # Once: a restart with the same file deletes nothing more.
        remote.stop()
        remote.start()
        wait_running(remote, "news")
        assert federation_status(remote)["upstream_queues_deleted"] == []
        assert {kept, others} <= upstream_queues(central)
    finally:
        branch.stop()
        remote.stop()
        central.stop()


def test_an_upstream_removed_from_the_file_is_reported_with_the_queues_it_keeps(
    tmp_path: Path,
) -> None:
    central, other = site(tmp_path, "central"), site(tmp_path, "other")
    central.start()
    other.start()
    addresses = {"central": f"127.0.0.1:{central.port}", "other": f"127.0.0.1:{other.port}"}
    exchanges = [
        {"exchange": "market", "upstream": "central", "type": "direct"},
        {"exchange": "news", "upstream": "other", "type": "direct"},
    ]
    config = federation_file(tmp_path / "remote.json", addresses, exchanges)
    remote = site(tmp_path, "remote", federation=config)
    left = queue_name("news", "remote")
    try:
        remote.start()
        wait_running(remote, "market")
        wait_running(remote, "news")
        remote.stop()
        federation_file(tmp_path / "remote.json", {"central": addresses["central"]}, exchanges[:1])
        remote.start()
        wait_running(remote, "market")
        fed = federation_status(remote)
        assert fed["upstream_queues_left"] == [f"other/{left}"]
        assert fed["upstream_queues_deleted"] == []
        assert left in upstream_queues(other)  # no credentials for it: left, reported
        assert queue_name("market", "remote") in upstream_queues(central)
        assert remote.log_path is not None
        assert f"other/{left} (exchange news no longer federated) NOT deleted" in (
            remote.log_path.read_text()
        )
    finally:
        remote.stop()
        other.stop()
        central.stop()


MARKET_AND_NEWS = [
    {"exchange": "market", "upstream": "central", "type": "direct"},
    {"exchange": "news", "upstream": "central", "type": "direct"},
]


def central_and_remote(tmp_path: Path) -> tuple[BrokerProcess, dict[str, str], BrokerProcess]:
    """Central, started; its address; and a remote (not started) federating market and
    news from it."""
    central = site(tmp_path, "central")
    central.start()
    address = {"central": f"127.0.0.1:{central.port}"}
    config = federation_file(tmp_path / "remote.json", address, MARKET_AND_NEWS)
    return central, address, site(tmp_path, "remote", federation=config)


def test_an_upstream_unreachable_at_start_has_the_orphan_queue_deleted_once_it_is_back(
    tmp_path: Path,
) -> None:
    central, address, remote = central_and_remote(tmp_path)
    exchanges = MARKET_AND_NEWS
    removed = queue_name("market", "remote")
    try:
        remote.start()
        wait_running(remote, "market")
        wait_running(remote, "news")
        remote.stop()
        central.stop()
        federation_file(tmp_path / "remote.json", address, exchanges[1:])
        remote.start()
        wait_for(
            "the orphan queue pending",
            lambda: (
                federation_status(remote).get("upstream_queues_pending") == [f"central/{removed}"]
            ),
        )
        assert removed in (tmp_path / "remote" / "data" / "federation" / "links.json").read_text()
        central.start()
        wait_for(
            f"{removed} deleted on central",
            lambda: (
                federation_status(remote).get("upstream_queues_deleted") == [f"central/{removed}"]
            ),
        )
        assert federation_status(remote)["upstream_queues_pending"] == []
        assert removed not in upstream_queues(central)
        assert queue_name("news", "remote") in upstream_queues(central)
    finally:
        remote.stop()
        central.stop()


def test_a_wiped_downstream_finds_its_orphan_queue_in_the_upstreams_state_and_no_other(
    tmp_path: Path,
) -> None:
    central, address, remote = central_and_remote(tmp_path)
    both = MARKET_AND_NEWS
    # Another downstream federating the same exchange: its queue on central must stay.
    branch = site(
        tmp_path,
        "branch",
        federation=federation_file(tmp_path / "branch.json", address, both[:1]),
    )
    removed, kept = queue_name("market", "remote"), queue_name("news", "remote")
    others = queue_name("market", "branch")
    try:
        remote.start()
        branch.start()
        wait_running(remote, "market")
        wait_running(remote, "news")
        wait_running(branch, "market")
        remote.stop()
        # The data dir wiped (links.json with it), and restarted with fewer links: nothing
        # here remembers the market link, central's state still names its queue.
        shutil.rmtree(tmp_path / "remote" / "data")
        federation_file(tmp_path / "remote.json", address, both[1:])
        remote.start()
        wait_for(
            f"{removed} deleted on central",
            lambda: (
                federation_status(remote).get("upstream_queues_deleted") == [f"central/{removed}"]
            ),
        )
        fed = federation_status(remote)
        assert fed["upstream_queues_found"] == [f"central/{removed}"]
        assert fed["upstream_queues_pending"] == []
        queues = upstream_queues(central)
        assert removed not in queues
        assert {kept, others} <= queues
        wait_running(remote, "news")
        # Found once: the next start finds nothing more.
        remote.stop()
        remote.start()
        wait_running(remote, "news")
        fed = federation_status(remote)
        assert fed["upstream_queues_found"] == [] and fed["upstream_queues_deleted"] == []
        assert {kept, others} <= upstream_queues(central)
    finally:
        branch.stop()
        remote.stop()
        central.stop()


def test_only_a_link_queue_name_that_splits_one_way_is_taken_for_this_servers() -> None:
    assert link_exchange(queue_name("market", "remote"), "remote") == "market"
    assert link_exchange(queue_name("market", "branch"), "remote") is None
    assert link_exchange("market-in", "remote") is None
    # A server "eu:remote" federating market, or an exchange "a:market": not ours to take.
    assert link_exchange(queue_name("market", "eu:remote"), "remote") is None
    assert link_exchange(queue_name("a:market", "remote"), "remote") is None
    assert link_exchange(queue_name("market", "eu:remote"), "eu:remote") is None
