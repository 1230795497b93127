"""The operator repairs drift: a deleted or edited child is restored to its desired state.

The operator (a local process) server-side applies every owned object each probe
interval; these tests delete or edit them behind its back on the real API server and
wait for the repair, then check the pair still serves through the virtual IP.
"""

from __future__ import annotations

import pytest
from brokerclusters import (
    OperatorProcess,
    amqp_url,
    cluster_path,
    cluster_status,
    condition,
    create_cluster,
    events_of,
    publish_confirmed,
    reasons_when,
)
from pika.exceptions import AMQPError
from support import IMAGE, Cluster, pod_path

from twinmq.localcluster.kubeapi import ApiError
from twinmq.testing.waiting import wait_for

pytestmark = pytest.mark.e2e
STORAGE_CLASS = "/apis/storage.k8s.io/v1/storageclasses/twinmq-local"


def confirms(cluster: Cluster, namespace: str, name: str) -> bool:
    """Whether a message published through the virtual IP is confirmed now."""
    try:
        publish_confirmed(amqp_url(cluster, namespace, name), "drift", b"1")
    except (AMQPError, OSError, KeyError):  # KeyError: the Service has no cluster IP yet
        return False
    return True


def test_a_deleted_or_edited_virtual_ip_service_is_restored_and_serves_again(
    cluster: Cluster, operator: OperatorProcess, namespace: str
) -> None:
    name = create_cluster(cluster, namespace)
    services = f"/api/v1/namespaces/{namespace}/services"
    vip, headless = f"{services}/{name}", f"{services}/{name}-brokers"
    cluster.kube.patch(vip, {"spec": {"selector": {"twinmq.io/role": "passive"}}})

    def selector_back() -> bool:
        spec = (cluster.kube.get(vip) or {}).get("spec") or {}
        return spec.get("selector", {}).get("twinmq.io/role") == "active"

    wait_for("the edited VIP selector set back to the active", selector_back, timeout=15)
    for path in (vip, headless):
        uid = (cluster.kube.get(path) or {})["metadata"]["uid"]
        cluster.kube.delete(path)
        wait_for(
            f"{path} recreated",
            lambda p=path, u=uid: (
                (cluster.kube.get(p) or {}).get("metadata", {}).get("uid") not in (None, u)
            ),
            timeout=15,
        )
    # The recreated VIP has a new cluster IP; it reaches the active again.
    wait_for("a confirm through the recreated VIP", lambda: confirms(cluster, namespace, name))
    assert cluster_status(cluster, namespace, name)["epoch"] == 1, "no failover was needed"


def test_a_deleted_secret_an_edited_pod_label_and_a_deleted_lease_are_restored(
    cluster: Cluster, operator: OperatorProcess, namespace: str
) -> None:
    name = create_cluster(cluster, namespace)
    secret = f"/api/v1/namespaces/{namespace}/secrets/{name}-auth"
    before = (cluster.kube.get(secret) or {})["data"]
    cluster.kube.delete(secret)
    wait_for("the Secret restored", lambda: cluster.kube.get(secret), timeout=15)
    assert (cluster.kube.get(secret) or {})["data"] == before, "restored with the same credentials"

    primary = pod_path(namespace, f"{name}-primary")
    backup = pod_path(namespace, f"{name}-backup")
    cluster.kube.patch(primary, {"metadata": {"labels": {"twinmq.io/role": "passive"}}})
    cluster.kube.patch(backup, {"metadata": {"labels": {"twinmq.io/cluster": None}}})

    def labels_back() -> bool:
        p = (cluster.kube.get(primary) or {})["metadata"]["labels"]
        b = (cluster.kube.get(backup) or {})["metadata"]["labels"]
        return p.get("twinmq.io/role") == "active" and b.get("twinmq.io/cluster") == name

    wait_for("the edited pod labels set back", labels_back, timeout=15)

    lease = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/{name}-active"
    cluster.kube.delete(lease)

    # Restored within a probe interval, normally before the active's renewal deadline; on a
    # loaded machine the active may fence itself first (a Lease it cannot renew), and the
    # operator then makes one broker active again. Either way: one active, holding the Lease.
    def lease_back() -> bool:
        spec = (cluster.kube.get(lease) or {}).get("spec") or {}
        status = cluster_status(cluster, namespace, name)
        active = status.get("activeBroker")
        return (
            active is not None
            and spec.get("holderIdentity") == f"{name}-{active}"
            and condition(status, "Ready") == "True"
        )

    wait_for("the Lease restored, held by the active", lease_back, timeout=60)
    wait_for("a confirm through the virtual IP", lambda: confirms(cluster, namespace, name))


def test_a_pod_that_copies_the_virtual_ips_labels_loses_them_and_is_reported(
    cluster: Cluster, operator: OperatorProcess, namespace: str
) -> None:
    name = create_cluster(cluster, namespace)
    wait_for(
        "the pair serving",
        lambda: condition(cluster_status(cluster, namespace, name), "Ready") == "True",
        timeout=120,
    )
    impostor = "impostor"
    cluster.kube.create(pod_path(namespace), {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": impostor,
                     "labels": {"twinmq.io/cluster": name, "twinmq.io/role": "active"}},
        "spec": {
            "automountServiceAccountToken": False,
            "securityContext": {"runAsNonRoot": True, "runAsUser": 65534,
                                "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{
                "name": "impostor", "image": IMAGE, "command": ["sleep", "3600"],
                "securityContext": {"allowPrivilegeEscalation": False,
                                    "capabilities": {"drop": ["ALL"]}},
            }],
        },
    })  # fmt: skip

    def unlabelled() -> bool:
        labels = ((cluster.kube.get(pod_path(namespace, impostor)) or {}).get("metadata")
                  or {}).get("labels") or {}  # fmt: skip
        return "twinmq.io/role" not in labels

    wait_for("the impostor's role label removed", unlabelled, timeout=30)

    def reported() -> bool:
        return any(
            e["reason"] == "DriftRepaired" and f"Pod/{impostor}" in e["message"]
            for e in events_of(cluster, namespace)
        )

    wait_for("a DriftRepaired Event naming the impostor", reported, timeout=15)
    labels = (cluster.kube.get(pod_path(namespace, f"{name}-primary")) or {})["metadata"]["labels"]
    assert labels.get("twinmq.io/role") == "active", "the real active keeps its label"
    wait_for("a confirm through the virtual IP", lambda: confirms(cluster, namespace, name))
    assert cluster_status(cluster, namespace, name)["epoch"] == 1, "no failover was needed"


def test_storage_grows_where_the_class_can_expand_and_never_shrinks(
    cluster: Cluster, operator: OperatorProcess, namespace: str
) -> None:
    name = create_cluster(cluster, namespace)
    path = cluster_path(namespace, name)
    with pytest.raises(ApiError) as refused:
        cluster.kube.patch(path, {"spec": {"storage": {"size": "512Mi"}}})
    assert "storage.size cannot shrink" in refused.value.body

    # The local StorageClass does not allow expansion: the API server refuses the resize
    # and the operator says so, without advancing observedGeneration.
    cluster.kube.patch(path, {"spec": {"storage": {"size": "2Gi"}}})
    generation = (cluster.kube.get(path) or {})["metadata"]["generation"]

    def stalled() -> dict[str, object] | None:
        s = cluster_status(cluster, namespace, name)
        found = [c for c in s.get("conditions", []) if c["type"] == "Stalled"]
        return s if found and found[0]["reason"] == "StorageResizeRefused" else None

    status = wait_for("the resize refusal reported", stalled, timeout=20)
    assert status["observedGeneration"] < generation
    reasons_when(cluster, namespace, "a StorageResizeRefused Event",
                 lambda r: "StorageResizeRefused" in r)  # fmt: skip

    # Where the class allows it, the same spec expands both volumes.
    cluster.kube.patch(STORAGE_CLASS, {"allowVolumeExpansion": True})
    try:

        def expanded() -> bool:
            s = cluster_status(cluster, namespace, name)
            pvcs = [
                cluster.kube.get(f"/api/v1/namespaces/{namespace}/persistentvolumeclaims/"
                                 f"{name}-{broker}") or {}
                for broker in ("primary", "backup")
            ]  # fmt: skip
            sizes = {p["spec"]["resources"]["requests"]["storage"] for p in pvcs}
            return (
                sizes == {"2Gi"}
                and condition(s, "Stalled") == "False"
                and s.get("observedGeneration") == generation
            )

        wait_for("both PVCs expanded and the generation observed", expanded, timeout=20)
    finally:
        cluster.kube.patch(STORAGE_CLASS, {"allowVolumeExpansion": None})
