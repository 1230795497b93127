"""Federated brokers for the federation tests: real broker processes on loopback.

`Site` is one broker with its server identifier and, when it federates from others, a
federation file naming them (the upstream URI carries the user only; the password comes
from an environment variable, as in production). Helpers read each side's `/status`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pika
import pika.exceptions
from pika.adapters.blocking_connection import BlockingChannel

from twinmq.testing.faultproxy import FaultProxy
from twinmq.testing.launcher import BrokerProcess, free_port
from twinmq.testing.pair import Pair, status
from twinmq.testing.waiting import wait_for

PASSWORD_ENV = "TWINMQ_TEST_FEDERATION_PASSWORD"


def federation_file(
    path: Path,
    upstreams: dict[str, str],
    exchanges: list[dict[str, Any]],
    settings: dict[str, Any] | None = None,
) -> Path:
    """Write a federation file: upstream name -> host:port, the federated exchanges, and
    the file's other top-level `settings`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(
            {
                "upstreams": {
                    name: {"uri": f"amqp://guest@{address}/", "password-env": PASSWORD_ENV}
                    for name, address in upstreams.items()
                },
                "exchanges": exchanges,
                **(settings or {}),
            }
        )
    )
    return path


def site(
    tmp: Path,
    server_id: str,
    *,
    port: int = 0,
    federation: Path | None = None,
    name: str | None = None,
) -> BrokerProcess:
    """A broker (not started) with `--server-id` and maybe `--federation-config`."""
    args = ["--server-id", server_id]
    if federation is not None:
        args += ["--federation-config", str(federation)]
    return BrokerProcess(
        tmp / (name or server_id) / "data",
        name=name or server_id,
        port=port or free_port(),
        extra_args=args,
        env={PASSWORD_ENV: "guest"},
    )


@dataclass
class Federated:
    """Two started sites: `remote` federates an exchange of `central` (through `proxy`)."""

    central: BrokerProcess
    remote: BrokerProcess
    proxy: FaultProxy | None


@contextmanager
def federated(
    tmp: Path,
    exchange: str,
    kind: str,
    *,
    proxied: bool = False,
    settings: dict[str, Any] | None = None,
    **options: Any,
) -> Iterator[Federated]:
    """`central` (upstream) and `remote`, which federates central's `exchange` of type
    `kind` (with the exchange's other `options`, and the file's top-level `settings`),
    through a FaultProxy if `proxied`; both stopped at the end."""
    central = site(tmp, "central")
    central.start()
    proxy = FaultProxy(f"127.0.0.1:{central.port}").start() if proxied else None
    try:
        config = federation_file(
            tmp / "remote.json",
            {"central": proxy.address if proxy is not None else f"127.0.0.1:{central.port}"},
            [{"exchange": exchange, "upstream": "central", "type": kind, **options}],
            settings,
        )
        remote = site(tmp, "remote", federation=config)
        remote.start()
        try:
            yield Federated(central, remote, proxy)
        finally:
            remote.stop()
    finally:
        if proxy is not None:
            proxy.close()
        central.stop()


@contextmanager
def federated_pair(
    tmp: Path, exchange: str, kind: str, **options: Any
) -> Iterator[tuple[BrokerProcess, Pair]]:
    """`central` and a started downstream pair (server id `remote`) that federates
    central's `exchange` of type `kind`; both stopped at the end."""
    central = site(tmp, "central")
    central.start()
    try:
        config = federation_file(
            tmp / "remote.json",
            {"central": f"127.0.0.1:{central.port}"},
            [{"exchange": exchange, "upstream": "central", "type": kind, **options}],
        )
        pair = Pair(
            tmp / "pair",
            broker_args=["--server-id", "remote", "--federation-config", str(config)],
        )
        for broker in pair.brokers.values():
            broker.env[PASSWORD_ENV] = "guest"
        with pair:
            yield central, pair
    finally:
        central.stop()


@dataclass
class UpstreamPair:
    """A central pair (server id `central`) behind `vip`, the stand-in for its virtual IP
    (a proxy moved to the new active at a failover), and `remote`, a single server that
    federates central's exchange through the vip."""

    pair: Pair
    vip: FaultProxy
    remote: BrokerProcess

    @property
    def central(self) -> BrokerProcess:
        """The central pair's active broker."""
        return self.pair.active

    @property
    def vip_url(self) -> str:
        """An AMQP URL (guest) for central's virtual IP."""
        return f"amqp://guest:guest@{self.vip.address}/%2F"

    def failover(self) -> bool:
        """kill -9 central's active, promote its passive and move the vip to it (before
        the old active rejoins as passive); whether the passive was promoted."""

        def move_vip() -> None:
            self.vip.retarget(f"{self.pair.active.host}:{self.pair.active.port}")

        return self.pair.failover(on_promoted=move_vip)


@contextmanager
def federated_upstream_pair(
    tmp: Path, exchange: str, kind: str, **options: Any
) -> Iterator[UpstreamPair]:
    """A started central pair (both brokers with server id `central`: the pair is one
    server to its peers) behind a vip, and a started `remote` that federates central's
    `exchange` of type `kind` through the vip; all stopped at the end."""
    pair = Pair(tmp / "central", broker_args=["--server-id", "central"])
    with pair:
        vip = FaultProxy(f"{pair.active.host}:{pair.active.port}").start()
        try:
            config = federation_file(
                tmp / "remote.json",
                {"central": vip.address},
                [{"exchange": exchange, "upstream": "central", "type": kind, **options}],
            )
            remote = site(tmp, "remote", federation=config)
            remote.start()
            try:
                yield UpstreamPair(pair, vip, remote)
            finally:
                remote.stop()
        finally:
            vip.close()


def publish_counted(
    url: str,
    exchange: str,
    key: str,
    total: int,
    confirmed: list[int],
    *,
    stop: Callable[[], bool] = lambda: False,
    deadline_seconds: float = 180.0,
) -> None:
    """Publish persistent messages with bodies 0..total-1 on `exchange` with publisher
    confirms, reconnecting whenever the broker goes away (a failover), until all were
    sent, `stop()` or the deadline; the confirmed bodies go to `confirmed`. A message
    whose confirm was lost is not sent again (its copy, if any, may arrive once): so a
    body seen twice downstream is the system's duplicate, never the publisher's."""
    deadline = time.monotonic() + deadline_seconds
    i = 0
    while i < total and not stop() and time.monotonic() < deadline:
        try:
            connection = pika.BlockingConnection(pika.URLParameters(url))
        except pika.exceptions.AMQPError:
            time.sleep(0.2)
            continue
        try:
            ch = connection.channel()
            ch.confirm_delivery()
            while i < total and not stop():
                body = i
                i += 1  # never sent again, confirmed or not
                ch.basic_publish(
                    exchange, key, str(body).encode(), pika.BasicProperties(delivery_mode=2)
                )
                confirmed.append(body)
        except pika.exceptions.AMQPError:
            time.sleep(0.2)  # the broker went away (or nacked): carry on with the next body
        finally:
            if connection.is_open:
                with suppress(pika.exceptions.AMQPError):
                    connection.close()


def links(broker: BrokerProcess) -> dict[str, dict[str, Any]]:
    """The broker's federation links by local exchange (empty if it does not answer)."""
    data = status(broker)
    if data is None or data["federation"] is None:
        return {}
    return {link["exchange"]: link for link in data["federation"]["links"]}


def wait_running(broker: BrokerProcess, exchange: str, timeout: float = 60.0) -> dict[str, Any]:
    """Wait until the link of `exchange` on `broker` reports running; its status."""
    return wait_for(
        f"federation link {exchange} running",
        lambda: (
            (links(broker).get(exchange) or {}).get("state") == "running"
            and links(broker)[exchange]
        ),
        timeout,
    )


def upstream_bindings(broker: BrokerProcess, queue: str) -> set[tuple[str, str]]:
    """(exchange, routing key) of the federation queue `queue` on the upstream `broker`."""
    data = status(broker)
    assert data is not None
    held = data["federation"]["federation_queues"].get(queue, [])
    return {(b["exchange"], b["routing_key"]) for b in held}


def wait_upstream_bindings(
    upstream: BrokerProcess, queue: str, expected: set[tuple[str, str]], timeout: float = 60.0
) -> None:
    """Wait until the upstream holds exactly `expected` for the federation queue."""
    wait_for(
        f"upstream bindings of {queue} == {sorted(expected)}",
        lambda: upstream_bindings(upstream, queue) == expected,
        timeout,
    )


def channel(broker: BrokerProcess) -> tuple[pika.BlockingConnection, BlockingChannel]:
    """A pika channel on `broker`."""
    connection = pika.BlockingConnection(pika.URLParameters(broker.url))
    return connection, connection.channel()


def bind_queue(broker: BrokerProcess, queue: str, exchange: str, key: str) -> None:
    """Declare the durable `queue` on `broker` and bind it to `exchange` with `key`."""
    connection, ch = channel(broker)
    try:
        ch.queue_declare(queue, durable=True)
        ch.queue_bind(queue, exchange, key)
    finally:
        connection.close()


def publish_confirmed(
    broker: BrokerProcess, exchange: str, messages: list[tuple[str, bytes]]
) -> None:
    """Publish persistent (routing key, body) pairs with publisher confirms."""
    connection, ch = channel(broker)
    try:
        ch.confirm_delivery()
        for key, body in messages:
            ch.basic_publish(exchange, key, body, pika.BasicProperties(delivery_mode=2))
    finally:
        connection.close()


def get_all(
    broker: BrokerProcess, queue: str, at_least: int = 0, timeout: float = 60.0
) -> list[tuple[str, bytes, dict[str, Any]]]:
    """basic.get until empty, and until `at_least` messages were taken: (routing key, body,
    headers) in order. A republished message is counted in `/status` as soon as it is
    queued but visible to consumers only once its batch is durable: hence `at_least`."""
    connection, ch = channel(broker)
    out: list[tuple[str, bytes, dict[str, Any]]] = []

    def drained() -> bool:
        while True:
            method, props, body = ch.basic_get(queue, auto_ack=True)
            if method is None:
                return len(out) >= at_least
            out.append((method.routing_key, body, dict(props.headers or {})))

    try:
        wait_for(f"{at_least} messages from {queue}", drained, timeout)
        return out
    finally:
        connection.close()


def queue_settled(broker: BrokerProcess, queue: str) -> bool:
    """`queue` exists on `broker` with nothing ready and nothing delivered unacknowledged."""
    data = status(broker)
    return data is not None and any(
        q["name"] == queue and q["messages"] == 0 and q["unacked"] == 0 for q in data["queues"]
    )


def queue_depth(broker: BrokerProcess, queue: str) -> int:
    """Ready messages in `queue` per `/status` (-1 if missing)."""
    data = status(broker)
    if data is None:
        return -1
    for q in data["queues"]:
        if q["name"] == queue:
            return int(q["messages"])
    return -1
