"""Federation in every virtual host, with real brokers and pika (docs/federation.md,
"Virtual hosts").

A federated exchange names its local vhost and its upstream's (default: the same name):
the link opens that vhost upstream as its user, and bindings, messages, dedup keys and
forwarding stay within the two vhosts; another vhost's exchange of the same name is
another link. Both sites serve `/`, `t1` and `t2` (users files); the upstream's user
`limited` may use `t1` only.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pika
import pytest

from twinmq.broker.federation.agent import queue_name
from twinmq.broker.federation.config import FederationConfig
from twinmq.broker.federation.dedup import LagWindow, scoped
from twinmq.testing.faultproxy import FaultProxy
from twinmq.testing.launcher import BrokerProcess, free_port
from twinmq.testing.pair import status
from twinmq.testing.waiting import wait_for

VHOSTS = ["/", "t1", "t2"]
PASSWORD_ENV = "TWINMQ_TEST_FEDERATION_PASSWORD"


def users_file(path: Path) -> Path:
    """`guest` everywhere; `limited` in `t1` only (both may be a federation link's user)."""
    grants = [
        *({"user": "guest", "vhost": v, "configure": ".*", "write": ".*", "read": ".*"}
          for v in VHOSTS),
        {"user": "limited", "vhost": "t1", "configure": ".*", "write": ".*", "read": ".*"},
    ]  # fmt: skip
    path.write_text(
        json.dumps(
            {
                "users": [
                    {"name": "guest", "password": "guest", "tags": ["federation"]},
                    {"name": "limited", "password": "guest", "tags": "federation"},
                ],
                "vhosts": [{"name": v} for v in VHOSTS],
                "permissions": grants,
            }
        )
    )
    return path


def broker(tmp: Path, server_id: str, federation: Path | None = None) -> BrokerProcess:
    """A site serving VHOSTS, federating per `federation` if given (not started)."""
    args = ["--server-id", server_id, "--users-file", str(users_file(tmp / f"{server_id}.json"))]
    if federation is not None:
        args += ["--federation-config", str(federation)]
    return BrokerProcess(
        tmp / server_id / "data", name=server_id, port=free_port(), extra_args=args,
        env={PASSWORD_ENV: "guest"},
    )  # fmt: skip


def federation_file(path: Path, upstreams: dict[str, str], exchanges: list[dict[str, Any]]) -> Path:
    """Upstream name -> `user@host:port/path`; the exchanges as given."""
    path.write_text(
        json.dumps(
            {
                "upstreams": {
                    name: {"uri": f"amqp://{where}", "password-env": PASSWORD_ENV}
                    for name, where in upstreams.items()
                },
                "exchanges": exchanges,
            }
        )
    )
    return path


def connect(site: BrokerProcess, vhost: str) -> pika.BlockingConnection:
    return pika.BlockingConnection(
        pika.ConnectionParameters(
            host="127.0.0.1", port=site.port, virtual_host=vhost,
            credentials=pika.PlainCredentials("guest", "guest"), connection_attempts=1,
        )
    )  # fmt: skip


def links(site: BrokerProcess) -> dict[tuple[str, str], dict[str, Any]]:
    """The site's links by (local vhost, local exchange)."""
    data = status(site)
    if data is None or data["federation"] is None:
        return {}
    return {(link["vhost"], link["exchange"]): link for link in data["federation"]["links"]}


def wait_running(site: BrokerProcess, vhost: str, exchange: str) -> None:
    wait_for(
        f"link {vhost}/{exchange} running",
        lambda: (links(site).get((vhost, exchange)) or {}).get("state") == "running",
    )


def bind(site: BrokerProcess, vhost: str, queue: str, exchange: str, key: str) -> None:
    connection = connect(site, vhost)
    ch = connection.channel()
    ch.queue_declare(queue, durable=True)
    ch.queue_bind(queue, exchange, key)
    connection.close()


def held_upstream(site: BrokerProcess, vhost: str) -> dict[str, set[tuple[str, str]]]:
    """The downstreams' link queues in `vhost` of `site` and their (exchange, key)s."""
    data = status(site)
    assert data is not None
    federation = data["federation"]
    queues = (
        federation["federation_queues"]
        if vhost == "/"
        else federation["vhost_federation_queues"].get(vhost, {})
    )
    return {q: {(b["exchange"], b["routing_key"]) for b in held} for q, held in queues.items()}


def publish(site: BrokerProcess, vhost: str, exchange: str, key: str, bodies: list[bytes]) -> None:
    connection = connect(site, vhost)
    ch = connection.channel()
    ch.confirm_delivery()
    for body in bodies:
        ch.basic_publish(exchange, key, body, pika.BasicProperties(delivery_mode=2))
    connection.close()


def drain(site: BrokerProcess, vhost: str, queue: str, at_least: int = 0) -> list[bytes]:
    """basic.get until empty and at least `at_least` taken (a republished message is
    visible once its batch is durable)."""
    connection = connect(site, vhost)
    ch = connection.channel()
    out: list[bytes] = []

    def drained() -> bool:
        while True:
            method, _props, body = ch.basic_get(queue, auto_ack=True)
            if method is None:
                return len(out) >= at_least
            out.append(body)

    try:
        wait_for(f"{at_least} messages from {vhost}/{queue}", drained)
        return out
    finally:
        connection.close()


def depth(site: BrokerProcess, vhost: str, queue: str) -> int:
    data = status(site)
    if data is None:
        return -1
    for q in data["queues"]:
        if q["name"] == queue and q["vhost"] == vhost:
            return int(q["messages"])
    return -1


def settled(site: BrokerProcess, vhost: str, queue: str) -> bool:
    data = status(site)
    return data is not None and any(
        q["name"] == queue and q["vhost"] == vhost and q["messages"] == 0 and q["unacked"] == 0
        for q in data["queues"]
    )


def config(uri: str, *exchanges: dict[str, Any]) -> FederationConfig:
    return FederationConfig.model_validate(
        {"upstreams": {"up": {"uri": uri}}, "exchanges": list(exchanges)}
    )


@pytest.mark.parametrize(
    ("uri", "exchange", "opened"),
    [
        ("amqp://fed@h/", {}, "/"),  # as before vhosts
        ("amqp://fed@h", {"vhost": "t1"}, "t1"),  # the same name
        ("amqp://fed@h/", {"vhost": "t1"}, "t1"),
        ("amqp://fed@h/t2", {"vhost": "t1"}, "t2"),  # the URI's, as RabbitMQ's
        ("amqp://fed@h/%2F", {"vhost": "t1"}, "/"),
        ("amqp://fed@h/t2", {"vhost": "t1", "upstream-vhost": "t3"}, "t3"),  # the exchange's
    ],
)
def test_the_upstream_vhost_is_the_exchanges_then_the_uris_then_the_same_name(
    uri: str, exchange: dict[str, Any], opened: str
) -> None:
    loaded = config(uri, {"exchange": "x", "upstream": "up", **exchange})
    (fed,) = loaded.exchanges
    upstream = loaded.upstreams["up"]
    assert fed.source_vhost(upstream) == opened
    # What the link's client opens (wire.Address reads the path back).
    assert upstream.connect_uri(opened).endswith("/" + ("%2F" if opened == "/" else opened))


def test_two_exchanges_sharing_one_upstream_link_queue_are_refused() -> None:
    # The same exchange name in two vhosts from two upstream vhosts: two link queues.
    config(
        "amqp://fed@h/",
        {"exchange": "x", "upstream": "up"},
        {"exchange": "x", "upstream": "up", "vhost": "t1"},
    )
    with pytest.raises(ValueError, match="would share one link queue"):
        config(
            "amqp://fed@h/",
            {"exchange": "x", "upstream": "up"},
            {"exchange": "x", "upstream": "up", "vhost": "t1", "upstream-vhost": "/"},
        )
    with pytest.raises(ValueError, match="'x' in vhost 't1' is federated twice"):
        config(
            "amqp://fed@h/",
            {"exchange": "x", "upstream": "up", "vhost": "t1"},
            {"exchange": "x", "upstream": "up", "vhost": "t1", "upstream-vhost": "t2"},
        )


def test_dedup_keys_are_unchanged_in_root_and_apart_in_each_other_vhost() -> None:
    key = "central\x0042"
    assert scoped("/", key) == key  # `/`'s bytes, as before vhosts
    assert len({scoped("/", key), scoped("t1", key), scoped("t2", key)}) == 3
    # A client upstream in `/` stamping another vhost's scoped origin gets a key of its own.
    forged = '["t1", "central"]\x0042'
    assert scoped("/", forged) not in {scoped("t1", key), key}
    assert scoped("/", forged) != scoped("t1", forged)
    # A window of 2 with a link that has passed nothing: older keys go to their origin's
    # bitmap, which a scoped key still names (its origin [vhost, origin], its seq).
    window = LagWindow(2)
    window.register("link")
    for seq in range(1, 11):
        window.add(scoped("t1", f"central\x00{seq}"))
    assert window.lagged  # compacted, not forgotten
    assert all(scoped("t1", f"central\x00{seq}") in window for seq in range(1, 11))
    assert not any(scoped(v, f"central\x00{seq}") in window for v in ("/", "t2") for seq in (1, 5))


@dataclass
class Sites:
    central: BrokerProcess
    remote: BrokerProcess


@pytest.fixture(scope="module")
def sites(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sites]:
    """`remote` federates from `central`: `market` in `t1` <- `t1`; `market` in `/` <- `/`
    (the same name, another link); `prices` in `t1` <- `t2` (`upstream-vhost`); `audit` in
    `t1` from an upstream URI naming `t2` as user `limited`, who may not use `t2`; `rpc`
    in `t1` <- `t1`, forwarding, with global keys."""
    tmp = tmp_path_factory.mktemp("fedvhosts")
    central = broker(tmp, "central")
    central.start()
    address = f"127.0.0.1:{central.port}"
    config = federation_file(
        tmp / "remote-federation.json",
        {"central": f"guest@{address}/", "limited": f"limited@{address}/t2"},
        [
            {"exchange": "market", "vhost": "t1", "upstream": "central", "type": "direct"},
            {"exchange": "market", "upstream": "central", "type": "direct"},
            {"exchange": "prices", "vhost": "t1", "upstream": "central", "type": "topic",
             "upstream-vhost": "t2"},
            {"exchange": "audit", "vhost": "t1", "upstream": "limited", "type": "fanout"},
            {"exchange": "rpc", "vhost": "t1", "upstream": "central", "type": "direct",
             "forward": True, "global-keys": True},
        ],
    )  # fmt: skip
    remote = broker(tmp, "remote", config)
    remote.start()
    try:
        yield Sites(central, remote)
    finally:
        remote.stop()
        central.stop()


def test_pub_sub_across_sites_in_a_vhost(sites: Sites) -> None:
    central, remote = sites.central, sites.remote
    wait_running(remote, "t1", "market")
    link = links(remote)[("t1", "market")]
    assert link["upstream_vhost"] == "t1"
    bind(remote, "t1", "t1-orders", "market", "order")
    link_queue = queue_name("market", "remote")
    wait_for("the link queue bound in t1 upstream", lambda: depth(central, "t1", link_queue) == 0)
    wait_for(
        "the binding upstream",
        lambda: links(remote)[("t1", "market")]["bindings"] == 1,
    )
    publish(central, "t1", "market", "order", [b"t1-a", b"t1-b"])
    assert drain(remote, "t1", "t1-orders", 2) == [b"t1-a", b"t1-b"]


def test_a_vhost_federates_another_vhost_of_its_upstream(sites: Sites) -> None:
    central, remote = sites.central, sites.remote
    wait_running(remote, "t1", "prices")
    assert links(remote)[("t1", "prices")]["upstream_vhost"] == "t2"
    bind(remote, "t1", "t1-prices", "prices", "eur.#")
    wait_for("the binding upstream", lambda: links(remote)[("t1", "prices")]["bindings"] == 1)
    # The link queue and its binding are in t2 upstream, none in t1.
    link_queue = queue_name("prices", "remote")
    wait_for(
        "the binding in t2 upstream",
        lambda: held_upstream(central, "t2").get(link_queue) == {("prices", "eur.#")},
    )
    assert link_queue not in held_upstream(central, "t1")
    publish(central, "t2", "prices", "eur.usd", [b"1.08"])
    assert drain(remote, "t1", "t1-prices", 1) == [b"1.08"]


def test_the_same_exchange_name_in_two_vhosts_is_two_links_and_nothing_crosses(
    sites: Sites,
) -> None:
    central, remote = sites.central, sites.remote
    wait_running(remote, "/", "market")
    wait_running(remote, "t1", "market")
    bind(remote, "/", "root-orders", "market", "order")
    bind(remote, "t1", "t1-only", "market", "order")
    for vhost in ("/", "t1"):
        wait_for(
            f"{vhost}'s binding upstream",
            lambda v=vhost: links(remote)[(v, "market")]["bindings"] == 1,
        )
    publish(central, "/", "market", "order", [b"root-1"])
    publish(central, "t1", "market", "order", [b"t1-1"])
    assert drain(remote, "/", "root-orders", 1) == [b"root-1"]
    assert drain(remote, "t1", "t1-only", 1) == [b"t1-1"]
    # The t1 queues of the first test got t1's message only.
    assert drain(remote, "t1", "t1-orders", 1) == [b"t1-1"]
    # Two links, two dedup key spaces: each vhost's link republished its own message.
    assert links(remote)[("/", "market")]["duplicates_dropped"] == 0
    assert links(remote)[("t1", "market")]["duplicates_dropped"] == 0


def test_a_link_whose_user_may_not_use_the_upstream_vhost_says_so(sites: Sites) -> None:
    link = wait_for(
        "the audit link's refusal in its status",
        lambda: (
            (found := links(sites.remote).get(("t1", "audit"))) is not None
            and "access to vhost 't2' refused for user 'limited'" in (found["error"] or "")
            and found
        ),
    )
    assert link["state"] != "running"
    assert link["upstream_vhost"] == "t2"


def test_status_says_federation_serves_every_vhost(sites: Sites) -> None:
    data = status(sites.central)
    assert data is not None
    assert all(v["federated"] for v in data["vhosts"])


TOTAL = 1500


@pytest.mark.slow
def test_link_cuts_under_confirmed_traffic_in_a_vhost_lose_none_and_deliver_none_twice(
    tmp_path: Path,
) -> None:
    central = broker(tmp_path, "central")
    central.start()
    proxy = FaultProxy(f"127.0.0.1:{central.port}").start()
    config = federation_file(
        tmp_path / "remote-federation.json",
        {"central": f"guest@{proxy.address}/"},
        [{"exchange": "orders", "vhost": "t1", "upstream": "central", "type": "direct",
          "prefetch": 64}],
    )  # fmt: skip
    remote = broker(tmp_path, "remote", config)
    remote.start()
    try:
        wait_running(remote, "t1", "orders")
        bind(remote, "t1", "inbox", "orders", "order.new")
        wait_for("the binding upstream", lambda: links(remote)[("t1", "orders")]["bindings"] == 1)
        # The links' news: on each side's amq.peer of the link's vhost, none in `/`.
        for site in (remote, central):
            for vhost in ("/", "t1"):
                bind(site, vhost, "peer-news", "amq.peer", "")
        confirmed: list[int] = []

        def publisher() -> None:
            connection = connect(central, "t1")
            ch = connection.channel()
            ch.confirm_delivery()
            for i in range(TOTAL):
                ch.basic_publish(
                    "orders", "order.new", str(i).encode(), pika.BasicProperties(delivery_mode=2)
                )
                confirmed.append(i)  # returned: confirmed by the broker
            connection.close()

        thread = threading.Thread(target=publisher)
        thread.start()
        try:
            for cut in range(1, 3):
                received = links(remote)[("t1", "orders")]["messages_received"]
                wait_for(
                    f"traffic before cut {cut}",
                    lambda r=received: (
                        links(remote)[("t1", "orders")]["messages_received"] > r + 50
                        or not thread.is_alive()
                    ),
                )
                proxy.cut()
                wait_for(
                    "the link down",
                    lambda: links(remote)[("t1", "orders")]["state"] != "running",
                )
                proxy.heal()
                wait_running(remote, "t1", "orders")
        finally:
            thread.join(120)
        assert len(confirmed) == TOTAL
        link_queue = queue_name("orders", "remote")
        wait_for(
            "every confirmed message downstream",
            lambda: depth(remote, "t1", "inbox") >= TOTAL and settled(central, "t1", link_queue),
            timeout=120,
        )
        bodies = sorted(int(b) for b in drain(remote, "t1", "inbox", TOTAL))
        assert bodies == list(range(TOTAL))  # none lost, none twice
        assert links(remote)[("t1", "orders")]["messages_received"] == TOTAL
        news = [json.loads(b) for b in drain(remote, "t1", "peer-news", 4)]
        events = [(n["event"], n["link"]) for n in news if n["event"].startswith("link-")]
        assert events.count(("link-down", "orders")) == 2
        assert events.count(("link-up", "orders")) == 2
        upstream_news = [json.loads(b) for b in drain(central, "t1", "peer-news", 2)]
        assert [n["event"] for n in upstream_news if n["to_peer"]] == ["link-up", "link-up"]
        assert not [
            n for n in map(json.loads, drain(remote, "/", "peer-news")) if n.get("link")
        ]  # nothing of t1's link in `/`
    finally:
        remote.stop()
        proxy.close()
        central.stop()


def test_a_vhost_forwards_its_clients_publishes_to_the_upstream_vhost(sites: Sites) -> None:
    central, remote = sites.central, sites.remote
    wait_running(remote, "t1", "rpc")
    connection = connect(central, "t1")
    connection.channel().exchange_declare("rpc", "direct", durable=True)
    connection.close()
    bind(central, "t1", "calculator", "rpc", "calc")
    publish(remote, "t1", "rpc", "calc", [b"1+1"])
    assert drain(central, "t1", "calculator", 1) == [b"1+1"]
    wait_for("the outbox settled", lambda: links(remote)[("t1", "rpc")]["forward_pending"] == 0)
    assert links(remote)[("t1", "rpc")]["messages_forwarded"] == 1
    # The outbox is t1's, the same name in `/` is not there.
    assert depth(remote, "t1", "amq.twinmq.federation-out:rpc") == 0
    assert depth(remote, "/", "amq.twinmq.federation-out:rpc") == -1


def test_a_reply_on_the_upstream_vhosts_default_exchange_reaches_a_vhosts_reply_queue(
    sites: Sites,
) -> None:
    """Global keys in t1: the client's temporary queue is bound to t1's `rpc` under its
    global key (upstream too, in t1), its `reply-to` made global, and a service answering
    on t1's default exchange upstream reaches it through t1's link queue."""
    central, remote = sites.central, sites.remote
    wait_running(remote, "t1", "rpc")
    client = connect(remote, "t1")
    ch = client.channel()
    ch.queue_declare("replies", exclusive=True)
    link_queue = queue_name("rpc", "remote")
    wait_for(
        "the global key bound upstream in t1",
        lambda: ("rpc", "remote.replies") in held_upstream(central, "t1").get(link_queue, set()),
    )
    connection = connect(central, "t1")
    service = connection.channel()
    service.exchange_declare("rpc", "direct", durable=True)
    service.queue_declare("calculator", durable=True)
    service.queue_bind("calculator", "rpc", "calc")
    ch.confirm_delivery()
    ch.basic_publish("rpc", "calc", b"2+2", pika.BasicProperties(reply_to="replies"))
    request: list[Any] = []
    wait_for(
        "the request at the service",
        lambda: (
            (got := service.basic_get("calculator", auto_ack=True))[0] is not None
            and bool(request.append(got) or True)
        ),
    )
    _method, props, body = request[0]
    assert (body, props.reply_to) == (b"2+2", "remote.replies")
    service.basic_publish("", props.reply_to, b"4")  # as any RabbitMQ RPC server
    connection.close()
    reply: list[bytes] = []
    wait_for(
        "the reply in t1's temporary queue",
        lambda: (
            (got := ch.basic_get("replies", auto_ack=True))[0] is not None
            and bool(reply.append(got[2]) or True)
        ),
    )
    client.close()
    assert reply == [b"4"]


def test_each_vhost_publishes_its_own_state(sites: Sites) -> None:
    """A subscriber of t2's amq.twinmq.state gets t2's definitions (the link queue of
    `prices`), none of t1's."""
    connection = connect(sites.central, "t2")
    ch = connection.channel()
    queue = ch.queue_declare("", exclusive=True).method.queue
    ch.queue_bind(queue, "amq.twinmq.state")
    got: list[bytes] = []
    wait_for(
        "the full state",
        lambda: (
            (item := ch.basic_get(queue, auto_ack=True))[0] is not None
            and bool(got.append(item[2]) or True)
        ),
    )
    connection.close()
    state = json.loads(got[0])
    assert state["kind"] == "full"
    queues = {q["name"] for q in state["queues"]}
    assert queue_name("prices", "remote") in queues
    assert queue_name("market", "remote") not in queues  # t1's and /'s link queue


@pytest.mark.slow
def test_a_vhost_exchange_removed_from_the_file_has_its_queue_deleted_in_that_vhost_only(
    tmp_path: Path,
) -> None:
    """The orphan clean-up deletes a removed link's queue in the upstream vhost it was in,
    never the queue of the same name a configured link of another vhost uses."""
    central = broker(tmp_path, "central")
    central.start()
    upstreams = {"central": f"guest@127.0.0.1:{central.port}/"}
    root = {"exchange": "market", "upstream": "central", "type": "direct"}
    tenant = {**root, "vhost": "t1"}
    path = tmp_path / "remote-federation.json"
    remote = broker(tmp_path, "remote", federation_file(path, upstreams, [root, tenant]))
    link_queue = queue_name("market", "remote")
    try:
        remote.start()
        for vhost in ("/", "t1"):
            wait_running(remote, vhost, "market")
            bind(remote, vhost, "in", "market", "k")
            wait_for(
                f"the link queue bound in {vhost} upstream",
                lambda v=vhost: held_upstream(central, v).get(link_queue) == {("market", "k")},
            )
        remote.stop()
        federation_file(path, upstreams, [root])
        remote.start()
        wait_for("t1's link queue deleted upstream", lambda: depth(central, "t1", link_queue) == -1)
        data = status(remote)
        assert data is not None
        assert data["federation"]["upstream_queues_deleted"] == [f"central/t1/{link_queue}"]
        assert depth(central, "/", link_queue) == 0  # `/`'s link still uses its own
        wait_running(remote, "/", "market")
        publish(central, "/", "market", "k", [b"still federated"])
        assert drain(remote, "/", "in", 1) == [b"still federated"]
    finally:
        remote.stop()
        central.stop()
