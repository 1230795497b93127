"""AMQPS through the virtual IP, certificates from the operator (issue 16): a client verifies
the broker against the CA the operator publishes (`<cluster>-ca`) by the virtual IP's DNS
name; the server certificate, given a short lifetime here, is renewed and reaches the
broker through the kubelet's update of the Secret volume while a connection opened
before stays up.

The client runs on the host (the local cluster routes Service IPs there) and connects to
the Service's cluster IP, naming `<cluster>.<namespace>.svc` in the TLS handshake as a
client in the cluster would by DNS.
"""

from __future__ import annotations

import base64
import socket
import ssl
from collections.abc import Iterator
from pathlib import Path

import pika
import pytest
from brokerclusters import (
    OperatorProcess,
    amqp_url,
    create_cluster,
    drain,
    operator_fixture,
    virtual_ip,
)
from support import Cluster

from twinmq.broker.names import AMQPS_PORT
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
