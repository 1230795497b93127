"""`kubectl twinmq federation trust` (issue 15): TLS between a downstream BrokerCluster and
its upstream in another Kubernetes cluster, where the operator cannot copy the CAs itself.
On a real API server, two namespaces and two kubeconfig contexts standing in for the two
Kubernetes clusters (as `mirror trust` is tested), and what the operator then makes of
the specs the command wrote (`operator/federationtls.py`)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

from test_operator_mirror_peer_ca import NOW, site

from twinmq.cli.kubectl import (
    downstream_trust_config_map,
    federation_trust_config_map,
    pem_certificates,
    run,
)
from twinmq.operator import certs, federationtls
from twinmq.operator.builders import ClusterRef, owned_meta
from twinmq.operator.kube import Kube
from twinmq.operator.models import GROUP, KIND, VERSION, BrokerClusterSpec

HERE, THERE = "ftrust-a", "ftrust-b"


def published_ca(api: Kube, ref: ClusterRef) -> str:
    found = api.get("v1", "ConfigMap", ref.namespace, f"{ref.name}-ca")
    assert found is not None
    return str(found["data"]["ca.crt"])


def cluster_spec(api: Kube, ref: ClusterRef) -> dict[str, Any]:
    found = api.get(f"{GROUP}/{VERSION}", KIND, ref.namespace, ref.name)
    assert found is not None
    return dict(found["spec"])


def two_contexts(kubeconfig: Path, folder: Path) -> Path:
    """The admin kubeconfig with a context per Kubernetes cluster (one API server)."""
    config = json.loads(kubeconfig.read_text())
    base = config["contexts"][0]["context"]
    config["contexts"] = [
        {"name": "here", "context": {**base, "namespace": HERE}},
        {"name": "there", "context": {**base, "namespace": THERE}},
    ]
    config["current-context"] = "here"
    path = folder / "kubeconfig"
    path.write_text(json.dumps(config))
    return path


def downstream(uri: str = "amqps://fed@central.example.com:5671/", **more: Any) -> dict[str, Any]:
    upstreams = [{"name": "central", "uri": uri, "passwordSecret": {"name": "central-login"}}]
    upstreams += more.get("upstreams", [])
    exchanges = [{"exchange": "market", "upstream": "central"}]
    return {"federation": {"upstreams": upstreams, "exchanges": exchanges}}


class Unreadable:
    """A reader that may read nothing (the other Kubernetes cluster)."""

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> Any:
        raise PermissionError(name)

    def list(self, api_version: str, kind: str, namespace: str, selector: str) -> Any:
        raise PermissionError(kind)


def trust(kubeconfig: Path, cluster: str, *more: str, code: int = 0) -> tuple[str, str]:
    out, err = io.StringIO(), io.StringIO()
    argv = ["federation", "trust", cluster, "--kubeconfig", str(kubeconfig),
            "--from-context", "there", "--from-cluster", "central", *more]  # fmt: skip
    assert run(argv, out, err) == code, err.getvalue()
    return out.getvalue(), err.getvalue()


def test_federation_trust_copies_each_sides_ca_to_the_other_and_keeps_the_trusted_ones(
    api: Kube, kube_apiserver: Any, tmp_path: Path
) -> None:
    kubeconfig = two_contexts(kube_apiserver.kubeconfig, tmp_path)
    central = site(api, THERE, "central", {"federation": {}})
    orders = site(api, HERE, "orders", downstream())
    # A downstream in central's own Kubernetes cluster, trusted by the operator's copy:
    # it must stay trusted once downstreamCaConfigMap replaces the copy.
    local_ca = certs.new_ca(ClusterRef("branch", THERE, "u-branch"), NOW).cert
    api.apply({"apiVersion": "v1", "kind": "ConfigMap",  # as central's operator copies it
               "metadata": owned_meta(central, "central-federation-downstream-ca"),
               "data": {"ca.crt": local_ca}})  # fmt: skip

    said, _ = trust(kubeconfig, "orders")
    copy_name, bundle_name = (
        federation_trust_config_map("orders"),
        downstream_trust_config_map("central"),
    )
    assert f"configmap/{copy_name} created in {HERE}" in said
    assert "spec.federation.upstreams[central].tls set" in said
    assert f"configmap/{bundle_name} created in {THERE}" in said and "1 CAs kept" in said
    assert f"downstreamCaConfigMap set to {bundle_name}" in said
    # The downstream: the upstream's CA copied, its upstream entry over TLS with it and a
    # client certificate of its own CA.
    copy = api.get("v1", "ConfigMap", HERE, copy_name)
    assert copy is not None and copy["data"] == {"central.crt": published_ca(api, central)}
    spec = BrokerClusterSpec.model_validate(cluster_spec(api, orders))
    assert spec.federation is not None
    (upstream,) = spec.federation.upstreams
    assert upstream.tls is not None
    assert (upstream.tls.ca_config_map, upstream.tls.ca_key, upstream.tls.client_secret) == (
        copy_name, "central.crt", "orders-federation-tls",
    )  # fmt: skip
    link = federationtls.resolve_link(orders, upstream, Unreadable(), {})
    assert link.tls and link.reason == "CAConfigMap"
    assert federationtls.client_certificate_wanted(spec, "orders")
    # The upstream: the downstream's CA added to what it trusted, named by its spec.
    bundle = api.get("v1", "ConfigMap", THERE, bundle_name)
    assert bundle is not None
    assert pem_certificates(bundle["data"]["ca.crt"]) == [
        *pem_certificates(local_ca), *pem_certificates(published_ca(api, orders)),
    ]  # fmt: skip
    upstream_spec = BrokerClusterSpec.model_validate(cluster_spec(api, central))
    down = federationtls.resolve_downstreams(central, upstream_spec, Unreadable(), {})
    assert down is not None and down.config_map == bundle_name

    # Idempotent.
    again, _ = trust(kubeconfig, "orders")
    assert f"configmap/{copy_name} unchanged" in again
    assert f"configmap/{bundle_name} unchanged" in again
    assert "already names" in again and f"downstreamCaConfigMap already {bundle_name}" in again

    # A second downstream: added to the bundle, the first one kept.
    shop = site(api, HERE, "shop", downstream())
    trust(kubeconfig, "shop")
    bundle = api.get("v1", "ConfigMap", THERE, bundle_name)
    assert bundle is not None
    assert pem_certificates(bundle["data"]["ca.crt"]) == [
        *pem_certificates(local_ca), *pem_certificates(published_ca(api, orders)),
        *pem_certificates(published_ca(api, shop)),
    ]  # fmt: skip

    # The upstream's CA rotated: the copy follows.
    rotated = certs.new_ca(central, NOW).cert
    api.apply(certs.build_ca_config_map(central, rotated))  # as the operator publishes it
    assert f"configmap/{copy_name} updated" in trust(kubeconfig, "orders")[0]
    copy = api.get("v1", "ConfigMap", HERE, copy_name)
    assert copy is not None and copy["data"]["central.crt"] == rotated


def test_federation_trust_refuses_a_plain_uri_and_an_ambiguous_upstream_before_writing(
    api: Kube, kube_apiserver: Any, tmp_path: Path
) -> None:
    kubeconfig = two_contexts(kube_apiserver.kubeconfig, tmp_path)
    site(api, THERE, "central", {"federation": {}})
    site(api, HERE, "plain", downstream("amqp://fed@central.example.com:5672/"))
    _, err = trust(kubeconfig, "plain", code=1)
    assert "give it an amqps:// uri" in err
    assert api.get("v1", "ConfigMap", HERE, federation_trust_config_map("plain")) is None
    other = {"name": "eu", "uri": "amqps://fed@eu.example.com:5671/",
             "passwordSecret": {"name": "eu-login"}}  # fmt: skip
    site(api, HERE, "two", downstream(upstreams=[other]))
    _, err = trust(kubeconfig, "two", "--upstream", "us", code=1)
    assert "no upstream named us" in err and "central, eu" in err
    # Without --upstream, the entry named as the upstream BrokerCluster.
    said, _ = trust(kubeconfig, "two")
    assert "upstreams[central].tls set" in said
    site(api, HERE, "bare", {})
    _, err = trust(kubeconfig, "bare", code=1)
    assert "has no spec.federation.upstreams" in err


def planted_config_map(api: Kube, namespace: str, name: str) -> str:
    """A CA of someone else's (they hold its key) in a ConfigMap they made, no owner."""
    evil = certs.new_ca(ClusterRef("mallory", namespace, "u-mallory"), NOW).cert
    api.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    api.ensure({"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": name, "namespace": namespace},
                "data": {"ca.crt": evil}})  # fmt: skip
    return evil


def bare_cluster(api: Kube, namespace: str, name: str, spec: dict[str, Any]) -> None:
    """A BrokerCluster whose operator has not published anything yet."""
    api.apply({"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND,
               "metadata": {"name": name, "namespace": namespace}, "spec": spec})  # fmt: skip


def test_federation_trust_copies_no_ca_from_a_config_map_its_cluster_does_not_own(
    api: Kube, kube_apiserver: Any, tmp_path: Path
) -> None:
    """Each ConfigMap under a name the operator generates that the command reads: the
    upstream's `<up>-ca` (the downstream would trust it), the downstream's own `<down>-ca`
    (the upstream would accept client certificates of it), the upstream's copy of its
    downstreams' CAs (kept in the bundle it trusts). Made by someone else, each is refused
    before anything is written."""
    kubeconfig = two_contexts(kube_apiserver.kubeconfig, tmp_path)
    # The upstream's CA, planted before the upstream BrokerCluster.
    planted_config_map(api, THERE, "fakeup-ca")
    bare_cluster(api, THERE, "fakeup", {"federation": {}})
    site(api, HERE, "down1", downstream())
    _, err = trust(kubeconfig, "down1", "--from-cluster", "fakeup", code=1)
    assert (f"ConfigMap {THERE}/fakeup-ca (context there) is not BrokerCluster "
            f"{THERE}/fakeup's (no owner reference to it)") in err  # fmt: skip
    # The downstream's own CA, planted before the downstream.
    planted_config_map(api, HERE, "fakedown-ca")
    bare_cluster(api, HERE, "fakedown", downstream())
    site(api, THERE, "realup", {"federation": {}})
    _, err = trust(kubeconfig, "fakedown", "--from-cluster", "realup", code=1)
    assert f"ConfigMap {HERE}/fakedown-ca is not BrokerCluster {HERE}/fakedown's" in err
    # The upstream operator's copy of its downstreams' CAs, planted before the upstream.
    planted_config_map(api, THERE, "copyup-federation-downstream-ca")
    site(api, THERE, "copyup", {"federation": {}})
    site(api, HERE, "down3", downstream())
    _, err = trust(kubeconfig, "down3", "--from-cluster", "copyup", code=1)
    assert (f"ConfigMap {THERE}/copyup-federation-downstream-ca (context there) is not "
            f"BrokerCluster {THERE}/copyup's") in err  # fmt: skip

    for here, up in (("down1", "fakeup"), ("fakedown", "realup"), ("down3", "copyup")):
        assert api.get("v1", "ConfigMap", HERE, federation_trust_config_map(here)) is None
        assert api.get("v1", "ConfigMap", THERE, downstream_trust_config_map(up)) is None
        upstream = BrokerClusterSpec.model_validate(cluster_spec(api, ClusterRef(up, THERE, "")))
        assert upstream.federation is not None
        assert upstream.federation.downstream_ca_config_map is None
        spec = BrokerClusterSpec.model_validate(cluster_spec(api, ClusterRef(here, HERE, "")))
        assert spec.federation is not None and spec.federation.upstreams[0].tls is None
