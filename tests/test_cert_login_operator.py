"""Certificate login from the BrokerCluster spec (`spec.tls.clientCertificates.login`):
the CRD's rule on a real API server (only with client certificates verified), and the
broker argument the operator builds from the stored spec, which the broker's own parser
accepts."""

from __future__ import annotations

from typing import Any

import pytest
from apiserver import install_crd
from test_operator_client_ca import broker_container, stored

from twinmq.broker.settings import parse_args
from twinmq.operator.kube import Kube, Refused

TLS_FLAGS = ("--tls-ca", "--tls-client-certs", "--tls-cert", "--tls-key", "--tls-cert-login")


@pytest.fixture(scope="module")
def crd_kube(kube_apiserver: Any) -> Kube:
    api = Kube(str(kube_apiserver.kubeconfig))
    install_crd(api)
    return api


@pytest.mark.parametrize(
    ("client_certificates", "message"),
    [
        ({"mode": "none", "login": "commonName"}, "needs client certificates verified"),
        ({"mode": "optional", "caConfigMap": "apps-ca", "login": "userId"}, "login"),
    ],
    ids=["mode-none", "unknown-source"],
)
def test_the_crd_refuses_a_certificate_login_without_verified_certificates(
    crd_kube: Kube, client_certificates: dict[str, str], message: str
) -> None:
    with pytest.raises(Refused) as refused:
        stored(crd_kube, "bad-login", {"clientCertificates": client_certificates})
    assert message in str(refused.value)


@pytest.mark.parametrize(
    ("login", "flag"),
    [("commonName", "common_name"), ("distinguishedName", "distinguished_name"),
     ("sanDns", "san_dns"), ("sanEmail", "san_email")],
)  # fmt: skip
def test_the_pods_pass_the_login_source_the_broker_accepts(
    crd_kube: Kube, login: str, flag: str
) -> None:
    spec = stored(crd_kube, "cert-login", {"clientCertificates": {
        "mode": "optional", "caConfigMap": "apps-ca", "login": login}})  # fmt: skip
    args = broker_container(spec)["args"]
    assert f"--tls-cert-login={flag}" in args
    settings = parse_args([a for a in args if a.split("=")[0] in TLS_FLAGS])
    assert settings.tls_cert_login == flag


def test_without_login_no_certificate_login_is_offered(crd_kube: Kube) -> None:
    spec = stored(crd_kube, "no-login", {"clientCertificates": {"caConfigMap": "apps-ca"}})
    assert not any(a.startswith("--tls-cert-login") for a in broker_container(spec)["args"])
