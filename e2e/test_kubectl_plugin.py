"""`kubectl twinmq` end to end, through kubectl's plugin lookup (`kubectl-twinmq` on PATH).

The operator is the chart's (namespace-scoped RBAC, in the module's own namespace; see
e2e/chart_release.py). A BrokerCluster comes up with the primary active; `kubectl twinmq
promote orders backup --wait` switches the active to the backup, and `status` shows it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from chart_release import OperatorRelease, create_ready_cluster, operator_release, status
from conftest import Cluster

pytestmark = pytest.mark.e2e


def kubectl_binary() -> str:
    """The local cluster's kubectl, else `kubectl` on PATH."""
    from twinmq.localcluster.binaries import find

    try:
        return str(find("kubectl"))
    except FileNotFoundError:
        found = shutil.which("kubectl")
        if found is None:
            pytest.skip("no kubectl: run `make cluster-binaries`")
        return found


def plugin(cluster: Cluster, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """`kubectl twinmq ARGS` with this venv's console scripts first on PATH."""
    scripts = Path(sys.executable).parent
    if not (scripts / "kubectl-twinmq").exists():
        pytest.skip("kubectl-twinmq is not installed: pip install -e .")
    env = dict(
        os.environ,
        KUBECONFIG=cluster.kubeconfig,
        PATH=f"{scripts}{os.pathsep}{os.environ.get('PATH', '')}",
    )
    return subprocess.run(
        [kubectl_binary(), "twinmq", *args], env=env, capture_output=True, text=True,
        timeout=timeout, check=False,
    )  # fmt: skip


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
    before = status(cluster, release.namespace, "orders")
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

    after = status(cluster, release.namespace, "orders")
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
