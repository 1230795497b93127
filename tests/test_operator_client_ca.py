"""Applications' client certificates from the BrokerCluster spec (`spec.tls.clientCertificates`,
issue 16): the CRD's rules on a real API server, the pods the operator builds from the
stored spec (the CA bundle mounted, `--tls-ca` and `--tls-client-certs` that the broker's
own parser accepts), a mode change rolling the pods and a bundle change not."""

from __future__ import annotations

from typing import Any

import pytest
from apiserver import install_crd
from test_pod_security import dry_run_create, restricted_namespace

from twinmq.broker.settings import parse_args
from twinmq.operator import federationtls
from twinmq.operator.builders import ClusterRef, build_pod, pod_revision
from twinmq.operator.kube import Kube, Refused
from twinmq.operator.models import GROUP, KIND, VERSION, BrokerClusterSpec

CLUSTER = ClusterRef(namespace="default", name="orders", uid="uid-1")
CA_FILE = "/etc/twinmq/client-ca/ca.crt"


@pytest.fixture(scope="module")
def crd_kube(kube_apiserver: Any) -> Kube:
    api = Kube(str(kube_apiserver.kubeconfig))
    install_crd(api)
    return api


def stored(api: Kube, name: str, tls: dict[str, Any]) -> BrokerClusterSpec:
    """Create a BrokerCluster with `spec.tls` and read back what the API server stored
    (defaults filled in by the CRD), as the operator sees it."""
    meta = {"name": name, "namespace": "default"}
    api.apply({"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "metadata": meta,
               "spec": {"tls": tls}})  # fmt: skip
    found = api.get(f"{GROUP}/{VERSION}", KIND, "default", name)
    assert found is not None
    return BrokerClusterSpec.model_validate(found["spec"])


def broker_container(spec: BrokerClusterSpec) -> dict[str, Any]:
    container: dict[str, Any] = build_pod(CLUSTER, spec, "primary")["spec"]["containers"][0]
    return container


def volume(spec: BrokerClusterSpec, name: str) -> dict[str, Any] | None:
    volumes = build_pod(CLUSTER, spec, "primary")["spec"]["volumes"]
    return next((v for v in volumes if v["name"] == name), None)


@pytest.mark.parametrize(
    ("tls", "message"),
    [
        ({"clientCertificates": {"mode": "required"}}, "need a CA bundle"),
        ({"clientCertificates": {}}, "need a CA bundle"),  # required is the default
        ({"clientCertificates": {"mode": "optional"}}, "need a CA bundle"),
        (
            {"clientCertificates": {"caConfigMap": "a", "caSecretName": "b"}},
            "one CA bundle: caConfigMap or caSecretName, not both",
        ),
        (
            {"enabled": False, "clientCertificates": {"caConfigMap": "apps-ca"}},
            "client certificates are verified on AMQPS: they need tls.enabled",
        ),
        ({"clientCertificates": {"mode": "sometimes", "caConfigMap": "a"}}, "mode"),
    ],
    ids=["no-ca", "default-mode-no-ca", "optional-no-ca", "both-sources", "tls-off", "bad-mode"],
)
def test_the_crd_refuses_client_certificates_without_a_ca_or_without_amqps(
    crd_kube: Kube, tls: dict[str, Any], message: str
) -> None:
    with pytest.raises(Refused) as refused:
        stored(crd_kube, "bad", tls)
    assert message in str(refused.value)


def test_the_pods_mount_the_config_map_bundle_and_require_client_certificates(
    crd_kube: Kube,
) -> None:
    spec = stored(crd_kube, "apps", {"clientCertificates": {"caConfigMap": "apps-ca"}})
    container = broker_container(spec)
    assert f"--tls-ca={CA_FILE}" in container["args"]
    assert "--tls-client-certs=required" in container["args"]  # the default mode
    assert volume(spec, "client-ca") == {"name": "client-ca", "configMap": {
        "name": "apps-ca", "items": [{"key": "ca.crt", "path": "ca.crt"}]}}  # fmt: skip
    # A whole volume (no subPath): the kubelet's updates of the bundle reach the broker.
    mount = next(m for m in container["volumeMounts"] if m["name"] == "client-ca")
    assert mount == {"name": "client-ca", "mountPath": "/etc/twinmq/client-ca", "readOnly": True}
    # What the operator passes is what the broker's own settings accept.
    tls_flags = ("--tls-ca", "--tls-client-certs", "--tls-cert", "--tls-key")
    settings = parse_args([a for a in container["args"] if a.split("=")[0] in tls_flags])
    assert str(settings.tls_ca) == CA_FILE
    assert settings.effective_tls_client_certs == "required"


def test_a_secret_bundle_under_its_own_key_with_optional_certificates(crd_kube: Kube) -> None:
    spec = stored(crd_kube, "apps-secret", {"clientCertificates": {
        "mode": "optional", "caSecretName": "apps-ca", "caKey": "bundle.pem"}})  # fmt: skip
    assert "--tls-client-certs=optional" in broker_container(spec)["args"]
    assert volume(spec, "client-ca") == {"name": "client-ca", "secret": {
        "secretName": "apps-ca", "items": [{"key": "bundle.pem", "path": "ca.crt"}]}}  # fmt: skip


def test_mode_none_or_no_section_asks_for_no_certificate(crd_kube: Kube) -> None:
    for tls in ({"clientCertificates": {"mode": "none"}}, {}):
        spec = stored(crd_kube, "no-client-certs", tls)
        assert not any(
            a.startswith(("--tls-ca", "--tls-client-certs")) for a in broker_container(spec)["args"]
        )
        assert volume(spec, "client-ca") is None


def test_the_spec_bundle_takes_amqps_and_the_downstreams_cas_go_beside_it() -> None:
    """With both, `--tls-ca` and the mode are the spec's (the certificates that may log
    in), never two `--tls-ca` flags the last of which silently wins; the downstreams' CAs
    are `--tls-federation-ca`, for the handshake only (tests/test_cert_login_scope.py)."""
    spec = BrokerClusterSpec.model_validate({
        "tls": {"clientCertificates": {"caConfigMap": "apps-ca"}},
        "federation": {"downstreamCaConfigMap": "downstream-cas"},
    })  # fmt: skip
    args = broker_container(spec)["args"]
    assert [a for a in args if a.startswith("--tls-ca")] == [f"--tls-ca={CA_FILE}"]
    assert [a for a in args if a.startswith("--tls-client-certs")] == [
        "--tls-client-certs=required"
    ]
    assert [a for a in args if a.startswith("--tls-federation-ca")] == [
        "--tls-federation-ca=/etc/twinmq/federation-downstream-ca/ca.crt"
    ]
    found = volume(spec, "federation-downstream-ca")
    assert found is not None and found["configMap"]["name"] == "downstream-cas"


def test_a_mode_change_or_turning_client_certificates_on_rolls_the_pods() -> None:
    def revision(**certs: Any) -> str | None:
        raw = {"tls": {"clientCertificates": {"caConfigMap": "apps-ca", **certs}}}
        return pod_revision(build_pod(CLUSTER, BrokerClusterSpec.model_validate(raw), "primary"))

    required = revision()
    assert revision() == required  # the same spec, the same pods
    assert revision(mode="optional") != required  # a new flag: the pods are replaced
    off = pod_revision(build_pod(CLUSTER, BrokerClusterSpec(), "primary"))
    assert off != required


def test_an_upstream_with_client_certificates_verifies_the_downstreams_cas_beside_its_bundle(
    crd_kube: Kube,
) -> None:
    """As a federation upstream the operator makes AMQPS verify its downstreams' CAs (its
    kept copy here) with the spec's own bundle too: beside it (`--tls-federation-ca`),
    never in it, and its condition says they are no login."""
    spec = BrokerClusterSpec.model_validate({
        "tls": {"clientCertificates": {"mode": "optional", "caConfigMap": "apps-ca"}},
        "federation": {},
    })  # fmt: skip
    # No BrokerCluster names this one upstream yet: nothing more is verified, and it says so.
    alone = federationtls.resolve_downstreams(CLUSTER, spec, crd_kube, {})
    assert alone is not None and alone.bundle is None
    assert alone.message.startswith("no downstreams' CAs verified")
    # A bundle of the downstreams' CAs given: verified beside the applications', no login.
    given = spec.model_copy(deep=True)
    assert given.federation is not None
    given.federation.downstream_ca_config_map = "downstream-cas"
    named = federationtls.resolve_downstreams(CLUSTER, given, crd_kube, {})
    shown = federationtls.condition(federationtls.Trust((), named))
    assert shown is not None and "downstream-cas" in shown[3] and "never a login" in shown[3]
    # The operator's copy (what the downstreams' published CAs made it) goes beside it too.
    copy = federationtls.downstream_ca_name(CLUSTER.name)
    down = federationtls.DownstreamTrust("m", "PEM", ("default/remote",), copy)
    trust = federationtls.Trust((), down)
    built = federationtls.effective(CLUSTER, spec, trust)
    assert built.federation is not None
    assert built.federation.downstream_ca_config_map == "orders-federation-downstream-ca"
    flags = [a for a in broker_container(built)["args"] if a.startswith(("--tls-ca", "--tls-cl",
                                                                         "--tls-fed"))]  # fmt: skip
    assert flags == [f"--tls-ca={CA_FILE}", "--tls-client-certs=optional",
                     "--tls-federation-ca=/etc/twinmq/federation-downstream-ca/ca.crt"]  # fmt: skip


@pytest.mark.parametrize("source", ["caConfigMap", "caSecretName"])
def test_the_pods_with_the_bundle_are_admitted_where_restricted_is_enforced(
    crd_kube: Kube, source: str
) -> None:
    """The API server takes the pod as built (dry run): the volume's shape is a real one,
    and a ConfigMap or Secret volume keeps the pod within the `restricted` level."""
    spec = stored(crd_kube, f"admitted-{source.lower()}", {"clientCertificates": {
        "mode": "optional", source: "apps-ca"}})  # fmt: skip
    namespace = restricted_namespace(crd_kube)
    pod = build_pod(ClusterRef(namespace=namespace, name="orders", uid="u-1"), spec, "primary")
    assert volume(spec, "client-ca") is not None
    account = {"name": pod["spec"]["serviceAccountName"], "namespace": namespace}
    crd_kube.apply({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": account})
    dry_run_create(crd_kube, pod)
