"""The failover and fencing scenarios, run under the operator as a host process
(e2e/test_operator.py) and as the chart's Deployment under its own namespaced RBAC
(e2e/test_failover_chart.py). Each takes a Ready, replicating BrokerCluster."""

from __future__ import annotations

import asyncio
import base64
import threading
import time

import pika
from brokerclusters import amqp_url, cluster_status, drain
from support import Cluster

from twinmq.broker.admin_client import AdminError, SyncAdminClient
from twinmq.client import ReliablePublisher
from twinmq.localcluster import faults
from twinmq.localcluster.layout import Layout
from twinmq.operator.probe import admin_of
from twinmq.testing.waiting import wait_for


def kill_9_of_the_active_fails_over_losing_nothing(
    cluster: Cluster, namespace: str, name: str
) -> float:
    """`kill -9` of the active broker's container under confirmed traffic through the VIP:
    the backup takes over in epoch 2 (at once: Kubernetes reports the process gone), every
    confirmed message is there exactly once, and the old primary comes back a ready
    passive. Returns the seconds from the kill to the first confirm after it."""
    url = amqp_url(cluster, namespace, name)
    conn = pika.BlockingConnection(pika.URLParameters(url))
    conn.channel().queue_declare("orders", durable=True)
    conn.close()
    total = 600
    timeline: dict[str, float] = {}

    async def traffic() -> int:
        publisher = ReliablePublisher([url], reconnect_delay=0.2, give_up_after=90)
        sent = 0
        for i in range(total):
            await publisher.publish(str(i).encode(), "orders", message_id=f"o-{i}")
            sent += 1
            if i == total // 3:
                faults.kill_pod(Layout.default(), namespace, f"{name}-primary", "broker")
                timeline["killed"] = time.monotonic()
            elif "killed" in timeline and "first_after" not in timeline and publisher.reconnects:
                timeline["first_after"] = time.monotonic()
        await publisher.close()
        return sent

    assert asyncio.run(traffic()) == total
    status = cluster_status(cluster, namespace, name)
    # A new epoch (2, or later if the operator also learned one from the brokers).
    assert status["activeBroker"] == "backup" and status["epoch"] >= 2
    assert status["lastFailover"]["from"] == "primary"
    assert status["lastFailover"]["reason"].startswith("active's process gone"), status
    received = drain(url, "orders")
    assert sorted(received) == list(range(total)), "confirmed messages lost or duplicated"
    seconds = timeline["first_after"] - timeline["killed"]
    print(f"kill -9 to first confirm through the VIP: {seconds:.2f}s")

    def primary_back_in_sync() -> bool:
        s = cluster_status(cluster, namespace, name)
        primary = next(b for b in s.get("brokers", []) if b["name"] == "primary")
        return primary["role"] == "passive" and bool(primary["ready"])

    wait_for("the old primary is back as a ready passive", primary_back_in_sync, timeout=60)
    return seconds


def _admin(
    cluster: Cluster, namespace: str, name: str
) -> tuple[dict[str, SyncAdminClient], dict[str, str]]:
    """Each broker's admin API as the operator reaches it (HTTPS verified against the
    cluster's CA by the pod's name when the pod serves it), and each broker's pod IP."""
    secret = cluster.kube.get(f"/api/v1/namespaces/{namespace}/secrets/{name}-auth") or {}
    token = base64.b64decode(secret["data"]["admin-token"]).decode()
    published = cluster.kube.get(f"/api/v1/namespaces/{namespace}/configmaps/{name}-ca") or {}
    ca = (published.get("data") or {}).get("ca.crt")
    clients, ips = {}, {}
    for broker in ("primary", "backup"):
        pod = cluster.kube.get(f"/api/v1/namespaces/{namespace}/pods/{name}-{broker}") or {}
        ips[broker] = pod["status"]["podIP"]
        client = admin_of(pod, token, ca)
        assert client is not None
        clients[broker] = client
    return clients, ips


class RoleWatch:
    """Polls both brokers' roles from the host, recording each distinct (primary, backup)."""

    def __init__(self, clients: dict[str, SyncAdminClient]) -> None:
        self.clients = clients
        self.seen: list[tuple[str, str]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def role(self, broker: str) -> str:
        try:
            return str(self.clients[broker].status(timeout=1.0).role)
        except AdminError:
            return "unreachable"

    def _run(self) -> None:
        while not self.stop.is_set():
            pair = (self.role("primary"), self.role("backup"))
            if not self.seen or self.seen[-1] != pair:
                self.seen.append(pair)
            self.stop.wait(0.05)

    def first(self, primary: str | None = None, backup: str | None = None) -> int:
        """Index of the first pair matching (-1: never seen)."""
        return next((i for i, (p, b) in enumerate(self.seen)
                     if primary in (None, p) and backup in (None, b)), -1)  # fmt: skip


def cut_off_the_api_server_fences_before_the_backup_is_promoted(
    cluster: Cluster, namespace: str, name: str
) -> None:
    """The Lease fences: the active cannot renew (its API requests hang) while its
    clients still reach it; it stops confirming and steps down by itself before the
    operator promotes the backup, and no confirmed message is lost."""
    layout = Layout.default()
    clients, ips = _admin(cluster, namespace, name)
    direct = amqp_url(cluster, namespace, name, host=ips["primary"])  # not the VIP
    conn = pika.BlockingConnection(pika.URLParameters(direct))
    ch = conn.channel()
    ch.queue_declare("orders", durable=True)
    ch.confirm_delivery()
    watch = RoleWatch(clients)
    watch.thread.start()
    confirmed: list[int] = []
    faults.cut_api_server(layout, namespace, f"{name}-primary")
    try:
        closed_by_broker = False
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until the primary drops its clients
            try:
                ch.basic_publish("", "orders", str(len(confirmed)).encode(),
                                 pika.BasicProperties(delivery_mode=2))  # fmt: skip
            except pika.exceptions.AMQPError:
                closed_by_broker = True
                break
            confirmed.append(len(confirmed))
        assert closed_by_broker, "the cut-off primary kept its clients for a minute"

        def backup_active() -> bool:
            return cluster_status(cluster, namespace, name).get("activeBroker") == "backup"

        wait_for("failover to the backup", backup_active, timeout=60)
        wait_for("the watch sees the backup active", lambda: watch.first(backup="active") >= 0)
    finally:
        faults.heal_api_server(layout, namespace, f"{name}-primary")
        watch.stop.set()
    watch.thread.join()
    # Its clients reached it while it could not reach the API server; then it stopped
    # confirming (closed them) and stepped down by itself, in its own epoch: both
    # brokers passive before the operator promoted the backup. Never two actives.
    assert confirmed, "no publish was confirmed while the primary was cut off the API"
    fenced, promoted = watch.first("passive", "passive"), watch.first(backup="active")
    assert 0 <= fenced < promoted, watch.seen
    assert watch.first("active", "active") == -1, watch.seen
    log = cluster.kube.text(
        f"/api/v1/namespaces/{namespace}/pods/{name}-primary/log", container="broker"
    )
    assert "self-fencing" in log, log[-3000:]
    received = drain(amqp_url(cluster, namespace, name), "orders")
    assert set(confirmed) <= set(received), "confirmed messages lost across the fencing"

    def single_active() -> bool:
        s = cluster_status(cluster, namespace, name)
        roles = {b["name"]: b["role"] for b in s.get("brokers", [])}
        return roles == {"primary": "passive", "backup": "active"}

    wait_for("the fenced primary is back as passive", single_active, timeout=60)
