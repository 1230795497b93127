"""The BrokerCluster's NetworkPolicy enforced (issue 16): with the chart's operator (which
knows its own pods, so it makes the policy), a client pod reaches AMQPS through the virtual
IP by its DNS name; a stray pod (no labels, in the same namespace) reaches neither the
replication port nor the admin port of either broker, while it still reaches AMQP (so its
network works); the operator still reaches the admin API (a failover still happens); and
with the policy opted out (`spec.networkPolicy.enabled: false`) the same stray pod reaches
both ports, so the test fails where nothing enforces the policy.

The local cluster enforces NetworkPolicy with kube-router's firewall controller
(docs/local-cluster.md); on kind, kindnet does. Everything here runs in pods and through the
API, so it runs unchanged on either.

A policy takes effect when the engine has synced it (seconds after the API server has it):
each probe pod tries every target once a second until what it sees is what the test expects,
for at most a minute, then prints its last round and exits 0 (seen) or 1 (not seen).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from brokerclusters import cluster_path, cluster_status, in_sync, virtual_ip
from chart_release import (
    OperatorRelease,
    create_ready_cluster,
    operator_reconciles,
    operator_release,
)
from support import IMAGE, Cluster, finished_phase, pod_path

from twinmq.broker.names import ADMIN_PORT, AMQP_PORT, AMQPS_PORT, REPLICATION_PORT
from twinmq.operator.builders import ClusterRef
from twinmq.operator.netpolicy import policy_name
from twinmq.testing.waiting import wait_for

pytestmark = pytest.mark.e2e

Obj = dict[str, Any]
NAME = "orders"
POLICY = policy_name(ClusterRef(name=NAME, namespace="", uid=""))

PROBE = """
import json, socket, sys, time
want = json.loads(sys.argv[1])  # {"host:port": "open" | "shut"}
def state(target):
    host, port = target.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=3).close()
        return "open"
    except OSError:
        return "shut"  # refused (the engine's REJECT) or timed out (a DROP)
deadline = time.monotonic() + 60
while True:
    seen = {target: state(target) for target in want}
    if seen == want or time.monotonic() > deadline:
        break
    time.sleep(1)
print(json.dumps(seen, sort_keys=True), flush=True)
sys.exit(0 if seen == want else 1)
"""
"""Connects to each target until the states seen are the ones wanted (or a minute passed)."""

AMQPS_CLIENT = """
import socket, ssl, sys
host = sys.argv[1]
context = ssl.create_default_context(cafile="/ca/ca.crt")
with socket.create_connection((host, int(sys.argv[2])), timeout=10) as raw:
    with context.wrap_socket(raw, server_hostname=host) as tls:
        tls.sendall(b"AMQP\\x00\\x00\\x09\\x01")
        head = tls.recv(7)
        assert head[:1] == b"\\x01", head  # a method frame: connection.start
        print("verified", host, tls.version(), flush=True)
"""
"""Reaches AMQPS by the virtual IP's DNS name, verifying it against the published CA."""


@pytest.fixture(scope="module")
def release(cluster: Cluster) -> Iterator[OperatorRelease]:
    """The chart's operator (it tells the operator its pods: the policy is made) and a
    BrokerCluster (the example: TLS on, NetworkPolicy on by default) Ready and in sync."""
    with operator_release(cluster, "e2e-netpol") as release:
        create_ready_cluster(release, NAME)
        yield release


def run_pod(cluster: Cluster, namespace: str, pod: Obj) -> tuple[str, str]:
    """Create a run-once pod, wait for it to finish; return its phase and its log."""
    name = str(pod["metadata"]["name"])
    cluster.kube.create(pod_path(namespace), pod)
    try:
        done = wait_for(
            f"pod {name} finished",
            lambda: finished_phase(cluster.kube, namespace, name),
            timeout=150,
        )
        log = cluster.kube.text(pod_path(namespace, name) + "/log")
        return done, log
    finally:
        cluster.kube.delete(pod_path(namespace, name), {"gracePeriodSeconds": 0})


def python_pod(name: str, script: str, *args: str, labels: dict[str, str] | None = None) -> Obj:
    """A run-once pod running `script` with the project's image (no labels unless given)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, **({"labels": labels} if labels else {})},
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "containers": [
                {"name": "probe", "image": IMAGE, "command": ["python", "-c", script, *args]}
            ],
        },
    }


def broker_ips(cluster: Cluster, namespace: str) -> dict[str, str]:
    """Each broker pod's IP, by broker name."""
    ips = {}
    for broker in ("primary", "backup"):
        pod = cluster.kube.get(pod_path(namespace, f"{NAME}-{broker}")) or {}
        ips[broker] = str((pod.get("status") or {}).get("podIP") or "")
        assert ips[broker], f"{NAME}-{broker} has no IP"
    return ips


def stray_probe(cluster: Cluster, namespace: str, pod_name: str, guarded: str) -> Obj:
    """Run a stray pod (no labels) that wants AMQP open on both brokers and the replication
    and admin ports in state `guarded` ("open" or "shut"); return what it saw last."""
    want = {}
    for ip in broker_ips(cluster, namespace).values():
        want[f"{ip}:{AMQP_PORT}"] = "open"
        want[f"{ip}:{REPLICATION_PORT}"] = guarded
        want[f"{ip}:{ADMIN_PORT}"] = guarded
    phase, log = run_pod(cluster, namespace, python_pod(pod_name, PROBE, json.dumps(want)))
    seen: Obj = json.loads(log.strip().splitlines()[-1])
    assert phase == "Succeeded", f"wanted {want}, the stray pod saw {seen}"
    return seen


def test_netpol_the_operator_makes_the_brokers_policy(
    cluster: Cluster, release: OperatorRelease
) -> None:
    path = f"/apis/networking.k8s.io/v1/namespaces/{release.namespace}/networkpolicies"
    policy = wait_for(
        "the brokers' NetworkPolicy",
        lambda: cluster.kube.get(f"{path}/{POLICY}"),
        timeout=60,
    )
    ports = {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]}
    assert {AMQP_PORT, AMQPS_PORT, REPLICATION_PORT, ADMIN_PORT} <= ports


def test_netpol_a_client_pod_reaches_amqps_on_the_virtual_ip_by_its_name(
    cluster: Cluster, release: OperatorRelease
) -> None:
    namespace = release.namespace
    host = f"{NAME}.{namespace}.svc"
    pod = python_pod(
        "netpol-client", AMQPS_CLIENT, host, str(AMQPS_PORT),
        labels={"app.kubernetes.io/name": "twinmq-e2e-client"},
    )  # fmt: skip
    pod["spec"]["volumes"] = [{"name": "ca", "configMap": {"name": f"{NAME}-ca"}}]
    pod["spec"]["containers"][0]["volumeMounts"] = [{"name": "ca", "mountPath": "/ca"}]
    phase, log = run_pod(cluster, namespace, pod)
    assert phase == "Succeeded", log
    assert f"verified {host}" in log
    assert virtual_ip(cluster, namespace, NAME)  # the name is the virtual IP Service's


def test_netpol_a_stray_pod_reaches_neither_the_replication_nor_the_admin_port(
    cluster: Cluster, release: OperatorRelease
) -> None:
    seen = stray_probe(cluster, release.namespace, "netpol-stray", guarded="shut")
    assert sorted(set(seen.values())) == ["open", "shut"]


def test_netpol_the_operator_still_reaches_the_admin_api_a_failover_works(
    cluster: Cluster, release: OperatorRelease
) -> None:
    """The operator reads the brokers' roles and promotes the passive through the admin
    port: with the policy in force, deleting the active's pod still fails over and the
    restarted broker pairs again (replication between the brokers is allowed)."""
    namespace = release.namespace
    active = cluster_status(cluster, namespace, NAME)["activeBroker"]
    cluster.kube.delete(pod_path(namespace, f"{NAME}-{active}"), {"gracePeriodSeconds": 0})
    wait_for(
        "the other broker active, the restarted one in sync",
        lambda: (s := cluster_status(cluster, namespace, NAME)).get("activeBroker") != active
        and in_sync(s),
        timeout=240, interval=1,
    )  # fmt: skip
    operator_reconciles(release)


def test_netpol_opted_out_the_stray_pod_reaches_both_ports(
    cluster: Cluster, release: OperatorRelease
) -> None:
    """Without the policy the same probe sees the ports open: what shut them was the policy
    (the test fails on a cluster that does not enforce it)."""
    namespace = release.namespace
    path = f"/apis/networking.k8s.io/v1/namespaces/{namespace}/networkpolicies"
    opt_out = {"spec": {"networkPolicy": {"enabled": False}}}
    cluster.kube.patch(cluster_path(namespace, NAME), opt_out)
    wait_for(
        "the brokers' NetworkPolicy removed",
        lambda: cluster.kube.get(f"{path}/{POLICY}") is None,
        timeout=60,
    )
    seen = stray_probe(cluster, namespace, "netpol-stray-opted-out", guarded="open")
    assert set(seen.values()) == {"open"}
