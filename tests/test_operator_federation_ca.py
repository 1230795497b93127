"""Federation over amqps between BrokerClusters by default (issues 15 and 16,
`operator/federationtls.py`): the downstream copies its upstream's CA and presents a client
certificate its own CA issued; the upstream trusts the downstreams' CAs for optional client
certificates. Builders and rules here; the copies on a real API server, two namespaces
standing in for two sites; real brokers started from what the operator renders."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID
from test_operator_federation import REMOTE, container, create, downstream, flags, spec

from twinmq.broker.federation.config import load
from twinmq.broker.settings import parse_args
from twinmq.operator import certs, federation, federationtls
from twinmq.operator.builders import (
    ClusterRef,
    build_federation_config_map,
    build_pod,
    pod_revision,
)
from twinmq.operator.kube import Kube, Refused
from twinmq.operator.models import GROUP, KIND, VERSION, BrokerClusterSpec

NOW = datetime(2026, 11, 28, tzinfo=UTC)
CENTRAL = ClusterRef(name="central", namespace="site-a", uid="u-1")


def copied(upstream: str = "central") -> federationtls.Trust:
    """The answer of a pass that copied central's CA."""
    return federationtls.Trust(
        links=(
            federationtls.LinkTrust(upstream, True, "PeerCACopied", "m", "PEM", "site-a/central"),
        )
    )


def rendered_upstream(wanted: BrokerClusterSpec, tmp: Path) -> Any:
    config_map = build_federation_config_map(REMOTE, wanted)
    assert config_map is not None
    path = tmp / "federation.yaml"
    path.write_text(config_map["data"]["federation.yaml"])
    return load(path).upstreams["central"]  # what the broker reads at start-up


# -- the downstream --------------------------------------------------------------------------


def test_a_cluster_ref_upstream_is_dialled_on_amqps_with_the_copied_ca_and_an_issued_certificate(
    tmp_path: Path,
) -> None:
    raw = spec(downstream())
    # No copy yet: the spec as written dials the plain port.
    assert rendered_upstream(raw, tmp_path).uri.startswith("amqp://")
    assert federationtls.client_certificate_wanted(raw, REMOTE.name)
    wanted = federationtls.effective(REMOTE, raw, copied())
    central = rendered_upstream(wanted, tmp_path)
    assert central.uri == "amqps://twinmq-federation@central.site-a.svc:5671/"
    folder = Path(federation.TLS_DIR, "central")
    assert (central.tls_ca, central.tls_cert, central.tls_key) == (
        folder / "ca.crt", folder / "tls.crt", folder / "tls.key"
    )  # fmt: skip
    pod = build_pod(REMOTE, wanted, "primary")
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    ca, client = volumes[federation.TLS_VOLUME]["projected"]["sources"]
    assert ca["configMap"] == {
        "name": "remote-federation-peer-ca",
        "items": [{"key": "central.crt", "path": "central/ca.crt"}],
    }
    assert client["secret"]["name"] == "remote-federation-tls"
    assert pod_revision(pod) != pod_revision(build_pod(REMOTE, raw, "primary"))  # they roll
    built = federationtls.build_config_maps(REMOTE, copied())
    assert [(c["metadata"]["name"], c["data"]) for c in built] == [
        ("remote-federation-peer-ca", {"central.crt": "PEM"})
    ]
    assert built[0]["metadata"]["ownerReferences"][0]["uid"] == "u-2"


def test_turned_off_or_given_by_hand_the_operator_copies_nothing() -> None:
    off = downstream()
    off["upstreams"][0]["tls"] = {"enabled": False}
    assert not federationtls.automatic(spec(off).federation.upstreams[0])  # type: ignore[union-attr]
    assert not federationtls.client_certificate_wanted(spec(off), REMOTE.name)
    assert federationtls.effective(REMOTE, spec(off), copied()) == spec(off)
    config_map = build_federation_config_map(REMOTE, spec(off))
    assert config_map is not None and "amqp://" in config_map["data"]["federation.yaml"]
    given = downstream()
    given["upstreams"][0]["tls"] = {"caConfigMap": "central-ca", "clientSecret": "mine"}
    assert federationtls.effective(REMOTE, spec(given), copied()) == spec(given)
    # A CA given by hand: nothing copied nor issued (a clientSecret of yours, if needed).
    ca_only = downstream()
    ca_only["upstreams"][0]["tls"] = {"caConfigMap": "central-ca"}
    assert not federationtls.client_certificate_wanted(spec(ca_only), REMOTE.name)
    # A cluster without a CA of its own (its own Secret, or TLS off) has no client
    # certificate to present: amqps all the same, verified against the copied CA.
    own_secret = BrokerClusterSpec.model_validate(
        {"federation": downstream(), "tls": {"secretName": "mine"}}
    )
    assert not federationtls.client_certificate_wanted(own_secret, REMOTE.name)
    mounted = federationtls.effective(REMOTE, own_secret, copied())
    tls = mounted.federation.upstreams[0].tls  # type: ignore[union-attr]
    assert tls is not None and tls.client_secret is None
    assert tls.ca_config_map == "remote-federation-peer-ca"


def test_the_condition_says_which_links_are_plaintext_and_why() -> None:
    unknown = federationtls.Trust(links=(federationtls.LinkTrust(
        "central", False, "PeerCAUnknown", "central: plaintext until ..."),))  # fmt: skip
    found = federationtls.condition(unknown)
    assert found is not None and found[:3] == ("FederationTls", False, "PeerCAUnknown")
    assert federationtls.condition(copied())[:3] == ("FederationTls", True, "LinksTls")  # type: ignore[index]
    upstream_only = federationtls.Trust(downstream=federationtls.DownstreamTrust("d"))
    assert federationtls.condition(upstream_only)[:3] == ("FederationTls", True, "UpstreamOnly")  # type: ignore[index]
    assert federationtls.condition(None) is None


def test_an_event_when_a_copy_is_made_and_when_a_ca_changes() -> None:
    ((_, made, _),) = federationtls.events(REMOTE, copied(), {}, None)
    ((_, updated, text),) = federationtls.events(REMOTE, copied(), {"central.crt": "OLD"}, None)
    assert (made, updated) == ("FederationPeerCACopied", "FederationPeerCAUpdated")
    assert "rotation" in text
    assert federationtls.events(REMOTE, copied(), {"central.crt": "PEM"}, None) == []
    down = federationtls.Trust(downstream=federationtls.DownstreamTrust("m", "CAS", ("b/r",), "x"))
    assert [e[1] for e in federationtls.events(CENTRAL, down, {}, None)] == [
        "FederationDownstreamCAs"
    ]
    assert federationtls.events(CENTRAL, down, {}, "CAS") == []


def test_the_operator_issues_the_client_certificate_with_its_own_ca() -> None:
    memory = certs.TlsMemory()
    applied: dict[str, dict[str, Any]] = {}

    class NoSecrets:
        def get_secret_data(
            self, namespace: str, name: str, owner: object = None
        ) -> dict[str, str] | None:
            return None

    # Given the spec the pods are built from (`effective`, as `operator/main.py` does),
    # which names the Secret: found in e2e, where the pods waited for a Secret never made.
    mounted = federationtls.effective(REMOTE, spec(downstream()), copied())
    assert federationtls.client_certificate_wanted(mounted, REMOTE.name)
    certs.reconcile_tls(REMOTE, mounted, memory, NoSecrets(),
                        lambda o: applied.__setitem__(o["metadata"]["name"], o), now=NOW,
                        seconds=3600)  # fmt: skip
    secret = applied["remote-federation-tls"]
    assert memory.federation is not None and memory.federation.pair is not None
    cert = memory.federation.pair.certificate()
    assert memory.ca is not None
    cert.verify_directly_issued_by(memory.ca.certificate())
    assert certs.common_name(cert) == "site-b/remote"
    usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert ExtendedKeyUsageOID.CLIENT_AUTH in set(usages)
    assert secret["type"] == "kubernetes.io/tls"
    # Not federated from a clusterRef: none.
    applied.clear()
    certs.reconcile_tls(CENTRAL, spec({}), certs.TlsMemory(), NoSecrets(),
                        lambda o: applied.__setitem__(o["metadata"]["name"], o), now=NOW,
                        seconds=3600)  # fmt: skip
    assert "central-federation-tls" not in applied


# -- the upstream ----------------------------------------------------------------------------


def test_an_upstream_with_downstreams_cas_asks_for_optional_client_certificates() -> None:
    trust = federationtls.Trust(downstream=federationtls.DownstreamTrust(
        "m", "CAS", ("site-b/remote",), "central-federation-downstream-ca"))  # fmt: skip
    raw = spec({})
    assert federation.broker_args(raw.federation, "site-a", "central")[2:] == []
    wanted = federationtls.effective(CENTRAL, raw, trust)
    pod = build_pod(CENTRAL, wanted, "primary")
    args = flags(pod)
    assert args["tls-ca"] == f"{federation.DOWNSTREAM_CA_DIR}/ca.crt"
    assert args["tls-client-certs"] == "optional"
    # What the broker makes of its flags: client certificates optional, verified.
    settings = parse_args([a for a in container(pod)["args"]
                           if a.split("=")[0] in ("--tls-ca", "--tls-client-certs",
                                                  "--tls-cert", "--tls-key")])  # fmt: skip
    assert settings.effective_tls_client_certs == "optional"
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes[federation.DOWNSTREAM_CA_VOLUME]["configMap"]["name"] == (
        "central-federation-downstream-ca"
    )
    mounts = {m["name"]: m["mountPath"] for m in container(pod)["volumeMounts"]}
    assert mounts[federation.DOWNSTREAM_CA_VOLUME] == federation.DOWNSTREAM_CA_DIR
    # Without AMQPS there is nothing to ask on: no flags (the broker would refuse them).
    plain = BrokerClusterSpec.model_validate({"federation": {}, "tls": {"enabled": False}})
    assert "tls-ca" not in flags(
        build_pod(CENTRAL, federationtls.effective(CENTRAL, plain, trust), "primary")
    )
    (built,) = federationtls.build_config_maps(CENTRAL, trust)
    assert built["data"] == {"ca.crt": "CAS"}


class Scoped:
    """A namespace-scoped operator's reads: BrokerClusters of its own namespace only
    (a cluster-wide list is refused), and `failing` whatever it lists."""

    def __init__(self, items: list[dict[str, Any]], failing: bool = False) -> None:
        self.items, self.failing = items, failing

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> Any:
        # As the downstream's operator publishes it: owned by that BrokerCluster.
        owner = {"uid": f"uid of {namespace}/{name.removesuffix('-ca')}"}
        return {"metadata": {"ownerReferences": [owner]},
                "data": {"ca.crt": f"CA of {namespace}/{name}\n"}}  # fmt: skip

    def list(self, api_version: str, kind: str, namespace: str, selector: str) -> Any:
        if self.failing or namespace == "":
            raise PermissionError("HTTP 403")
        return [i for i in self.items if i["metadata"]["namespace"] == namespace]


def test_the_downstreams_are_found_in_the_own_namespace_when_listing_all_is_refused() -> None:
    near = downstream()
    near["upstreams"][0]["clusterRef"] = {"name": "central"}
    items = [{"metadata": {"namespace": "site-a", "name": "near", "uid": "uid of site-a/near"},
              "spec": {"federation": near}}]  # fmt: skip
    found = federationtls.resolve_downstreams(CENTRAL, spec({}), Scoped(items), {})
    assert found is not None and found.downstreams == ("site-a/near",)
    assert found.bundle == "CA of site-a/near-ca\n"
    # Nothing can be listed: the last copy is kept (its brokers do not roll back).
    kept = federationtls.resolve_downstreams(CENTRAL, spec({}), Scoped(items, True),
                                             {"ca.crt": "LAST"})  # fmt: skip
    assert kept is not None and kept.bundle == "LAST" and "cannot list" in kept.message
    none = federationtls.resolve_downstreams(CENTRAL, spec({}), Scoped(items, True), {})
    assert none is not None and none.bundle is None


# -- a real API server -----------------------------------------------------------------------


def site(api: Kube, namespace: str, name: str, raw: dict[str, Any]) -> ClusterRef:
    """A namespace with a BrokerCluster whose certificates are issued (its CA published),
    as its operator does."""
    api.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    made = api.apply({"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND,
                      "metadata": {"name": name, "namespace": namespace}, "spec": raw})  # fmt: skip
    ref = ClusterRef(name, namespace, made["metadata"]["uid"])
    certs.reconcile_tls(ref, BrokerClusterSpec.model_validate(raw), certs.TlsMemory(), api,
                        api.apply, now=NOW, seconds=3600)  # fmt: skip
    return ref


class Operator:
    """One cluster's operator pass, as `operator/main.py` runs it."""

    def __init__(self, api: Kube, ref: ClusterRef, raw: dict[str, Any]) -> None:
        self.api, self.ref, self.raw = api, ref, raw
        self.memory = federationtls.FederationTlsMemory()
        self.events: list[tuple[str, str, str]] = []

    def reconcile(self, clock: float) -> federationtls.Trust:
        spec = BrokerClusterSpec.model_validate(self.raw)
        trust = federationtls.reconcile(self.ref, spec, self.memory, self.api, clock,
                                        lambda *e: self.events.append(e))  # fmt: skip
        assert trust is not None
        for copy in federationtls.build_config_maps(self.ref, trust):
            self.api.apply(copy)
        return trust


def data(api: Kube, namespace: str, name: str) -> dict[str, str]:
    found = api.get("v1", "ConfigMap", namespace, name)
    return dict((found or {}).get("data") or {})


def test_a_downstream_copies_its_upstreams_ca_and_the_upstream_trusts_the_downstreams(
    api: Kube,
) -> None:
    central_raw: dict[str, Any] = {"federation": {}}
    fed = downstream()
    fed["upstreams"][0]["clusterRef"] = {"name": "central", "namespace": "fca-a"}
    remote_raw = {"federation": fed}
    central = site(api, "fca-a", "central", central_raw)
    remote = site(api, "fca-b", "remote", remote_raw)
    # Another downstream, in the upstream's own namespace (a clusterRef without namespace).
    near_fed = downstream()
    near_fed["upstreams"][0]["clusterRef"] = {"name": "central"}
    near = site(api, "fca-a", "near", {"federation": near_fed})
    # One that turned TLS off is not trusted.
    off_fed = downstream()
    off_fed["upstreams"][0]["clusterRef"] = {"name": "central", "namespace": "fca-a"}
    off_fed["upstreams"][0]["tls"] = {"enabled": False}
    site(api, "fca-c", "off", {"federation": off_fed})

    at_remote = Operator(api, remote, remote_raw)
    trust = at_remote.reconcile(0.0)
    (link,) = trust.links
    assert link.tls and link.reason == "PeerCACopied", link.message
    central_ca = data(api, "fca-a", "central-ca")["ca.crt"]
    assert data(api, "fca-b", "remote-federation-peer-ca") == {"central.crt": central_ca}
    assert [e[1] for e in at_remote.events] == ["FederationPeerCACopied"]
    assert federationtls.condition(trust)[1] is True  # type: ignore[index]

    at_central = Operator(api, central, central_raw)
    down = at_central.reconcile(0.0).downstream
    assert down is not None and down.downstreams == ("fca-a/near", "fca-b/remote"), down
    bundle = data(api, "fca-a", "central-federation-downstream-ca")["ca.crt"]
    # Every trusted downstream's client certificate verifies against the copied bundle.
    roots = x509.load_pem_x509_certificates(bundle.encode())
    assert len(roots) == 2
    for ref in (remote, near):
        secret = api.get_secret_data(ref.namespace, f"{ref.name}-federation-tls")
        assert secret is not None
        leaf = x509.load_pem_x509_certificate(secret["tls.crt"].encode())
        issuers = [r for r in roots if r.subject == leaf.issuer]
        assert len(issuers) == 1
        leaf.verify_directly_issued_by(issuers[0])
    assert [e[1] for e in at_central.events] == ["FederationDownstreamCAs"]
    mounted = federationtls.effective(central, BrokerClusterSpec.model_validate(central_raw),
                                      at_central.memory.trust)  # fmt: skip
    assert mounted.federation is not None
    assert mounted.federation.downstream_ca_config_map == "central-federation-downstream-ca"

    # Nothing new: no Event; a restarted operator finds its copies current.
    at_remote.reconcile(1.0 + federationtls.READ_EVERY)
    assert len(at_remote.events) == 1
    again = Operator(api, central, central_raw)
    again.reconcile(100.0)
    assert again.events == []

    # The upstream goes away: the downstream keeps its last copy (no roll back to plaintext).
    api.delete(f"{GROUP}/{VERSION}", KIND, "fca-a", "central")
    kept = Operator(api, remote, remote_raw).reconcile(200.0)
    assert kept.links[0].tls and "last copy" in kept.links[0].message


def test_an_upstream_with_tls_off_leaves_the_link_plaintext_and_says_so(api: Kube) -> None:
    site(api, "fcb-a", "central", {"federation": {}, "tls": {"enabled": False}})
    fed = downstream()
    fed["upstreams"][0]["clusterRef"] = {"name": "central", "namespace": "fcb-a"}
    remote = site(api, "fcb-b", "remote", {"federation": fed})
    (link,) = Operator(api, remote, {"federation": fed}).reconcile(0.0).links
    assert not link.tls and link.reason == "PeerCAUnknown"
    assert "serves no AMQPS" in link.message
    assert data(api, "fcb-b", "remote-federation-peer-ca") == {}
    # No such BrokerCluster: said.
    fed["upstreams"][0]["clusterRef"] = {"name": "nothing", "namespace": "fcb-a"}
    (lost,) = Operator(api, remote, {"federation": fed}).reconcile(0.0).links
    assert not lost.tls and "no BrokerCluster fcb-a/nothing" in lost.message


def test_the_crd_takes_tls_turned_off_and_refuses_a_uri_without_its_ca(api: Kube) -> None:
    off = downstream()
    off["upstreams"][0]["tls"] = {"enabled": False}
    create(api, "fed-tls-off", off)
    fed = {"upstreams": [{"name": "c", "uri": "amqps://u@h/", "passwordSecret": {"name": "s"},
                          "tls": {"serverName": "h"}}]}  # fmt: skip
    with pytest.raises(Refused) as refused:
        create(api, "fed-uri-no-ca", fed)
    assert "needs tls.caConfigMap" in str(refused.value)
