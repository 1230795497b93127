"""spec.mirror.tls on Kubernetes: each site's mirror certificate (its own CA), the other
site's CA from a ConfigMap, the brokers' settings; the certificates on a real API server,
then used by real brokers (the operator's certificates pass the brokers' checks)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID
from mirrorsites import Sites, browse, mirror_status, publish
from test_mirror_tls import use_tls
from test_operator_mirroring import env_of, settings_from

from twinmq.broker.names import MIRROR_PORT, setting_env
from twinmq.operator import certs, mirroring
from twinmq.operator.builders import ClusterRef, build_pod
from twinmq.operator.kube import Kube
from twinmq.operator.models import BrokerClusterSpec
from twinmq.testing.certs import Leaf

NOW = datetime(2026, 11, 28, tzinfo=UTC)
SOURCE = ClusterRef(name="orders", namespace="site-a", uid="u-1")
REPLICA = ClusterRef(name="orders", namespace="site-b", uid="u-2")
TARGET = {"host": "orders.site-b.svc", "port": MIRROR_PORT}


def spec(mirror_tls: dict[str, Any] | None = None, **more: Any) -> BrokerClusterSpec:
    mirror: dict[str, Any] = {"role": "source", "target": TARGET, "secretName": "dr"}
    if mirror_tls is not None:
        mirror["tls"] = mirror_tls
    return BrokerClusterSpec.model_validate({"mirror": mirror, **more})


def pod(s: BrokerClusterSpec) -> dict[str, Any]:
    return build_pod(SOURCE, s, "primary")


def volumes(p: dict[str, Any]) -> dict[str, Any]:
    return {v["name"]: v for v in p["spec"]["volumes"]}


def test_without_the_other_sites_ca_the_link_stays_plaintext_with_its_token() -> None:
    p = pod(spec())
    env = env_of(p)
    assert setting_env("mirror_tls_cert") not in env
    assert "mirror-tls" not in volumes(p)
    assert settings_from(env).mirror_tls_cert is None


def test_with_the_other_sites_ca_the_brokers_run_the_link_over_mutual_tls() -> None:
    p = pod(spec({"caConfigMap": "site-b-ca"}))
    settings = settings_from(env_of(p))
    assert settings.mirror_tls_cert == Path(f"{mirroring.TLS_DIR}/tls.crt")
    assert settings.mirror_tls_key == Path(f"{mirroring.TLS_DIR}/tls.key")
    assert settings.mirror_tls_ca == Path(f"{mirroring.CA_DIR}/ca.crt")
    found = volumes(p)
    assert found["mirror-tls"]["secret"]["secretName"] == "orders-mirror-tls"
    assert found["mirror-ca"]["configMap"] == {
        "name": "site-b-ca", "items": [{"key": "ca.crt", "path": "ca.crt"}]
    }  # fmt: skip
    (container,) = p["spec"]["containers"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["mirror-tls"] == mirroring.TLS_DIR and mounts["mirror-ca"] == mirroring.CA_DIR


@pytest.mark.parametrize(
    "more",
    [
        {"tls": {"enabled": False}},
        {"tls": {"secretName": "mine"}},  # one Secret of your own: no site identity
    ],
)
def test_no_mirror_tls_without_certificates_the_operator_can_have_issued(
    more: dict[str, Any],
) -> None:
    s = spec({"caConfigMap": "site-b-ca"}, **more)
    assert not mirroring.certificate_wanted(s) and not mirroring.tls_on(s)
    assert setting_env("mirror_tls_cert") not in env_of(pod(s))


def test_a_target_given_by_address_is_checked_for_the_server_name_given() -> None:
    s = spec({"caConfigMap": "site-b-ca", "serverName": "orders.site-b.svc"})
    assert settings_from(env_of(pod(s))).mirror_tls_server_name == "orders.site-b.svc"
    assert setting_env("mirror_tls_server_name") not in env_of(pod(spec({"caConfigMap": "x"})))


def test_mirror_tls_can_be_turned_off() -> None:
    s = spec({"enabled": False, "caConfigMap": "site-b-ca"})
    assert not mirroring.tls_on(s)
    assert setting_env("mirror_tls_ca") not in env_of(pod(s))


def test_with_an_issuer_cert_manager_is_asked_for_the_site_identity() -> None:
    s = spec(
        {"caConfigMap": "site-b-ca", "serverNames": ["dr.example.com"]},
        tls={"issuerRef": {"name": "ca-issuer", "kind": "ClusterIssuer"}},
    )
    applied: list[dict[str, Any]] = []

    class NoSecrets:
        def get_secret_data(
            self, namespace: str, name: str, owner: object = None
        ) -> dict[str, str] | None:
            return None

    certs.reconcile_tls(SOURCE, s, certs.TlsMemory(), NoSecrets(), applied.append, clock=0.0)
    (cert,) = [a for a in applied if a["metadata"]["name"] == "orders-mirror-tls"]
    assert cert["kind"] == "Certificate"
    assert cert["spec"]["commonName"] == "site-a/orders"
    assert "orders.site-a.svc" in cert["spec"]["dnsNames"]
    assert "dr.example.com" in cert["spec"]["dnsNames"]
    assert {"server auth", "client auth"} <= set(cert["spec"]["usages"])


# -- real API server, then real brokers -----------------------------------------------------


def mirror_cert(kube: Kube, cluster: ClusterRef) -> tuple[dict[str, str], x509.Certificate]:
    data = kube.get_secret_data(cluster.namespace, f"{cluster.name}-mirror-tls")
    assert data is not None
    return data, x509.load_pem_x509_certificate(data["tls.crt"].encode())


def test_each_site_gets_a_mirror_identity_from_its_own_ca(kube: Kube) -> None:
    cluster = ClusterRef(namespace="default", name="mirror-id", uid="uid-mirror-id")
    s = spec({"caConfigMap": "other-ca"})
    memory = certs.TlsMemory()
    certs.reconcile_tls(cluster, s, memory, kube, kube.apply, now=NOW, seconds=3600)
    data, cert = mirror_cert(kube, cluster)
    ca = kube.get_secret_data("default", "mirror-id-tls-ca")
    assert ca is not None
    cert.verify_directly_issued_by(x509.load_pem_x509_certificate(ca["tls.crt"].encode()))
    assert certs.common_name(cert) == "default/mirror-id"
    assert certs.sans(cert) == mirroring.certificate_names(s, "default", "mirror-id")
    usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH} <= set(usages)
    # What the other site copies in: the `<cluster>-ca` ConfigMap holds the signer.
    published = kube.get("v1", "ConfigMap", "default", "mirror-id-ca")
    assert published is not None and published["data"]["ca.crt"] == data["ca.crt"]
    # A restarted operator keeps it; a new server name issues it again.
    again = certs.TlsMemory()
    certs.reconcile_tls(cluster, s, again, kube, kube.apply, now=NOW, seconds=3600)
    assert again.issued == 0 and mirror_cert(kube, cluster)[0] == data
    more = spec({"caConfigMap": "other-ca", "serverNames": ["dr.example.com"]})
    certs.reconcile_tls(cluster, more, again, kube, kube.apply, now=NOW, seconds=3600)
    assert "dr.example.com" in certs.sans(mirror_cert(kube, cluster)[1])


def write_site(kube: Kube, cluster: ClusterRef, folder: Path) -> tuple[Path, Path, Path]:
    """The site's mirror certificate and key, and its CA (as the other site copies it),
    as files."""
    folder.mkdir(parents=True)
    data, _ = mirror_cert(kube, cluster)
    paths = folder / "tls.crt", folder / "tls.key", folder / "ca.crt"
    for path, key in zip(paths, ("tls.crt", "tls.key", "ca.crt"), strict=True):
        path.write_text(data[key])
    return paths


def test_the_operators_certificates_carry_a_mirror_between_two_sites_with_two_cas(
    kube: Kube, tmp_path: Path
) -> None:
    """Real brokers with the certificates the operator issued for two BrokerClusters: the
    source checks the replica's for its virtual IP's name, the replica checks that the
    source's names the origin (`<namespace>/<name>`) it claims."""
    a = ClusterRef(namespace="default", name="site-a", uid="uid-site-a")
    b = ClusterRef(namespace="default", name="site-b", uid="uid-site-b")
    for cluster in (a, b):
        certs.reconcile_tls(cluster, spec({"caConfigMap": "x"}), certs.TlsMemory(), kube,
                            kube.apply, now=datetime.now(UTC), seconds=3600)  # fmt: skip
    a_cert, a_key, a_ca = write_site(kube, a, tmp_path / "a-files")
    b_cert, b_key, b_ca = write_site(kube, b, tmp_path / "b-files")
    assert a_ca.read_text() != b_ca.read_text()  # a CA per BrokerCluster
    origin = mirroring.site_id("default", "site-a")
    sites = Sites(tmp_path / "sites", source_args=["--mirror-id", origin])
    # The source dials loopback here; on Kubernetes it dials the VIP's name, checked as is.
    use_tls(sites.source, Leaf(a_cert, a_key), b_ca, "site-b.default.svc")
    use_tls(sites.mirror, Leaf(b_cert, b_key), a_ca)
    with sites:
        publish(sites.source, "orders", [b"one", b"two"])
        sites.caught_up()
        assert browse(sites.mirror, "orders") == [b"one", b"two"]
        section = mirror_status(sites.source)
        assert section is not None and section["tls"]
