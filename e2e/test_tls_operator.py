"""AMQPS through the virtual IP, certificates from the operator (issue 16): a client verifies
the broker against the CA the operator publishes (`<cluster>-ca`) by the virtual IP's DNS
name; the server certificate, given a short lifetime here, is renewed and reaches the
broker through the kubelet's update of the Secret volume while a connection opened
before stays up. Between the brokers: a new cluster pairs over mutual TLS (the operator
reaching the admin API over HTTPS) and fails over; a plaintext cluster moved to mutual TLS
under confirmed traffic, one rolling update a step, loses nothing.

The client runs on the host (the local cluster routes Service IPs there) and connects to
the Service's cluster IP, naming `<cluster>.<namespace>.svc` in the TLS handshake as a
client in the cluster would by DNS.
"""

from __future__ import annotations

import asyncio
import base64
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

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
    in_sync,
    operator_fixture,
    publish_confirmed,
    reasons_when,
    virtual_ip,
)
from support import Cluster, pod_path

from twinmq.broker.names import AMQPS_PORT
from twinmq.client import ReliablePublisher
from twinmq.operator.certs import CERT_SECONDS_ENV
from twinmq.testing.waiting import accepts, wait_for

CERT_SECONDS = 120  # renewed at 80 s: well before expiry even if the kubelet takes a minute

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def tls_operator(cluster: Cluster) -> Iterator[OperatorProcess]:
    """The operator, issuing server certificates of two minutes."""
    yield from operator_fixture(cluster, {CERT_SECONDS_ENV: str(CERT_SECONDS)})


def published_ca(cluster: Cluster, namespace: str, name: str, folder: Path) -> Path:
    """The `<cluster>-ca` ConfigMap's certificate, written where an app would mount it."""
    found = cluster.kube.get(f"/api/v1/namespaces/{namespace}/configmaps/{name}-ca") or {}
    path = folder / "ca.crt"
    path.write_text(found["data"]["ca.crt"])
    return path


def tls_params(cluster: Cluster, namespace: str, name: str, ca: Path) -> pika.ConnectionParameters:
    """The app user through the virtual IP's AMQPS port, verifying `<name>.<ns>.svc`."""
    secret = cluster.kube.get(f"/api/v1/namespaces/{namespace}/secrets/{name}-auth") or {}
    data = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    context = ssl.create_default_context(cafile=str(ca))
    return pika.ConnectionParameters(
        host=virtual_ip(cluster, namespace, name),
        port=AMQPS_PORT,
        ssl_options=pika.SSLOptions(context, server_hostname=f"{name}.{namespace}.svc"),
        credentials=pika.PlainCredentials(data["username"], data["password"]),
        connection_attempts=1,
    )


def served_certificate(ip: str, hostname: str, ca: Path) -> bytes:
    """The certificate a new TLS handshake with the virtual IP is shown (verified)."""
    context = ssl.create_default_context(cafile=str(ca))
    with (
        socket.create_connection((ip, AMQPS_PORT), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname=hostname) as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return der


@pytest.mark.timeout(600)
def test_tls_a_client_verifies_the_broker_by_the_virtual_ips_name_across_a_renewal(
    cluster: Cluster, tls_operator: OperatorProcess, namespace: str, tmp_path: Path
) -> None:
    name = create_cluster(cluster, namespace)
    ip = virtual_ip(cluster, namespace, name)
    wait_for("the virtual IP's AMQPS port answers", lambda: accepts(ip, AMQPS_PORT), timeout=30)
    ca = published_ca(cluster, namespace, name, tmp_path)
    hostname = f"{name}.{namespace}.svc"
    first = served_certificate(ip, hostname, ca)
    # A connection opened before the renewal, and kept across it.
    conn = pika.BlockingConnection(tls_params(cluster, namespace, name, ca))
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare("secured", durable=True)
    ch.basic_publish("", "secured", b"1", pika.BasicProperties(delivery_mode=2))

    def renewed() -> bool:
        conn.process_data_events(0)  # keep the open connection's heartbeats answered
        return served_certificate(ip, hostname, ca) != first

    # Issued anew at 80 s, then the kubelet's sync of the Secret volume (up to a minute or
    # so), then the broker's look at its files (seconds).
    wait_for("a renewed certificate served", renewed, timeout=240, interval=2)
    ch.basic_publish("", "secured", b"2", pika.BasicProperties(delivery_mode=2))
    conn.close()
    # The renewed certificate verifies under the same published CA; plain AMQP still works.
    again = pika.BlockingConnection(tls_params(cluster, namespace, name, ca))
    ch = again.channel()
    ch.confirm_delivery()
    ch.basic_publish("", "secured", b"3", pika.BasicProperties(delivery_mode=2))
    again.close()
    assert drain(amqp_url(cluster, namespace, name), "secured") == [1, 2, 3]
    # A client naming something the certificate does not cover is refused.
    with pytest.raises(ssl.SSLCertVerificationError):
        served_certificate(ip, f"elsewhere.{namespace}.svc", ca)


def passive_link_tls(status: dict[str, object]) -> bool:
    """Whether the status says the passive's link to the active runs mutual TLS."""
    brokers = status.get("brokers") or []
    assert isinstance(brokers, list)
    return any(b.get("role") == "passive" and b.get("linkConnected") and b.get("linkTls")
               for b in brokers)  # fmt: skip


@pytest.mark.timeout(600)
def test_tls_a_new_cluster_pairs_over_mutual_tls_and_fails_over(
    cluster: Cluster, tls_operator: OperatorProcess, namespace: str
) -> None:
    """Created at the last step: the pods' replication link is mutual TLS and the operator
    reads and sets the brokers over HTTPS from the start (it could not make the cluster
    Ready otherwise); the certificates (two minutes here) are renewed on the way; a
    failover pairs the restarted broker over mutual TLS again with every confirmed
    message."""
    name = create_cluster(cluster, namespace)
    status = cluster_status(cluster, namespace, name)
    assert status["peerTls"] == "Required"
    wait_for("the passive's link over mutual TLS",
             lambda: passive_link_tls(cluster_status(cluster, namespace, name)), 60)  # fmt: skip
    url = amqp_url(cluster, namespace, name)
    for i in range(50):
        publish_confirmed(url, "paired", str(i).encode())
    fail_over_over_mutual_tls(cluster, namespace, name, status["activeBroker"])
    assert drain(amqp_url(cluster, namespace, name), "paired") == list(range(50))


def fail_over_over_mutual_tls(cluster: Cluster, namespace: str, name: str, active: str) -> None:
    """Delete the active's pod; wait until the other broker is active and the restarted
    one is in sync again over mutual TLS."""
    cluster.kube.delete(pod_path(namespace, f"{name}-{active}"), {"gracePeriodSeconds": 0})
    wait_for(
        "the other broker active, the restarted one in sync over mutual TLS",
        lambda: (s := cluster_status(cluster, namespace, name)).get("activeBroker") != active
        and in_sync(s) and passive_link_tls(s),
        timeout=240, interval=1,
    )  # fmt: skip


@pytest.mark.slow  # four rolling updates (TLS on, then the three steps): minutes
@pytest.mark.timeout(900)
def test_tls_a_plaintext_cluster_moves_to_mutual_tls_under_traffic_losing_nothing(
    cluster: Cluster, tls_operator: OperatorProcess, namespace: str
) -> None:
    """A cluster without TLS (its brokers talk in plaintext, as every cluster an older
    operator made) gets `spec.tls` under confirmed traffic: the operator walks
    PlainListener, TlsListener, Required, one rolling update each, each from a pair in
    sync, and no confirmed message is lost."""
    name = create_cluster(cluster, namespace, spec={"tls": {"enabled": False}})
    assert cluster_status(cluster, namespace, name)["peerTls"] == "Plaintext"
    url = amqp_url(cluster, namespace, name)
    path = cluster_path(namespace, name)
    publish_confirmed(url, "moving", b"-1")  # declares the durable queue
    drain(url, "moving")
    walked: list[str] = ["Plaintext"]

    def done() -> bool:
        s = cluster_status(cluster, namespace, name)
        step = s.get("peerTls")
        if step and step != walked[-1]:
            walked.append(step)
        return step == "Required" and (s.get("rollout") or {}).get("step") == "Complete" and (
            condition(s, "Replicating") == "True") and passive_link_tls(s)  # fmt: skip

    async def traffic() -> tuple[int, ReliablePublisher]:
        publisher = ReliablePublisher([url], reconnect_delay=0.2, give_up_after=120)
        sent = 0
        deadline = time.monotonic() + 780
        while time.monotonic() < deadline:
            await publisher.publish(str(sent).encode(), "moving", message_id=f"m-{sent}")
            sent += 1
            if sent == 100:
                cluster.kube.patch(path, {"spec": {"tls": {"enabled": True}}})
            if sent > 100 and sent % 20 == 0 and done():
                break
        await publisher.close()
        return sent, publisher

    sent, publisher = asyncio.run(traffic())
    assert done(), f"the move did not finish: {walked}"
    assert walked == ["Plaintext", "PlainListener", "TlsListener", "Required"]
    received = drain(url, "moving")
    lost = sorted(set(range(sent)) - set(received))
    print(f"moved to mutual TLS under traffic: {sent} confirmed, lost {len(lost)}, "
          f"client reconnects {publisher.reconnects}; steps {walked}")  # fmt: skip
    assert not lost, f"confirmed messages lost: {lost[:20]}"
    reasons = reasons_when(cluster, namespace, "three PeerTlsStep Events",
                           lambda r: r.count("PeerTlsStep") >= 3)  # fmt: skip
    assert reasons.count("PeerTlsStep") == 3
    assert "FailedOver" not in reasons, "switchovers only, never a failover"
