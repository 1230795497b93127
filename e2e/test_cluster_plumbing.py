"""What the operator will rely on from inside a pod: in-cluster API access, cluster DNS;
and, on the local cluster, that no pod packet leaves the machine."""

from __future__ import annotations

import pytest
from support import Cluster, Obj, client_pod, finished_phase, pod_path

from twinmq.testing.waiting import wait_for

pytestmark = pytest.mark.e2e

IN_CLUSTER_LIST_PODS = """
import json, os, ssl, urllib.request
sa = "/var/run/secrets/kubernetes.io/serviceaccount"
token = open(f"{sa}/token").read()
namespace = open(f"{sa}/namespace").read()
host = os.environ["KUBERNETES_SERVICE_HOST"]
port = os.environ["KUBERNETES_SERVICE_PORT"]
context = ssl.create_default_context(cafile=f"{sa}/ca.crt")
request = urllib.request.Request(
    f"https://{host}:{port}/api/v1/namespaces/{namespace}/pods",
    headers={"Authorization": f"Bearer {token}"},
)
with urllib.request.urlopen(request, context=context, timeout=10) as response:
    names = [p["metadata"]["name"] for p in json.load(response)["items"]]
assert "in-cluster" in names, names
print("listed", names, flush=True)
"""

NO_WAY_OUT = """
import socket
for target in [("203.0.113.7", 80), ("192.0.2.1", 443)]:
    try:
        socket.create_connection(target, timeout=3).close()
    except OSError as error:
        print("blocked", target, error, flush=True)
    else:
        raise SystemExit(f"reached {target}: a pod packet left the machine")
try:
    socket.getaddrinfo("example.com", 80)
except OSError as error:
    print("no external DNS", error, flush=True)
else:
    raise SystemExit("resolved example.com: DNS left the cluster")
"""


def _run_to_completion(cluster: Cluster, namespace: str, pod: Obj) -> str:
    name = str(pod["metadata"]["name"])
    cluster.kube.create(pod_path(namespace), pod)
    return wait_for(
        f"{name} to finish", lambda: finished_phase(cluster.kube, namespace, name), timeout=60
    )


def test_pod_reaches_the_api_server_with_its_service_account(
    cluster: Cluster, namespace: str
) -> None:
    cluster.kube.create(
        f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/rolebindings",
        {
            "metadata": {"name": "default-view"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": "view",
            },
            "subjects": [{"kind": "ServiceAccount", "name": "default", "namespace": namespace}],
        },
    )
    pod = client_pod("in-cluster", IN_CLUSTER_LIST_PODS)
    pod["spec"]["automountServiceAccountToken"] = True
    assert _run_to_completion(cluster, namespace, pod) == "Succeeded"


def test_no_pod_packet_or_dns_query_leaves_the_machine(cluster: Cluster, namespace: str) -> None:
    if not cluster.local:
        pytest.skip("the host guard belongs to the local cluster")
    assert _run_to_completion(cluster, namespace, client_pod("no-way-out", NO_WAY_OUT)) == (
        "Succeeded"
    )
