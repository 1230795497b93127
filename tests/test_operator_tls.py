"""AMQPS from the operator (operator/certs.py, issue 16): TLS on by default, the managed CA's
server certificate naming the virtual IP, the headless Service and the pods, renewed before
it expires (real API server), cert-manager's Certificate, and a real broker started with
the generated files that a pika client verifies by the virtual IP's DNS name."""

from __future__ import annotations

import json
import os
import shutil
import ssl
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pika
import pytest
import yaml
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID
from kubernetes.dynamic.exceptions import ResourceNotFoundError

from twinmq.broker.names import AMQPS_PORT
from twinmq.operator import certs
from twinmq.operator.builders import (
    ClusterRef,
    build_headless_service,
    build_pod,
    build_vip_service,
)
from twinmq.operator.kube import Kube
from twinmq.operator.models import BrokerClusterSpec
from twinmq.operator.netpolicy import OperatorPods, build_network_policy
from twinmq.testing.launcher import BrokerProcess, free_port
from twinmq.testing.waiting import wait_for

CLUSTER = ClusterRef(namespace="shop", name="orders", uid="uid-1")
NOW = datetime(2026, 11, 27, 20, 0, tzinfo=UTC)
VIP_NAMES = ["orders", "orders.shop", "orders.shop.svc", "orders.shop.svc.cluster.local"]


def spec_of(**tls: Any) -> BrokerClusterSpec:
    return BrokerClusterSpec.model_validate({"tls": tls})


def broker_container(spec: BrokerClusterSpec) -> dict[str, Any]:
    container: dict[str, Any] = build_pod(CLUSTER, spec, "primary")["spec"]["containers"][0]
    return container


def test_tls_is_on_by_default_amqps_beside_amqp_on_pods_services_and_policy() -> None:
    spec = BrokerClusterSpec()
    assert spec.tls.enabled
    pod = build_pod(CLUSTER, spec, "primary")
    container = pod["spec"]["containers"][0]
    assert "--tls-cert=/etc/twinmq/tls/tls.crt" in container["args"]
    assert "--tls-key=/etc/twinmq/tls/tls.key" in container["args"]
    assert {"name": "amqps", "containerPort": AMQPS_PORT} in container["ports"]
    assert {"name": "amqp", "containerPort": 5672} in container["ports"]
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "tls")
    assert volume["secret"]["secretName"] == "orders-tls"
    # A whole-Secret volume (no subPath): the kubelet's updates reach the broker's files.
    mount = next(m for m in container["volumeMounts"] if m["name"] == "tls")
    assert "subPath" not in mount and mount["readOnly"]
    vip = build_vip_service(CLUSTER, None, amqps=True)["spec"]["ports"]
    assert {"name": "amqps", "port": AMQPS_PORT, "targetPort": "amqps"} in vip
    headless = build_headless_service(CLUSTER, amqps=True)["spec"]["ports"]
    assert {"name": "amqps", "port": AMQPS_PORT} in headless
    policy = build_network_policy(CLUSTER, spec, OperatorPods("ops", {"a": "b"}))
    open_to_all = policy["spec"]["ingress"][0]
    assert "from" not in open_to_all
    assert {"protocol": "TCP", "port": AMQPS_PORT} in open_to_all["ports"]


def test_tls_disabled_leaves_plain_amqp_only() -> None:
    spec = spec_of(enabled=False)
    container = broker_container(spec)
    assert not any(a.startswith("--tls") for a in container["args"])
    assert all(p["name"] != "amqps" for p in container["ports"])
    pod = build_pod(CLUSTER, spec, "primary")
    assert all(v["name"] != "tls" for v in pod["spec"]["volumes"])
    assert all(p["name"] != "amqps" for p in build_vip_service(CLUSTER)["spec"]["ports"])
    policy = build_network_policy(CLUSTER, spec, OperatorPods("ops", {"a": "b"}))
    assert {"protocol": "TCP", "port": AMQPS_PORT} not in policy["spec"]["ingress"][0]["ports"]


def test_a_secret_of_your_own_is_mounted_as_is() -> None:
    pod = build_pod(CLUSTER, spec_of(secretName="my-cert"), "primary")
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "tls")
    assert volume["secret"]["secretName"] == "my-cert"


def test_the_server_certificate_names_the_virtual_ip_the_headless_service_and_the_pods() -> None:
    names = certs.dns_names(CLUSTER)
    assert names[:4] == VIP_NAMES
    for name in (
        "orders-brokers.shop.svc",
        "orders-primary",
        "orders-backup.orders-brokers.shop.svc.cluster.local",
        "orders-primary.orders-brokers.shop.svc",
    ):
        assert name in names
    ca = certs.new_ca(CLUSTER, NOW)
    server = certs.issue_server(ca, names, NOW, 3600)
    cert = server.certificate()
    cert.verify_directly_issued_by(ca.certificate())
    assert certs.sans(cert) == names
    usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usage) == [ExtendedKeyUsageOID.SERVER_AUTH]
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert ca.certificate().extensions.get_extension_for_class(x509.BasicConstraints).value.ca


def test_a_certificate_is_issued_again_at_two_thirds_of_its_life_or_for_new_names() -> None:
    ca = certs.new_ca(CLUSTER, NOW)
    names = certs.dns_names(CLUSTER)
    server = certs.issue_server(ca, names, NOW, 3000)
    assert certs.reissue_reason(server, ca, names, NOW + timedelta(seconds=1500)) is None
    due = certs.reissue_reason(server, ca, names, NOW + timedelta(seconds=1900))
    assert due is not None and due.startswith("renewal due")
    changed = certs.reissue_reason(server, ca, names[:-1], NOW)
    assert changed is not None and "names" in changed
    other = certs.new_ca(ClusterRef("other", "shop", "u2"), NOW)
    foreign = certs.reissue_reason(server, other, names, NOW)
    assert foreign is not None and "not one this cluster's CA signed" in foreign
    assert certs.reissue_reason(None, ca, names, NOW) == "no server certificate yet"


def test_the_lifetime_setting_is_read_and_too_short_is_refused() -> None:
    assert certs.cert_seconds({}) == 90 * 86400
    assert certs.cert_seconds({certs.CERT_SECONDS_ENV: "60"}) == 60
    with pytest.raises(ValueError, match="at least 30"):
        certs.cert_seconds({certs.CERT_SECONDS_ENV: "5"})


def test_with_an_issuer_the_operator_asks_cert_manager_for_the_same_names() -> None:
    spec = spec_of(issuerRef={"name": "corp-ca", "kind": "ClusterIssuer"})
    certificate = certs.build_certificate(CLUSTER, spec.tls)
    assert certificate["apiVersion"] == "cert-manager.io/v1"
    assert certificate["kind"] == "Certificate"
    body = certificate["spec"]
    assert body["secretName"] == "orders-tls"
    assert body["dnsNames"] == certs.dns_names(CLUSTER)
    assert body["issuerRef"] == {"name": "corp-ca", "kind": "ClusterIssuer",
                                 "group": "cert-manager.io"}  # fmt: skip
    assert "server auth" in body["usages"]
    assert certificate["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    volume = next(v for v in build_pod(CLUSTER, spec, "backup")["spec"]["volumes"]
                  if v["name"] == "tls")  # fmt: skip
    assert volume["secret"]["secretName"] == "orders-tls"


# -- real API server ------------------------------------------------------------------------


def secret(kube: Kube, cluster: ClusterRef, name: str) -> dict[str, str]:
    data = kube.get_secret_data(cluster.namespace, name)
    assert data is not None, name
    return data


def config_map_ca(kube: Kube, cluster: ClusterRef) -> str:
    found = kube.get("v1", "ConfigMap", cluster.namespace, certs.ca_config_map_name(cluster))
    assert found is not None
    return str(found["data"]["ca.crt"])


def test_the_operator_keeps_the_ca_and_server_secrets_and_publishes_the_ca(kube: Kube) -> None:
    cluster = ClusterRef(namespace="default", name="tls-made", uid="uid-made")
    spec = BrokerClusterSpec()
    memory = certs.TlsMemory()
    certs.reconcile_tls(cluster, spec, memory, kube, kube.apply, now=NOW, seconds=3600)
    ca = secret(kube, cluster, "tls-made-tls-ca")
    server = secret(kube, cluster, "tls-made-tls")
    served = x509.load_pem_x509_certificate(server["tls.crt"].encode())
    served.verify_directly_issued_by(x509.load_pem_x509_certificate(ca["tls.crt"].encode()))
    assert certs.sans(served) == certs.dns_names(cluster)
    assert "tls-made.default.svc" in certs.sans(served)
    assert server["ca.crt"] == ca["tls.crt"] == config_map_ca(kube, cluster)
    stored = kube.get("v1", "Secret", "default", "tls-made-tls")
    assert stored is not None and stored["type"] == "kubernetes.io/tls"
    # A restarted operator (no memory) takes the certificate it finds: nothing new issued.
    again = certs.TlsMemory()
    certs.reconcile_tls(cluster, spec, again, kube, kube.apply, now=NOW, seconds=3600)
    assert again.issued == 0
    assert secret(kube, cluster, "tls-made-tls") == server
    # A deleted server Secret is restored with the same certificate.
    kube.delete("v1", "Secret", "default", "tls-made-tls")
    certs.reconcile_tls(cluster, spec, again, kube, kube.apply, now=NOW, seconds=3600)
    assert secret(kube, cluster, "tls-made-tls") == server


def test_a_certificate_near_expiry_is_renewed_under_the_same_ca(
    kube: Kube, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(certs.CERT_SECONDS_ENV, "30")  # the operator's setting, as in e2e
    cluster = ClusterRef(namespace="default", name="tls-renew", uid="uid-renew")
    spec = BrokerClusterSpec()
    memory = certs.TlsMemory()
    start = datetime.now(UTC)
    certs.reconcile_tls(cluster, spec, memory, kube, kube.apply, now=start)
    first = secret(kube, cluster, "tls-renew-tls")
    cert = x509.load_pem_x509_certificate(first["tls.crt"].encode())
    assert cert.not_valid_after_utc - start <= timedelta(seconds=31)
    certs.reconcile_tls(cluster, spec, memory, kube, kube.apply, now=start + timedelta(seconds=5))
    assert secret(kube, cluster, "tls-renew-tls") == first  # not due yet
    # Two thirds of its life later: renewed.
    later = certs.renew_at(cert) + timedelta(seconds=1)
    certs.reconcile_tls(cluster, spec, memory, kube, kube.apply, now=later)
    renewed = secret(kube, cluster, "tls-renew-tls")
    assert renewed["tls.crt"] != first["tls.crt"] and renewed["tls.key"] != first["tls.key"]
    assert renewed["ca.crt"] == first["ca.crt"]  # clients' trust is unchanged
    new = x509.load_pem_x509_certificate(renewed["tls.crt"].encode())
    assert new.not_valid_after_utc > cert.not_valid_after_utc
    # Twice: the AMQPS server certificate and each broker's own (operator/peertls.py).
    assert memory.issued == 2 * 3


def test_the_ca_of_a_secret_of_your_own_is_published(kube: Kube) -> None:
    cluster = ClusterRef(namespace="default", name="tls-own", uid="uid-own")
    ca = certs.new_ca(cluster, NOW)
    server = certs.issue_server(ca, certs.dns_names(cluster), NOW, 3600)
    own = certs.build_server_secret(cluster, spec_of(secretName="mine").tls, server, ca.cert)
    own["metadata"].pop("ownerReferences")
    kube.apply(own)
    memory = certs.TlsMemory()
    certs.reconcile_tls(cluster, spec_of(secretName="mine"), memory, kube, kube.apply)
    assert config_map_ca(kube, cluster) == ca.cert
    assert kube.get_secret_data("default", "tls-own-tls-ca") is None  # no CA of its own


# -- a real broker with the generated files -------------------------------------------------


def test_a_broker_with_the_operators_certificate_is_verified_by_the_virtual_ips_name(
    tmp_path: Path,
) -> None:
    ca = certs.new_ca(CLUSTER, datetime.now(UTC))
    server = certs.issue_server(ca, certs.dns_names(CLUSTER), datetime.now(UTC), 3600)
    files = tmp_path / "tls"
    files.mkdir()
    (files / "tls.crt").write_text(server.cert)
    (files / "tls.key").write_text(server.key)
    (files / "ca.crt").write_text(ca.cert)
    port = free_port()
    broker = BrokerProcess(tmp_path / "data", name="tls")
    broker.extra_args = [f"--tls-cert={files / 'tls.crt'}", f"--tls-key={files / 'tls.key'}",
                         f"--tls-port={port}"]  # fmt: skip
    # What the docs tell an application: trust the `<cluster>-ca` ConfigMap's ca.crt and
    # check the name it connects by (here loopback stands in for the Service's address).
    context = ssl.create_default_context(cafile=str(files / "ca.crt"))

    def params(name: str) -> pika.ConnectionParameters:
        return pika.ConnectionParameters(
            host="127.0.0.1", port=port, ssl_options=pika.SSLOptions(context, name),
            connection_attempts=1,
        )  # fmt: skip

    with broker.start():
        conn = pika.BlockingConnection(params("orders.shop.svc"))
        ch = conn.channel()
        ch.queue_declare("secured")
        ch.confirm_delivery()
        ch.basic_publish("", "secured", b"over tls")
        method, _, body = ch.basic_get("secured", auto_ack=True)
        assert method is not None and body == b"over tls"
        conn.close()
        for name in ("orders.shop.svc.cluster.local", "orders-backup.orders-brokers.shop.svc"):
            pika.BlockingConnection(params(name)).close()
        with pytest.raises((pika.exceptions.AMQPError, ssl.SSLError, ConnectionError)):
            pika.BlockingConnection(params("someone-else.shop.svc"))


# -- cert-manager's Certificate on the real API server, with cert-manager's own CRD ---------

CERT_MANAGER_MODULE = "github.com/cert-manager/cert-manager@v1.16.2"
CERTIFICATE_CRD = "deploy/crds/crd-certificates.yaml"


def cert_manager_crd() -> dict[str, Any]:
    """cert-manager's Certificate CRD as its Go module publishes it (the Helm chart's copy:
    its template directives sit in comments and in label values, dropped here)."""
    if shutil.which("go") is None:
        pytest.skip("no go: cert-manager's CRD comes from its Go module")
    found = subprocess.run(
        ["go", "mod", "download", "-json", CERT_MANAGER_MODULE],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "GOFLAGS": "-mod=mod"},
    )  # fmt: skip
    if found.returncode != 0:
        pytest.fail(f"go mod download {CERT_MANAGER_MODULE}: {found.stdout}{found.stderr}")
    crd = yaml.safe_load((Path(json.loads(found.stdout)["Dir"]) / CERTIFICATE_CRD).read_text())
    crd["metadata"] = {"name": crd["metadata"]["name"]}
    return dict(crd)


def test_cert_managers_api_server_takes_the_certificate_as_built(kube: Kube) -> None:
    kube.apply(cert_manager_crd())

    def served() -> bool:
        try:
            kube.dynamic.resources.invalidate_cache()
            kube.dynamic.resources.get(api_version="cert-manager.io/v1", kind="Certificate")
        except ResourceNotFoundError:
            return False
        return True

    wait_for("cert-manager's Certificate kind served", served, 60)
    cluster = ClusterRef(namespace="default", name="tls-cm", uid="uid-cm")
    spec = spec_of(issuerRef={"name": "corp-ca", "kind": "ClusterIssuer"})
    memory = certs.TlsMemory()
    certs.reconcile_tls(cluster, spec, memory, kube, kube.apply, clock=0.0)
    stored = kube.get("cert-manager.io/v1", "Certificate", "default", "tls-cm-tls")
    assert stored is not None
    # Nothing pruned or defaulted away: the schema knows every field the operator sets.
    assert stored["spec"] == certs.build_certificate(cluster, spec.tls)["spec"]
    assert kube.get_secret_data("default", "tls-cm-tls-ca") is None  # cert-manager's job
    # Once cert-manager has written the Secret (as it does, with ca.crt), the CA is
    # published for clients at the next read.
    ca = certs.new_ca(cluster, NOW)
    server = certs.issue_server(ca, certs.dns_names(cluster), NOW, 3600)
    written = certs.build_server_secret(cluster, spec.tls, server, ca.cert)
    written["metadata"].pop("ownerReferences")
    written["metadata"]["annotations"] = {"cert-manager.io/certificate-name": "tls-cm-tls"}
    kube.apply(written)
    certs.reconcile_tls(cluster, spec, memory, kube, kube.apply, clock=certs.READ_EVERY)
    assert config_map_ca(kube, cluster) == ca.cert
