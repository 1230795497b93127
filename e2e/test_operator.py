"""The operator end to end: a BrokerCluster comes up, fails over, recovers, goes away.

The operator runs as a local process against the cluster's API (started per
module); the brokers run as pods. Confirmed traffic goes through the virtual-IP
Service's cluster IP. The fault tools of the local cluster kill and cut pods,
so these tests run on the local cluster only.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pika
import pytest
from brokerclusters import (
    OperatorProcess,
    amqp_url,
    cluster_path,
    cluster_status,
    condition,
    create_cluster,
    drain,
    events_of,
    publish_confirmed,
    reasons_when,
)
from failover_scenarios import (
    cut_off_the_api_server_fences_before_the_backup_is_promoted,
    kill_9_of_the_active_fails_over_losing_nothing,
)
from support import Cluster

from twinmq.broker.journal.segment import scan, segment_number
from twinmq.localcluster import faults
from twinmq.localcluster.layout import Layout
from twinmq.testing.waiting import wait_for

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parent.parent
API = "/apis/twinmq.io/v1alpha1"
CRD_PATH = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"


def test_brokercluster_comes_up_with_the_virtual_ip_at_the_primary(
    cluster: Cluster, operator: OperatorProcess, namespace: str
) -> None:
    name = create_cluster(cluster, namespace)
    status = cluster_status(cluster, namespace, name)
    assert (status["activeBroker"], status["epoch"]) == ("primary", 1)
    slices = cluster.kube.list(
        f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices",
        labelSelector=f"kubernetes.io/service-name={name}",
    )
    primary = cluster.kube.get(f"/api/v1/namespaces/{namespace}/pods/{name}-primary") or {}
    addresses = [a for s in slices for e in s.get("endpoints") or [] for a in e["addresses"]]
    assert addresses == [primary["status"]["podIP"]]


def test_kill_9_of_the_active_fails_over_through_the_virtual_ip_losing_nothing(
    cluster: Cluster, operator: OperatorProcess, namespace: str
) -> None:
    kill_9_of_the_active_fails_over_losing_nothing(
        cluster, namespace, create_cluster(cluster, namespace)
    )


def test_recover_request_demotes_the_backup_before_activating_the_primary(
    cluster: Cluster, operator: OperatorProcess, namespace: str
) -> None:
    name = create_cluster(cluster, namespace)
    cluster.kube.patch(
        cluster_path(namespace, name),
        {"spec": {"requests": {"promote": {"id": "sw-1", "broker": "backup"}}}},
    )

    def promoted() -> bool:
        s = cluster_status(cluster, namespace, name)
        return (
            s.get("activeBroker") == "backup"
            and s.get("handledRequests", {}).get("promote") == "sw-1"
            and condition(s, "Replicating") == "True"
        )

    wait_for("the switchover to the backup", promoted, timeout=60)
    cluster.kube.patch(
        cluster_path(namespace, name), {"spec": {"requests": {"recover": {"id": "r-1"}}}}
    )

    def recovered() -> bool:
        s = cluster_status(cluster, namespace, name)
        return (
            s.get("activeBroker") == "primary"
            and s.get("handledRequests", {}).get("recover") == "r-1"
        )

    wait_for("recovery to the primary", recovered, timeout=60)
    events = cluster.kube.list(f"/api/v1/namespaces/{namespace}/events")
    reasons = [e["reason"] for e in sorted(events, key=lambda e: e["metadata"]["creationTimestamp"])
               if e["involvedObject"]["kind"] == "BrokerCluster"]  # fmt: skip
    assert "SwitchoverStarted" in reasons and "SwitchedOver" in reasons
    # A reverted or re-applied manifest with the same id is not replayed.
    cluster.kube.patch(
        cluster_path(namespace, name),
        {"spec": {"requests": {"promote": {"id": "sw-1", "broker": "backup"}}}},
    )
    time.sleep(3)  # the condition under test is that nothing happens
    assert cluster_status(cluster, namespace, name)["activeBroker"] == "primary"


def test_a_primary_cut_off_the_api_server_fences_itself_before_the_backup_is_promoted(
    cluster: Cluster, operator: OperatorProcess, namespace: str
) -> None:
    cut_off_the_api_server_fences_before_the_backup_is_promoted(
        cluster, namespace, create_cluster(cluster, namespace)
    )


def test_an_api_server_down_longer_than_the_lease_leaves_one_active_and_loses_nothing(
    cluster: Cluster, operator: OperatorProcess, namespace: str
) -> None:
    """The whole control plane's API away for longer than the Lease: the active cannot
    renew and fences itself (nobody can promote anything meanwhile); once the API is back
    the operator makes exactly one broker active again, and every confirmed message is
    there."""
    name = create_cluster(cluster, namespace)
    url = amqp_url(cluster, namespace, name)
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    ch.queue_declare("orders", durable=True)
    ch.confirm_delivery()
    ch.basic_publish("", "orders", b"-1", pika.BasicProperties(delivery_mode=2))
    # One confirmed before the outage: taking the API server away can outlast the Lease, so
    # the primary may fence itself before the next publish.
    confirmed: list[int] = [-1]
    with faults.api_server_down(Layout.default()):
        try:
            for i in range(100_000):  # until the primary fences itself and drops us
                ch.basic_publish("", "orders", str(i).encode(),
                                 pika.BasicProperties(delivery_mode=2))  # fmt: skip
                confirmed.append(i)
        except pika.exceptions.AMQPError:
            pass
    assert len(confirmed) < 100_000, "the primary never fenced itself"

    def one_active() -> bool:
        s = cluster_status(cluster, namespace, name)
        roles = sorted(b["role"] for b in s.get("brokers", []))
        return roles == ["active", "passive"] and s.get("epoch", 0) >= 2

    wait_for("exactly one active broker again, in a new epoch", one_active, timeout=120)
    received = drain(url, "orders")
    assert set(confirmed) <= set(received), "confirmed messages lost across the API outage"


def test_a_primary_cut_off_the_network_is_replaced_and_comes_back_passive(
    cluster: Cluster, operator: OperatorProcess, namespace: str
) -> None:
    name = create_cluster(cluster, namespace)
    layout = Layout.default()
    faults.cut_network(layout, namespace, f"{name}-primary")
    try:

        def backup_active() -> bool:
            return cluster_status(cluster, namespace, name).get("activeBroker") == "backup"

        wait_for("failover to the backup", backup_active, timeout=60)
    finally:
        faults.heal_network(layout, namespace, f"{name}-primary")

    def single_active() -> bool:
        s = cluster_status(cluster, namespace, name)
        roles = {b["name"]: b["role"] for b in s.get("brokers", [])}
        return roles == {"primary": "passive", "backup": "active"}

    wait_for("the isolated primary is back as passive", single_active, timeout=60)


def test_deleting_the_brokercluster_removes_everything(
    cluster: Cluster, operator: OperatorProcess, namespace: str
) -> None:
    name = create_cluster(cluster, namespace)
    cluster.kube.delete(cluster_path(namespace, name))

    def left() -> list[str]:
        """What is still there: kind/name, whether it is being deleted, its finalizers."""
        found = []
        for kind in ("pods", "services"):
            for item in cluster.kube.list(
                f"/api/v1/namespaces/{namespace}/{kind}", labelSelector=f"twinmq.io/cluster={name}"
            ):
                meta = item["metadata"]
                owners = [o.get("kind") for o in meta.get("ownerReferences", [])]
                found.append(f"{kind}/{meta['name']} deleting={meta.get('deletionTimestamp')} "
                             f"finalizers={meta.get('finalizers')} owners={owners}")  # fmt: skip
        return found

    try:
        wait_for("pods and services garbage-collected", lambda: not left(), timeout=60)
    except TimeoutError as exc:
        raise AssertionError(f"{exc}; still there: {left()}") from exc


def test_fencing_the_active_moves_the_virtual_ip_and_unfencing_brings_it_back_passive(
    cluster: Cluster, operator: OperatorProcess, namespace: str
) -> None:
    name = create_cluster(cluster, namespace)
    path = cluster_path(namespace, name)
    cluster.kube.patch(path, {"spec": {"requests": {"fence": {"id": "f-1", "broker": "primary"}}}})

    def fenced_and_moved() -> bool:
        s = cluster_status(cluster, namespace, name)
        return s.get("activeBroker") == "backup" and s.get("fencedBrokers") == ["primary"]

    wait_for("the backup active with the primary fenced", fenced_and_moved, timeout=60)
    primary = next(b for b in cluster_status(cluster, namespace, name)["brokers"]
                   if b["name"] == "primary")  # fmt: skip
    assert primary["fenced"] and primary["role"] == "passive" and not primary["linkConnected"]
    cluster.kube.patch(path, {"spec": {"requests": {"fence": {
        "id": "f-2", "broker": "primary", "fenced": False}}}})  # fmt: skip

    def back_in_sync() -> bool:
        s = cluster_status(cluster, namespace, name)
        p = next(b for b in s.get("brokers", []) if b["name"] == "primary")
        return not s.get("fencedBrokers") and p["role"] == "passive" and p["ready"]

    wait_for("the unfenced primary back as a ready passive", back_in_sync, timeout=60)


def test_an_operator_killed_mid_failover_finishes_it_after_a_restart(
    cluster: Cluster, operator: OperatorProcess, namespace: str
) -> None:
    name = create_cluster(cluster, namespace)
    # A hung primary (frozen): Kubernetes still reports it running, so the failover waits
    # for its Lease (a killed one would be replaced at once, with nothing to interrupt).
    # Its link is cut too: the kubelet's liveness probe restarts a frozen container after
    # some 30 s, and a restarted primary the operator could reach, which holds everything,
    # would rightly be re-activated before the restarted operator, which trusts the
    # Lease's guard only two durations after its first read, has promoted the backup.
    layout = Layout.default()
    faults.pause_pod(layout, namespace, f"{name}-primary")
    faults.cut_network(layout, namespace, f"{name}-primary")
    try:

        def failing_over() -> bool:
            return cluster_status(cluster, namespace, name).get("phase") == "FailingOver"

        wait_for("the operator to start the failover", failing_over, timeout=30)
        operator.kill()  # kill -9, mid-failover: the Lease has not lapsed yet
        time.sleep(2)  # the operator is down while the Lease lapses: the condition under test
        operator.start()

        seen: list[dict[str, Any]] = []

        def finished() -> bool:
            s = cluster_status(cluster, namespace, name)
            seen[:] = [s]
            return s.get("activeBroker") == "backup" and s.get("phase") in ("Ready", "Degraded")

        # A bound on the wait, not a claim on its speed. It timed out now and then (60 s,
        # then 120 s): a primary frozen before its first Lease renewal left no replication
        # guard, which the restarted operator needs here; the handover now writes it
        # (docs/replication.md, "The replication guard in the Lease"). On a timeout, say
        # where the cluster stood.
        try:
            wait_for("the restarted operator to finish the failover", finished, timeout=120)
        except TimeoutError as exc:
            last = seen[0] if seen else {}
            where = {k: last.get(k) for k in ("phase", "activeBroker", "epoch", "brokers")}
            conditions = [(c.get("type"), c.get("status"), c.get("reason"), c.get("message"))
                          for c in last.get("conditions") or []]  # fmt: skip
            raise TimeoutError(f"{exc}; status {where}; conditions {conditions}") from None
    finally:
        faults.heal_network(layout, namespace, f"{name}-primary")
        faults.resume_pod(layout, namespace, f"{name}-primary")
    status = cluster_status(cluster, namespace, name)
    assert status["epoch"] == 2 and status["lastFailover"]["to"] == "backup"
    assert status["lastFailover"]["reason"].startswith("active unreachable and its Lease")


def corrupt_a_journal_record(cluster: Cluster, namespace: str, claim: str) -> str:
    """Flip a bit in the last byte of a record (one with intact records after it) of the
    newest journal segment on the claim's volume, as a bad disk block would; the segment's
    name."""
    pvc = cluster.kube.get(f"/api/v1/namespaces/{namespace}/persistentvolumeclaims/{claim}")
    volume = cluster.kube.get(f"/api/v1/persistentvolumes/{(pvc or {})['spec']['volumeName']}")
    journal = Path((volume or {})["spec"]["hostPath"]["path"]) / "data" / "journal"
    segment = sorted(journal.glob("*.seg"))[-1]
    data = bytearray(segment.read_bytes())
    number = segment_number(segment.name)
    assert number is not None
    records = scan(bytes(data), number).records
    assert len(records) >= 3, "want a record with intact records after it"
    data[records[len(records) // 2].end - 1] ^= 0x04
    segment.write_bytes(bytes(data))
    return segment.name


def test_a_broker_restarted_on_a_damaged_journal_is_reported_then_healed_by_a_catch_up(
    cluster: Cluster, operator: OperatorProcess, namespace: str
) -> None:
    name = create_cluster(cluster, namespace)
    url = amqp_url(cluster, namespace, name)
    for n in range(20):
        publish_confirmed(url, "damage", str(n).encode())
    path = cluster_path(namespace, name)
    # Fenced, the backup is not told to replicate: no catch-up heals it while we look.
    cluster.kube.patch(path, {"spec": {"requests": {"fence": {"id": "f-1", "broker": "backup"}}}})
    wait_for("the backup fenced",
               lambda: cluster_status(cluster, namespace, name).get("fencedBrokers") == ["backup"],
               timeout=60)  # fmt: skip
    layout, pod = Layout.default(), f"{name}-backup"
    faults.pause_pod(layout, namespace, pod)  # its journal holds still while we damage it
    segment = corrupt_a_journal_record(cluster, namespace, pod)
    faults.kill_pod(layout, namespace, pod, "broker")
    faults.resume_pod(layout, namespace, pod)  # the audit sidecar

    def reported() -> dict[str, Any] | None:
        status = cluster_status(cluster, namespace, name)
        backup: dict[str, Any] = next(
            (b for b in status.get("brokers", []) if b["name"] == "backup"), {}
        )
        return status if backup.get("damaged") else None

    status = wait_for("the backup reported damaged", reported, timeout=90)
    backup = next(b for b in status["brokers"] if b["name"] == "backup")
    assert "quarantine" in backup["damage"] and segment in backup["damage"], backup
    damaged = next(c for c in status["conditions"] if c["type"] == "BrokerDamaged")
    assert (damaged["status"], damaged["reason"]) == ("True", "JournalDamaged")
    assert damaged["message"].startswith("backup: journal damaged since")
    reasons_when(cluster, namespace, "a BrokerDamaged Event", lambda r: "BrokerDamaged" in r)
    warnings = [e for e in events_of(cluster, namespace) if e["reason"] == "BrokerDamaged"]
    assert [e["type"] for e in warnings] == ["Warning"] and segment in warnings[0]["message"]
    assert status["activeBroker"] == "primary"

    cluster.kube.patch(path, {"spec": {"requests": {"fence": {
        "id": "f-2", "broker": "backup", "fenced": False}}}})  # fmt: skip

    def healed() -> bool:
        s = cluster_status(cluster, namespace, name)
        b = next(b for b in s.get("brokers", []) if b["name"] == "backup")
        return not b.get("damaged") and b["ready"] and condition(s, "BrokerDamaged") == "False"

    wait_for("the backup healed by a catch-up from the primary", healed, timeout=90)
    reasons_when(cluster, namespace, "a BrokerHealed Event", lambda r: "BrokerHealed" in r)
    assert sorted(drain(url, "damage")) == list(range(20))
