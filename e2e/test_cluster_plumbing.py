"""What the operator will rely on from inside a pod: in-cluster API access, cluster DNS;
and, on the local cluster, that no pod packet leaves the machine."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest
from support import Cluster, Obj, client_pod, finished_phase, pod_path

from twinmq.localcluster.layout import POD_CIDR
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

OUTSIDE = ("198.51.100.1", 8080)
"""A listener on this machine but off the pod network: in a network namespace of its own,
behind a veth whose host side is not the bridge (what a pod would reach by leaving)."""

REACH_OUTSIDE = """
import socket, sys
expect = sys.argv[1]
try:
    with socket.create_connection((sys.argv[2], int(sys.argv[3])), timeout=5) as sock:
        outcome = "reached" if sock.recv(16) == b"outside\\n" else "blocked"
except OSError as error:
    print("blocked:", error, flush=True)
    outcome = "blocked"
print(outcome, "expected", expect, flush=True)
sys.exit(0 if outcome == expect else 1)
"""

NO_EXTERNAL_DNS = """
import socket
try:
    socket.getaddrinfo("example.com", 80)
except OSError as error:
    print("no external DNS", error, flush=True)
else:
    raise SystemExit("resolved example.com: DNS left the cluster")
"""

ANSWER = """
import socket, sys
server = socket.create_server((sys.argv[1], int(sys.argv[2])))
while True:
    conn, _ = server.accept()
    conn.sendall(b"outside\\n")
    conn.close()
"""


def _sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True)


@pytest.fixture
def outside_listener(cluster: Cluster) -> Iterator[tuple[str, int]]:
    """A TCP listener that answers `outside` at OUTSIDE, off the pod network: a network
    namespace joined to the host by a veth (not on the bridge), routed like any host link."""
    if not cluster.local:
        pytest.skip("the host guard belongs to the local cluster")
    netns, host_side = f"e2e-out-{uuid.uuid4().hex[:6]}", "e2eout0"
    address, port = OUTSIDE
    _sh("ip", "netns", "add", netns)
    server = None
    try:
        _sh("ip", "link", "add", host_side, "type", "veth", "peer", "name", "eth0",
            "netns", netns)  # fmt: skip
        _sh("ip", "addr", "add", "198.51.100.2/30", "dev", host_side)
        _sh("ip", "link", "set", host_side, "up")
        inside = ["ip", "netns", "exec", netns]
        _sh(*inside, "ip", "addr", "add", f"{address}/30", "dev", "eth0")
        _sh(*inside, "ip", "link", "set", "eth0", "up")
        _sh(*inside, "ip", "link", "set", "lo", "up")
        _sh(*inside, "ip", "route", "add", "default", "via", "198.51.100.2")
        server = subprocess.Popen([*inside, sys.executable, "-c", ANSWER, address, str(port)])
        wait_for("the outside listener answers from the host", lambda: _answers(*OUTSIDE), 10)
        yield OUTSIDE
    finally:
        if server is not None:
            server.kill()
            server.wait()
        subprocess.run(["ip", "link", "del", host_side], capture_output=True)
        subprocess.run(["ip", "netns", "del", netns], capture_output=True)


def _answers(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=2) as sock:
            return sock.recv(16) == b"outside\n"
    except OSError:
        return False


@contextlib.contextmanager
def _guard_bypassed(address: str) -> Iterator[None]:
    """Accept pod traffic to and from `address` ahead of the guard (FORWARD position 1 of
    the filter table and of the mangle table, which holds the guard's drops too)."""
    rules = [["-s", POD_CIDR, "-d", address, "-j", "ACCEPT"],
             ["-s", address, "-d", POD_CIDR, "-j", "ACCEPT"]]  # fmt: skip
    tables = ("filter", "mangle")
    for table in tables:
        for rule in rules:
            _sh("iptables", "-w", "-t", table, "-I", "FORWARD", "1", *rule)
    try:
        yield
    finally:
        for table in tables:
            for rule in rules:
                delete = ["iptables", "-w", "-t", table, "-D", "FORWARD", *rule]
                subprocess.run(delete, capture_output=True)


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


def test_the_guard_keeps_pod_packets_from_a_listener_off_the_pod_network(
    cluster: Cluster, namespace: str, outside_listener: tuple[str, int]
) -> None:
    """The listener answers the host, and a pod once the guard is bypassed (so a packet that
    left the pod network would get an answer); with the guard in place the pod cannot
    reach it."""
    address, port = outside_listener
    with _guard_bypassed(address):
        pod = client_pod("unguarded", REACH_OUTSIDE, "reached", address, str(port))
        assert _run_to_completion(cluster, namespace, pod) == "Succeeded"
    pod = client_pod("guarded", REACH_OUTSIDE, "blocked", address, str(port))
    assert _run_to_completion(cluster, namespace, pod) == "Succeeded"


def test_no_dns_query_leaves_the_cluster(cluster: Cluster, namespace: str) -> None:
    if not cluster.local:
        pytest.skip("the cluster DNS without `forward` belongs to the local cluster")
    pod = client_pod("no-external-dns", NO_EXTERNAL_DNS)
    assert _run_to_completion(cluster, namespace, pod) == "Succeeded"
