"""`kubectl twinmq` end to end, through kubectl's plugin lookup (`kubectl-twinmq` on PATH).

The operator is the chart's (namespace-scoped RBAC, in the module's own namespace; see
e2e/chart_release.py). A BrokerCluster comes up with the primary active; `kubectl twinmq
promote orders backup --wait` switches the active to the backup, and `status` shows it.
A paused passive's lag shows in `kubectl get tmq` and in `kubectl twinmq status`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pika
import pytest
from brokerclusters import amqp_url, cluster_status
from chart_release import OperatorRelease, create_ready_cluster, operator_release
from support import Cluster, kubectl, plugin

from twinmq.localcluster import faults
from twinmq.localcluster.layout import Layout
from twinmq.testing.waiting import wait_for

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def release(cluster: Cluster) -> Iterator[OperatorRelease]:
    """The chart's operator in a fresh namespace, with a Ready BrokerCluster `orders`."""
    with operator_release(cluster, "e2e-plugin") as release:
        create_ready_cluster(release)
        yield release


def broker_rows(output: str) -> dict[str, list[str]]:
    """The `status` table's rows by broker name."""
    lines = output.splitlines()
    assert lines[0].split()[:4] == ["CLUSTER", "BROKER", "ROLE", "EPOCH"], output
    return {line.split()[1]: line.split() for line in lines[1:]}


def test_status_shows_the_primary_active(cluster: Cluster, release: OperatorRelease) -> None:
    result = plugin(cluster, "status", "-n", release.namespace)
    assert result.returncode == 0, result.stderr
    rows = broker_rows(result.stdout)
    assert rows["primary"][:3] == ["orders", "primary", "active"]
    assert rows["backup"][:3] == ["orders", "backup", "passive"]
    assert rows["backup"][4] == "yes"  # in sync: promotable


def test_promote_switches_the_active_to_the_backup(
    cluster: Cluster, release: OperatorRelease
) -> None:
    before = cluster_status(cluster, release.namespace, "orders")
    started = time.monotonic()
    result = plugin(
        cluster, "promote", "orders", "backup", "-n", release.namespace, "--wait",
        "--timeout", "120",
    )  # fmt: skip
    seconds = time.monotonic() - started
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    # A switchover demotes in epoch E+1 and activates the target in E+2 (docs/operator.md).
    epoch = before["epoch"] + 2
    assert f"done: backup is active in epoch {epoch}" in result.stdout, result.stdout
    print(f"\n[timing] kubectl twinmq promote --wait: {seconds:.1f}s")

    after = cluster_status(cluster, release.namespace, "orders")
    assert (after["activeBroker"], after["epoch"]) == ("backup", epoch)
    request_id = result.stdout.split("promote request ")[1].split()[0]
    assert after["handledRequests"]["promote"] == request_id
    assert after["lastFailover"]["to"] == "backup"

    shown = plugin(cluster, "status", "orders", "-n", release.namespace)
    assert shown.returncode == 0, shown.stderr
    rows = broker_rows(shown.stdout)
    assert rows["backup"][2:4] == ["active", str(epoch)]
    assert "primary->backup" in shown.stdout


def test_errors_name_the_problem(cluster: Cluster, release: OperatorRelease) -> None:
    missing = plugin(cluster, "recover", "nope", "-n", release.namespace)
    assert missing.returncode == 1
    assert 'brokerclusters.twinmq.io "nope" not found' in missing.stderr
    assert "clusters there: orders" in missing.stderr
    wrong = plugin(cluster, "promote", "orders", "tertiary", "-n", release.namespace)
    assert wrong.returncode == 2
    assert "invalid choice: 'tertiary'" in wrong.stderr


def test_a_user_without_patch_permission_is_told_which_verb_is_missing(
    cluster: Cluster, release: OperatorRelease, tmp_path: Path
) -> None:
    import yaml

    ns = release.namespace
    rbac = "/apis/rbac.authorization.k8s.io/v1/namespaces"
    cluster.kube.create(
        f"/api/v1/namespaces/{ns}/serviceaccounts", {"metadata": {"name": "viewer"}}
    )
    cluster.kube.create(f"{rbac}/{ns}/roles", {
        "metadata": {"name": "viewer"},
        "rules": [{"apiGroups": ["twinmq.io"], "resources": ["brokerclusters"],
                   "verbs": ["get", "list"]}],
    })  # fmt: skip
    cluster.kube.create(f"{rbac}/{ns}/rolebindings", {
        "metadata": {"name": "viewer"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "viewer"},
        "subjects": [{"kind": "ServiceAccount", "name": "viewer", "namespace": ns}],
    })  # fmt: skip
    token = cluster.kube.create(
        f"/api/v1/namespaces/{ns}/serviceaccounts/viewer/token",
        {"spec": {"expirationSeconds": 600}},
    )["status"]["token"]
    config = yaml.safe_load(Path(cluster.kubeconfig).read_text())
    context = next(c for c in config["contexts"] if c["name"] == config["current-context"])
    context["context"]["user"] = "viewer"
    context["context"]["namespace"] = ns
    config["users"] = [{"name": "viewer", "user": {"token": token}}]
    kubeconfig = tmp_path / "viewer.kubeconfig"
    kubeconfig.write_text(yaml.safe_dump(config))

    shown = plugin(cluster, "status", "--kubeconfig", str(kubeconfig))  # the context's namespace
    assert shown.returncode == 0, shown.stderr
    assert "orders" in shown.stdout
    refused = plugin(cluster, "recover", "orders", "--kubeconfig", str(kubeconfig))
    assert refused.returncode == 1
    assert (
        f'permission denied: you cannot patch brokerclusters.twinmq.io in namespace "{ns}"'
        in refused.stderr
    ), refused.stderr
    assert "grant verb 'patch'" in refused.stderr


def column(output: str, header: str) -> str:
    """One cell of a one-row kubectl table, read at its header's offset ('' when empty)."""
    head, row = output.splitlines()[:2]
    start = head.index(header)
    return row[start:].split(" ", 1)[0].strip() if len(row) > start else ""


def test_a_paused_passive_shows_its_lag_in_get_and_in_the_plugin(
    cluster: Cluster, release: OperatorRelease
) -> None:
    if not cluster.local:
        pytest.skip("pausing a pod acts on the local process-backed cluster")
    ns, name, held = release.namespace, "lagging", 25
    # The active holds its confirms for a silent passive this long before going on alone
    # (and forgetting the link and its lag): the test needs the link kept.
    create_ready_cluster(release, name, replication={"timeoutSeconds": 120})
    layout = Layout.default()

    def lag_in_get() -> int:
        shown = kubectl(cluster, "get", "tmq", name, "-n", ns)
        assert shown.returncode == 0, shown.stderr
        cell = column(shown.stdout, "LAG")
        return int(cell) if cell.isdigit() else -1

    wait_for("no lag in kubectl get tmq", lambda: lag_in_get() == 0, 30)
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url(cluster, ns, name)))
    channel = connection.channel()
    channel.queue_declare("lag.q", durable=True)  # declared while the passive still answers
    assert faults.pause_pod(layout, ns, f"{name}-backup")
    try:
        for i in range(held):  # no confirms: the active holds them for the paused passive
            channel.basic_publish(
                "", "lag.q", str(i).encode(), pika.BasicProperties(delivery_mode=2)
            )
        lag = wait_for(
            "kubectl get tmq shows the lag", lambda: (n := lag_in_get()) >= held and n, 60
        )
        shown = plugin(cluster, "status", name, "-n", ns)
        assert shown.returncode == 0, shown.stderr
        backup = broker_rows(shown.stdout)["backup"]
        assert int(backup[6]) >= held, shown.stdout  # LAG: "<messages> (<seconds>s)"
        print(f"\n[lag] kubectl get tmq: {lag}; plugin: {' '.join(backup[6:8])}")
        connection.close()
    finally:
        faults.resume_pod(layout, ns, f"{name}-backup")
    wait_for("the lag to clear", lambda: lag_in_get() == 0, 60)
