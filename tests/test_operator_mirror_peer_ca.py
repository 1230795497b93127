"""Mutual TLS on the DR mirror by default (issues 14 and 16): the operator learns the other
site's CA when the target is a BrokerCluster it can read (`operator/peerca.py`), keeps the
copy current, says why a link stays plaintext; `kubectl twinmq mirror trust` copies it when
the operator cannot (another Kubernetes cluster). Builders and rules here; the copy, its
update and the plugin on a real API server, two namespaces standing in for two sites."""

from __future__ import annotations

import io
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from test_operator_mirroring import env_of, settings_from

from twinmq.cli.kubectl import run, trust_config_map
from twinmq.operator import certs, mirroring, peerca
from twinmq.operator.builders import ClusterRef, build_pod
from twinmq.operator.kube import Kube
from twinmq.operator.models import GROUP, KIND, VERSION, BrokerClusterSpec, Condition
from twinmq.testing.waiting import wait_for

NOW = datetime(2026, 11, 28, tzinfo=UTC)


def mirror_spec(role: str, target: str | None, **tls: Any) -> dict[str, Any]:
    mirror: dict[str, Any] = {"role": role, "secretName": "orders-dr"}
    if target is not None:
        mirror["target"] = {"host": target}
    if tls:
        mirror["tls"] = tls
    return {"mirror": mirror}


def spec_of(raw: dict[str, Any]) -> BrokerClusterSpec:
    return BrokerClusterSpec.model_validate(raw)


# -- rules -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("host", "found"),
    [
        ("orders.site-b.svc", ("site-b", "orders")),
        ("orders.site-b.svc.cluster.local", ("site-b", "orders")),
        ("Orders.Site-B.svc.cluster.local.", ("site-b", "orders")),
        ("orders.site-b", None),  # could be another cluster's DNS: not guessed
        ("10.0.0.7", None),
        ("dr.example.com", None),
        ("orders.site-b.svc.example.com", None),
    ],
)
def test_only_a_services_cluster_dns_name_names_a_brokercluster_here(
    host: str, found: tuple[str, str] | None
) -> None:
    assert peerca.service_of(host) == found


def test_the_operators_copy_makes_the_pods_run_the_link_over_mutual_tls() -> None:
    site = ClusterRef("orders", "site-a", "u-a")
    spec = spec_of(mirror_spec("source", "orders.site-b.svc"))
    assert not mirroring.tls_on(spec)
    trust = peerca.Trust(True, "PeerCACopied", "m", "orders-mirror-peer-ca", "PEM", "site-b/orders")
    mounted = peerca.effective(spec, trust)
    assert mirroring.tls_on(mounted)
    pod = build_pod(site, mounted, "primary")
    assert settings_from(env_of(pod)).mirror_tls_ca == Path(f"{mirroring.CA_DIR}/ca.crt")
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "mirror-ca"]
    assert volume["configMap"]["name"] == "orders-mirror-peer-ca"
    built = peerca.build_config_map(site, trust)
    assert built is not None and built["data"] == {"ca.crt": "PEM"}
    assert built["metadata"]["ownerReferences"][0]["uid"] == "u-a"
    # Nothing copied: the spec as written (plaintext, no ConfigMap).
    unknown = peerca.Trust(False, "PeerCAUnknown", "m")
    assert peerca.effective(spec, unknown) == spec
    assert peerca.build_config_map(site, unknown) is None


def test_an_explicit_ca_config_map_wins_over_the_copy() -> None:
    spec = spec_of(mirror_spec("source", "orders.site-b.svc", caConfigMap="mine"))
    trust = peerca.resolve(ClusterRef("orders", "site-a", "u"), spec, Unreadable())
    assert trust is not None and trust.reason == "CAConfigMap" and trust.tls
    assert peerca.effective(spec, trust).mirror.tls.ca_config_map == "mine"  # type: ignore[union-attr]


class Unreadable:
    """An API server that answers nothing (never reached when the spec decides)."""

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any]:
        raise AssertionError(f"read {kind} {namespace}/{name}")


@pytest.mark.parametrize(
    ("raw", "reason", "says"),
    [
        ({**mirror_spec("source", "orders.b.svc"), "tls": {"enabled": False}},
         "NoSiteCertificate", "spec.tls is off"),
        (mirror_spec("source", "orders.b.svc", enabled=False), "Disabled", "enabled is false"),
        (mirror_spec("source", "10.1.2.3"), "PeerCAUnknown", "kubectl twinmq mirror trust"),
        (mirror_spec("replica", None), "PeerCAUnknown", "names no target"),
    ],
)  # fmt: skip
def test_a_plaintext_link_says_why_and_how_to_fix_it(
    raw: dict[str, Any], reason: str, says: str
) -> None:
    trust = peerca.resolve(ClusterRef("orders", "a", "u"), spec_of(raw), Unreadable())
    assert trust is not None and not trust.tls and trust.reason == reason
    assert says in trust.message
    assert peerca.condition(trust) == ("MirrorTls", False, reason, trust.message)
    # What the status carries (a condition type the status model knows).
    found = Condition(type="MirrorTls", status="False", reason=reason, message=trust.message,
                      last_transition_time="2026-11-28T00:00:00Z")  # fmt: skip
    assert found.type == "MirrorTls"
    assert peerca.resolve(ClusterRef("orders", "a", "u"), spec_of({}), Unreadable()) is None


def test_an_event_when_the_copy_is_made_and_when_the_other_ca_changes() -> None:
    trust = peerca.Trust(True, "PeerCACopied", "m", "x-mirror-peer-ca", "NEW", "b/orders")
    ((_, copied, _),) = peerca.events(None, trust)
    ((_, updated, text),) = peerca.events("OLD", trust)
    assert (copied, updated) == ("MirrorPeerCACopied", "MirrorPeerCAUpdated")
    assert "rotation" in text
    assert peerca.events("NEW", trust) == []


# -- a real API server: the copy, its update ------------------------------------------------


def site(api: Kube, namespace: str, name: str, raw: dict[str, Any]) -> ClusterRef:
    """A namespace with a BrokerCluster whose CA is published, as its operator does."""
    api.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    made = api.apply({"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND,
                      "metadata": {"name": name, "namespace": namespace}, "spec": raw})  # fmt: skip
    ref = ClusterRef(name, namespace, made["metadata"]["uid"])
    certs.reconcile_tls(ref, spec_of(raw), certs.TlsMemory(), api, api.apply, now=NOW,
                        seconds=3600)  # fmt: skip
    return ref


def published_ca(api: Kube, ref: ClusterRef) -> str:
    found = api.get("v1", "ConfigMap", ref.namespace, f"{ref.name}-ca")
    assert found is not None
    return str(found["data"]["ca.crt"])


class Operator:
    """One site's operator pass, as `operator/main.py` runs it: the answer, the copy
    applied, the Events posted."""

    def __init__(self, api: Kube, ref: ClusterRef, raw: dict[str, Any]) -> None:
        self.api, self.ref, self.raw = api, ref, raw
        self.memory = peerca.PeerCaMemory()
        self.events: list[tuple[str, str, str]] = []

    def reconcile(self, clock: float) -> peerca.Trust:
        trust = peerca.reconcile(self.ref, spec_of(self.raw), self.memory, self.api, clock,
                                 lambda *e: self.events.append(e))  # fmt: skip
        assert trust is not None
        if (copy := peerca.build_config_map(self.ref, trust)) is not None:
            self.api.apply(copy)
        return trust


def test_two_sites_naming_each_other_copy_each_others_ca_and_follow_its_rotation(
    api: Kube,
) -> None:
    a_raw = mirror_spec("source", "orders.pca-b.svc")
    b_raw = mirror_spec("replica", "orders.pca-a.svc.cluster.local")
    a, b = site(api, "pca-a", "orders", a_raw), site(api, "pca-b", "orders", b_raw)
    at_a, at_b = Operator(api, a, a_raw), Operator(api, b, b_raw)
    for here, there, operator in ((a, b, at_a), (b, a, at_b)):
        trust = operator.reconcile(0.0)
        assert trust.tls and trust.reason == "PeerCACopied", trust.message
        copy = api.get("v1", "ConfigMap", here.namespace, f"{here.name}-mirror-peer-ca")
        assert copy is not None and copy["data"]["ca.crt"] == published_ca(api, there)
        assert [e[1] for e in operator.events] == ["MirrorPeerCACopied"]
    assert published_ca(api, a) != published_ca(api, b)  # a CA each, each trusts the other
    # Nothing new to copy: no Event, no read before READ_EVERY.
    at_a.reconcile(1.0)
    assert len(at_a.events) == 1

    # B's CA is rotated (its operator publishes the new one): A's copy follows.
    rotated = certs.new_ca(b, NOW).cert
    api.apply(certs.build_ca_config_map(b, rotated))
    at_a.reconcile(2.0)
    assert len(at_a.events) == 1  # not read again yet
    at_a.reconcile(2.0 + peerca.READ_EVERY)
    assert at_a.events[-1][1] == "MirrorPeerCAUpdated"
    copy = api.get("v1", "ConfigMap", "pca-a", "orders-mirror-peer-ca")
    assert copy is not None and copy["data"]["ca.crt"] == rotated

    # A restarted operator finds its copy current: no Event.
    again = Operator(api, a, a_raw)
    assert again.reconcile(100.0).tls and again.events == []

    # B goes away: A keeps its last copy (its pods do not roll back to plaintext).
    api.delete(f"{GROUP}/{VERSION}", KIND, "pca-b", "orders")
    kept = again.reconcile(200.0)
    assert kept.tls and kept.reason == "PeerCACopied" and "last copy" in kept.message


def test_a_site_whose_target_does_not_name_it_back_stays_plaintext_and_says_so(
    api: Kube,
) -> None:
    # A replica naming no target cannot learn the source's CA: the source must not
    # require TLS the replica cannot speak (the link would never come up).
    r_raw = mirror_spec("replica", None)
    s_raw = mirror_spec("source", "orders.pcb-r.svc")
    site(api, "pcb-r", "orders", r_raw)
    source = site(api, "pcb-s", "orders", s_raw)
    trust = Operator(api, source, s_raw).reconcile(0.0)
    assert not trust.tls and trust.reason == "PeerCAUnknown"
    assert "does not name this site" in trust.message
    assert api.get("v1", "ConfigMap", "pcb-s", "orders-mirror-peer-ca") is None
    # No such BrokerCluster: said, with the fix.
    lost_raw = mirror_spec("source", "nothing.pcb-r.svc")
    lost = Operator(api, source, lost_raw).reconcile(0.0)
    assert not lost.tls and "no BrokerCluster pcb-r/nothing" in lost.message
    assert "mirror trust" in lost.message


# -- kubectl twinmq mirror trust ------------------------------------------------------------


def two_contexts(kubeconfig: Path, folder: Path) -> Path:
    """The admin kubeconfig with a context per site (one API server stands in for two)."""
    config = json.loads(kubeconfig.read_text())
    base = config["contexts"][0]["context"]
    config["contexts"] = [
        {"name": "here", "context": {**base, "namespace": "trust-a"}},
        {"name": "there", "context": {**base, "namespace": "trust-b"}},
    ]
    config["current-context"] = "here"
    path = folder / "kubeconfig"
    path.write_text(json.dumps(config))
    return path


def test_mirror_trust_copies_the_other_sites_ca_through_its_context_idempotently(
    api: Kube, kube_apiserver: Any, tmp_path: Path
) -> None:
    kubeconfig = two_contexts(kube_apiserver.kubeconfig, tmp_path)
    here = site(api, "trust-a", "orders", mirror_spec("source", "dr.example.com"))
    there = site(api, "trust-b", "orders", mirror_spec("replica", None))
    argv = ["mirror", "trust", "orders", "--kubeconfig", str(kubeconfig),
            "--from-context", "there", "--from-cluster", "orders"]  # fmt: skip

    def trust() -> str:
        out, err = io.StringIO(), io.StringIO()
        assert run(argv, out, err) == 0, err.getvalue()
        return out.getvalue()

    said = trust()
    name = trust_config_map("orders")
    assert f"configmap/{name} created in trust-a" in said
    assert "caConfigMap set to orders-mirror-trust" in said
    copy = api.get("v1", "ConfigMap", "trust-a", name)
    assert copy is not None and copy["data"]["ca.crt"] == published_ca(api, there)
    cluster = api.get(f"{GROUP}/{VERSION}", KIND, "trust-a", "orders")
    assert cluster is not None
    assert cluster["spec"]["mirror"]["tls"]["caConfigMap"] == name
    # What the operator then makes of it: the link over mutual TLS from that ConfigMap.
    trusted = peerca.resolve(here, spec_of(cluster["spec"]), Unreadable())
    assert trusted is not None and trusted.tls and trusted.reason == "CAConfigMap"

    again = trust()
    assert "unchanged" in again and "already orders-mirror-trust" in again

    rotated = certs.new_ca(there, NOW).cert
    api.apply(certs.build_ca_config_map(there, rotated))  # as the operator publishes it
    assert f"configmap/{name} updated" in trust()
    copy = api.get("v1", "ConfigMap", "trust-a", name)
    assert copy is not None and copy["data"]["ca.crt"] == rotated


def test_mirror_trust_says_when_the_other_site_published_no_ca(
    api: Kube, kube_apiserver: Any, tmp_path: Path
) -> None:
    kubeconfig = two_contexts(kube_apiserver.kubeconfig, tmp_path)
    site(api, "trust-a", "plain", mirror_spec("source", "dr.example.com"))
    out, err = io.StringIO(), io.StringIO()
    argv = ["mirror", "trust", "plain", "--kubeconfig", str(kubeconfig),
            "--from-context", "there", "--from-cluster", "absent"]  # fmt: skip
    assert run(argv, out, err) == 1
    assert 'brokerclusters.twinmq.io "absent" not found in namespace "trust-b"' in err.getvalue()
    assert api.get("v1", "ConfigMap", "trust-a", trust_config_map("plain")) is None


def test_mirror_trust_copies_no_ca_from_a_config_map_the_other_sites_cluster_does_not_own(
    api: Kube, kube_apiserver: Any, tmp_path: Path
) -> None:
    """`<cluster>-ca` made by someone else (before the cluster, by anyone who may create
    ConfigMaps there) is refused as the operator refuses it: nothing is written here, and
    the site's spec is left as it was. Once the cluster's own is published, it is copied."""
    kubeconfig = two_contexts(kube_apiserver.kubeconfig, tmp_path)
    site(api, "trust-a", "victim", mirror_spec("source", "dr.example.com"))
    api.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "trust-b"}})
    evil = certs.new_ca(ClusterRef("planted", "trust-b", "u-mallory"), NOW).cert
    planted = {"apiVersion": "v1", "kind": "ConfigMap",
               "metadata": {"name": "planted-ca", "namespace": "trust-b"},
               "data": {"ca.crt": evil}}  # fmt: skip
    api.ensure(planted)
    made = api.apply({"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND,
                      "metadata": {"name": "planted", "namespace": "trust-b"},
                      "spec": mirror_spec("replica", None)})  # fmt: skip
    argv = ["mirror", "trust", "victim", "--kubeconfig", str(kubeconfig),
            "--from-context", "there", "--from-cluster", "planted"]  # fmt: skip
    out, err = io.StringIO(), io.StringIO()
    assert run(argv, out, err) == 1
    assert ("ConfigMap trust-b/planted-ca (context there) is not BrokerCluster "
            "trust-b/planted's (no owner reference to it)") in err.getvalue()  # fmt: skip
    assert out.getvalue() == ""
    assert api.get("v1", "ConfigMap", "trust-a", trust_config_map("victim")) is None
    cluster = api.get(f"{GROUP}/{VERSION}", KIND, "trust-a", "victim")
    assert cluster is not None
    assert "caConfigMap" not in (cluster["spec"]["mirror"].get("tls") or {})

    # Its operator's own, once the planted one is gone: copied.
    api.delete("v1", "ConfigMap", "trust-b", "planted-ca")
    there = ClusterRef("planted", "trust-b", made["metadata"]["uid"])
    certs.reconcile_tls(there, spec_of(mirror_spec("replica", None)), certs.TlsMemory(), api,
                        api.apply, now=NOW, seconds=3600)  # fmt: skip
    assert run(argv, io.StringIO(), err) == 0, err.getvalue()
    copy = api.get("v1", "ConfigMap", "trust-a", trust_config_map("victim"))
    assert copy is not None and copy["data"]["ca.crt"] == published_ca(api, there) != evil
    cluster = api.get(f"{GROUP}/{VERSION}", KIND, "trust-a", "victim")
    assert cluster is not None
    assert cluster["spec"]["mirror"]["tls"]["caConfigMap"] == trust_config_map("victim")


def test_an_operator_that_may_not_read_the_other_namespace_says_so(
    api: Kube, kube_apiserver: Any
) -> None:
    """A namespace-scoped operator (the chart's Role: BrokerClusters and ConfigMaps of its
    own namespace only) is refused the other site's: reported, not guessed."""
    b_raw = mirror_spec("replica", "orders.nsop-a.svc")
    a_raw = mirror_spec("source", "orders.nsop-b.svc")
    site(api, "nsop-b", "orders", b_raw)
    a = site(api, "nsop-a", "orders", a_raw)
    rules = [
        {"apiGroups": [GROUP], "resources": ["brokerclusters"], "verbs": ["get"]},
        {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get"]},
    ]
    api.apply({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
               "metadata": {"name": "ns-operator", "namespace": "nsop-a"},
               "rules": rules})  # fmt: skip
    api.apply({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
               "metadata": {"name": "ns-operator", "namespace": "nsop-a"},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                           "name": "ns-operator"},
               "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User",
                             "name": "ns-operator"}]})  # fmt: skip
    scoped = Kube(str(kube_apiserver.kubeconfig))
    scoped.api.set_default_header("Impersonate-User", "ns-operator")

    def answer() -> peerca.Trust | None:
        trust = peerca.resolve(a, spec_of(a_raw), scoped)
        return trust if trust is not None and "HTTP 403" in trust.message else None

    trust = wait_for("the Role in force", answer, 30)
    assert not trust.tls and trust.reason == "PeerCAUnknown"
    assert "cannot read BrokerCluster nsop-b/orders" in trust.message
    assert "mirror trust" in trust.message
