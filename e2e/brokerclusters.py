"""BrokerClusters in e2e tests: the operator as a local process, creating a cluster from the
example, reading its status, reaching it through the virtual IP."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pika
import pytest
import yaml
from support import Cluster

from twinmq.broker.names import AMQP_PORT, OPERATOR_METRICS_PORT_ENV
from twinmq.localcluster.examples import example_brokercluster
from twinmq.testing import queues
from twinmq.testing.waiting import accepts, wait_for

REPO = Path(__file__).resolve().parent.parent
API = "/apis/twinmq.io/v1alpha1"
CRD_PATH = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"


class OperatorProcess:
    """`twinmq-operator` as a local process against the test cluster; killable, restartable."""

    def __init__(self, kubeconfig: str, env: Mapping[str, str] | None = None) -> None:
        self.kubeconfig = kubeconfig
        self.env = dict(env or {})
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start it (again)."""
        log = open(REPO / ".cluster" / "logs" / "e2e-operator.log", "ab")  # noqa: SIM115
        env = {**os.environ, "KUBECONFIG": self.kubeconfig, OPERATOR_METRICS_PORT_ENV: "0",
               **self.env}  # fmt: skip
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "twinmq.operator.main"], env=env, stdout=log, stderr=log
        )
        log.close()

    def kill(self) -> None:
        """kill -9."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        """SIGTERM, then kill -9 after 15 s."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()


def install_crd(cluster: Cluster) -> None:
    """The CRD applied server-side, once it is established (serving BrokerClusters)."""
    crd = yaml.safe_load((REPO / "crds" / "brokercluster.yaml").read_text())
    path = f"{CRD_PATH}/{crd['metadata']['name']}"
    cluster.kube.apply(path, crd, "e2e")

    def established() -> bool:
        conditions = ((cluster.kube.get(path) or {}).get("status") or {}).get("conditions") or []
        return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)

    wait_for("the BrokerCluster CRD is established", established, timeout=30)


def operator_fixture(
    cluster: Cluster, env: Mapping[str, str] | None = None
) -> Iterator[OperatorProcess]:
    """The CRD installed and `twinmq-operator` running, with `env` added to its environment
    (conftest's module fixture)."""
    if not cluster.local:
        pytest.skip("needs the local cluster's fault tools and pod network from the host")
    install_crd(cluster)
    proc = OperatorProcess(cluster.kubeconfig, env)
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()


def cluster_path(namespace: str, name: str = "") -> str:
    """The API path of the namespace's BrokerClusters, or of one."""
    return f"{API}/namespaces/{namespace}/brokerclusters" + (f"/{name}" if name else "")


def cluster_status(cluster: Cluster, namespace: str, name: str) -> dict[str, Any]:
    """A BrokerCluster's status ({} before the operator wrote one)."""
    obj = cluster.kube.get(cluster_path(namespace, name)) or {}
    return dict(obj.get("status") or {})


def condition(status: dict[str, Any], ctype: str) -> str:
    """A condition's status ("" when absent)."""
    return next((c["status"] for c in status.get("conditions", []) if c["type"] == ctype), "")


def in_sync(status: dict[str, Any]) -> bool:
    """Whether a BrokerCluster's status says Ready with its passive in sync."""
    return status.get("phase") == "Ready" and condition(status, "Replicating") == "True"


def virtual_ip(cluster: Cluster, namespace: str, name: str) -> str:
    """The cluster IP of the BrokerCluster's virtual-IP Service."""
    service = cluster.kube.get(f"/api/v1/namespaces/{namespace}/services/{name}") or {}
    return str(service["spec"]["clusterIP"])


def create_cluster(
    cluster: Cluster,
    namespace: str,
    audit: dict[str, Any] | None = None,
    spec: dict[str, Any] | None = None,
) -> str:
    """The example BrokerCluster (with `audit` as its spec.audit and the top-level `spec`
    fields given replaced), once it is Ready with the passive in sync; returns its name."""
    example = example_brokercluster()
    if audit is not None:
        example["spec"]["audit"] = audit
    example["spec"].update(spec or {})
    cluster.kube.create(cluster_path(namespace), example)
    name = str(example["metadata"]["name"])

    wait_for(
        "the BrokerCluster is Ready and replicating",
        lambda: in_sync(cluster_status(cluster, namespace, name)),
        timeout=90,
    )
    wait_answering(cluster, namespace, name)
    return name


def wait_answering(cluster: Cluster, namespace: str, name: str) -> None:
    """Wait until the BrokerCluster's virtual IP accepts AMQP connections. Ready (or a new
    active in the status) says the brokers are; the virtual IP answers once the endpoint
    controller and kube-proxy have caught up (tests that connected at once were refused,
    in CI)."""
    ip = virtual_ip(cluster, namespace, name)
    wait_for(f"the virtual IP of {name} answers", lambda: accepts(ip, AMQP_PORT), timeout=30)


def amqp_url(cluster: Cluster, namespace: str, name: str, host: str | None = None) -> str:
    """The app user's URL through the virtual IP (the Service's cluster IP), or to `host`."""
    secret = cluster.kube.get(f"/api/v1/namespaces/{namespace}/secrets/{name}-auth") or {}
    data = {k: base64.b64decode(v).decode() for k, v in secret.get("data", {}).items()}
    ip = host or virtual_ip(cluster, namespace, name)
    return f"amqp://{data['username']}:{data['password']}@{ip}:{AMQP_PORT}/%2F"


def drain(url: str, queue: str) -> list[int]:
    """Every message left in `queue` (bodies are numbers), consumed and acknowledged; waits
    first for `url` to accept connections (after a failover the virtual IP follows the new
    active once kube-proxy has caught up)."""
    where = pika.URLParameters(url)
    wait_for(f"{where.host} answers", lambda: accepts(where.host, where.port), timeout=30)
    return [int(body) for body in queues.drain(url, queue)]


def publish_confirmed(url: str, queue: str, body: bytes) -> None:
    """One persistent message, confirmed (raises if the broker does not confirm it)."""
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare(queue, durable=True)
    ch.basic_publish("", queue, body, pika.BasicProperties(delivery_mode=2), mandatory=True)
    conn.close()


def messages_in(url: str, queue: str) -> int:
    try:
        conn = pika.BlockingConnection(pika.URLParameters(url))
    except pika.exceptions.AMQPConnectionError:
        return -2  # the virtual IP not yet following a new active (a failover)
    try:
        return int(conn.channel().queue_declare(queue, passive=True).method.message_count)
    except pika.exceptions.ChannelClosedByBroker:
        return -1  # not mirrored yet
    finally:
        if conn.is_open:
            conn.close()


def publish_some(url: str, queue: str, bodies: range) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare(queue, durable=True)
    for i in bodies:
        ch.basic_publish("", queue, str(i).encode(), pika.BasicProperties(delivery_mode=2))
    conn.close()


def events_of(cluster: Cluster, namespace: str) -> list[dict[str, Any]]:
    """The BrokerClusters' Events in the namespace, oldest first."""
    events = cluster.kube.list(f"/api/v1/namespaces/{namespace}/events")
    return [e for e in sorted(events, key=lambda e: e["metadata"]["creationTimestamp"])
            if e["involvedObject"]["kind"] == "BrokerCluster"]  # fmt: skip


def reasons_when(
    cluster: Cluster,
    namespace: str,
    what: str,
    done: Callable[[list[str]], bool],
    timeout: float = 30,
) -> list[str]:
    """The BrokerClusters' Event reasons in the namespace once `done` holds of them: kopf
    posts Events from a queue of its own, so one may land after the status that the test
    waited for."""

    def reasons() -> list[str] | None:
        found = [e["reason"] for e in events_of(cluster, namespace)]
        return found if done(found) else None

    return wait_for(what, reasons, timeout=timeout)
