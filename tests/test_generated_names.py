"""Names the operator generates, taken before it makes them (issue 16, docs/security.md
"Names the operator generates"). Someone who may create Secrets or ConfigMaps in a
namespace, but not read the operator's, creates `<cluster>-tls-ca` (a CA whose key they
hold) before the BrokerCluster exists: an operator that adopted what it found would sign
the brokers' certificates with the attacker's key. Each test runs the operator's reconcile
against a real kube-apiserver with a real BrokerCluster (its uid is the owner the operator
checks)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from cryptography import x509
from test_operator_federation import downstream
from test_operator_tls import cert_manager_crd

from twinmq.operator import builders, certs, federationtls, netpolicy, peerca
from twinmq.operator import main as operator_main
from twinmq.operator.builders import ClusterRef
from twinmq.operator.kube import Foreign, Kube, decoded_secret_data
from twinmq.operator.models import GROUP, KIND, VERSION, BrokerClusterSpec
from twinmq.operator.ownership import CERTIFICATE_NAME
from twinmq.testing.waiting import wait_for

NS = "names"
NOW = datetime(2026, 12, 2, 9, 0, tzinfo=UTC)


@pytest.fixture(scope="module")
def space(api: Kube) -> Kube:
    """The API server with the CRD served and the tests' namespace."""
    namespace: Any = {"metadata": {"name": NS}}  # the client takes plain dicts
    api.core.create_namespace(namespace)
    return api


def new_cluster(api: Kube, name: str, spec: dict[str, Any] | None = None) -> ClusterRef:
    """A real BrokerCluster (the owner the operator's objects must name, by uid)."""
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND,
            "metadata": {"name": name, "namespace": NS}, "spec": spec or {}}  # fmt: skip
    made = api.dynamic.resources.get(api_version=f"{GROUP}/{VERSION}", kind=KIND).create(
        body=body, namespace=NS
    )
    return ClusterRef(name, NS, made.metadata.uid)


def attacker_ca_secret(cluster: ClusterRef, name: str) -> tuple[certs.KeyPair, dict[str, Any]]:
    """A CA the attacker made (they hold its key) in a Secret under `name`, no owner."""
    ca = certs.new_ca(cluster, NOW)  # the same subject the operator would give its own
    secret = {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
              "metadata": {"name": name, "namespace": NS},
              "data": certs.b64({"tls.crt": ca.cert, "tls.key": ca.key})}  # fmt: skip
    return ca, secret


def attacker_server_secret(cluster: ClusterRef, name: str) -> dict[str, Any]:
    """A certificate for this cluster's names whose key the attacker holds (their own CA
    signed it), in a Secret under `name`, no owner."""
    evil = certs.new_ca(cluster, NOW)
    leaf = certs.issue_server(evil, certs.dns_names(cluster), NOW, 3600, client=True)
    return {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
            "metadata": {"name": name, "namespace": NS},
            "data": certs.b64({"tls.crt": leaf.cert, "tls.key": leaf.key,
                               "ca.crt": evil.cert})}  # fmt: skip


def untouched(api: Kube, kind: str, planted: dict[str, Any]) -> None:
    """`planted` is as its author made it: not rewritten, not owned by the cluster (its
    garbage collector would delete it with the cluster)."""
    found = api.get("v1", kind, NS, planted["metadata"]["name"])
    assert found is not None
    assert not found["metadata"].get("ownerReferences"), found["metadata"]["ownerReferences"]
    assert found["data"] == planted["data"]


def signed_by(pem: str, ca: certs.KeyPair) -> bool:
    try:
        x509.load_pem_x509_certificate(pem.encode()).verify_directly_issued_by(ca.certificate())
    except Exception:
        return False
    return True


def test_a_ca_secret_created_before_the_cluster_is_never_its_ca(
    space: Kube, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = new_cluster(space, "preca")
    evil, secret = attacker_ca_secret(cluster, "preca-tls-ca")
    space.apply(secret)
    monkeypatch.setattr(operator_main, "KUBE", space)
    with pytest.raises(Foreign) as refused:
        operator_main.reconcile_children(cluster, BrokerClusterSpec(), operator_main.Memory(), {})
    assert "Secret preca-tls-ca exists and is not this BrokerCluster's" in str(refused.value)
    untouched(space, "Secret", secret)
    server = space.get_secret_data(NS, "preca-tls")
    assert server is None or not signed_by(server["tls.crt"], evil)
    assert space.get_pod(NS, "preca-primary") is None  # no broker serves a certificate of it
    # What the cluster's status says (kstatus: it waits for someone to act).
    stalled = operator_main.rollout_conditions(None, None, str(refused.value))[1]
    assert stalled[:3] == ("Stalled", True, "ForeignObject") and "preca-tls-ca" in stalled[3]


def test_planted_credentials_are_refused_with_the_way_out(
    space: Kube, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`<cluster>-auth` goes through the same check, before the first probe (the admin
    token is in it): the reason names the spec field that avoids the name."""
    cluster = new_cluster(space, "preauth")
    planted = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
               "metadata": {"name": "preauth-auth", "namespace": NS},
               "data": certs.b64({"admin-token": "known-to-the-attacker"})}  # fmt: skip
    space.apply(planted)
    monkeypatch.setattr(operator_main, "KUBE", space)
    with pytest.raises(Foreign) as refused:
        operator_main.credentials_of(cluster, BrokerClusterSpec(), operator_main.Memory())
    assert "Secret preauth-auth exists and is not this BrokerCluster's" in str(refused.value)
    assert "spec.auth.secretName" in str(refused.value)
    untouched(space, "Secret", planted)


MIRROR = {"mirror": {"role": "source", "target": {"host": "orders.site-b.svc", "port": 5680},
                     "secretName": "dr"}}  # fmt: skip
FEDERATION = {"federation": downstream()}


@pytest.mark.parametrize(
    ("suffix", "spec"),
    [("tls", {}), ("primary-tls", {}), ("backup-tls", {}), ("mirror-tls", MIRROR),
     ("federation-tls", FEDERATION)],
)  # fmt: skip
def test_each_certificate_secret_created_by_someone_else_is_refused_and_left_alone(
    space: Kube, suffix: str, spec: dict[str, Any]
) -> None:
    """A certificate whose key the attacker holds, under the name of one the operator
    issues: the broker (or the site, or the federation link) would present it."""
    cluster = new_cluster(space, f"pre-{suffix.replace('-tls', '') or 'x'}", spec)
    planted = attacker_server_secret(cluster, f"{cluster.name}-{suffix}")
    space.apply(planted)
    memory = certs.TlsMemory()
    wanted = BrokerClusterSpec.model_validate(spec)
    with pytest.raises(Foreign) as refused:
        certs.reconcile_tls(cluster, wanted, memory, space, space.apply, now=NOW, seconds=3600)
    assert f"Secret {cluster.name}-{suffix} exists" in str(refused.value)
    untouched(space, "Secret", planted)
    held = [memory.server, *(i.pair for i in (*memory.peers.values(), memory.mirror,
                                              memory.federation) if i is not None)]  # fmt: skip
    planted_cert = decoded_secret_data(planted["data"])["tls.crt"]
    assert all(pair is None or pair.cert != planted_cert for pair in held)


def test_a_ca_config_map_created_by_someone_else_is_neither_rewritten_nor_owned(
    space: Kube, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`<cluster>-ca` is what applications trust: one planted before the cluster is left
    as it is and the pass stops before the pods (nothing is published under its name)."""
    cluster = new_cluster(space, "precm")
    evil, _ = attacker_ca_secret(cluster, "unused")
    planted = {"apiVersion": "v1", "kind": "ConfigMap",
               "metadata": {"name": "precm-ca", "namespace": NS},
               "data": {"ca.crt": evil.cert}}  # fmt: skip
    space.apply(planted)
    monkeypatch.setattr(operator_main, "KUBE", space)
    with pytest.raises(Foreign) as refused:
        operator_main.reconcile_children(cluster, BrokerClusterSpec(), operator_main.Memory(), {})
    assert "ConfigMap precm-ca exists" in str(refused.value)
    untouched(space, "ConfigMap", planted)
    assert space.get_pod(NS, "precm-primary") is None


OPERATOR_PODS = {
    netpolicy.OPERATOR_NAMESPACE_ENV: "twinmq-system",
    netpolicy.OPERATOR_SELECTOR_ENV: "app.kubernetes.io/name=twinmq-operator",
}


def planted_children(name: str) -> list[dict[str, Any]]:
    """What someone else could make under the names of a cluster's other children, each
    worth having: the virtual IP (and the brokers' DNS names) sent to their own pod, a
    disruption budget that lets both brokers go, the brokers' ServiceAccount (whose tokens
    they may hold), Role and RoleBinding granting more, a policy letting anyone in."""
    meta = {"name": name, "namespace": NS, "labels": {"planted-by": "mallory"}}
    evil = {"app": "mallory"}
    port = {"name": "amqp", "port": 5672}
    rbac = "rbac.authorization.k8s.io/v1"
    return [
        {"apiVersion": "v1", "kind": "Service", "metadata": meta,
         "spec": {"selector": evil, "ports": [port]}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {**meta, "name": f"{name}-brokers"},
         "spec": {"clusterIP": "None", "selector": evil, "ports": [port]}},
        {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": meta,
         "spec": {"maxUnavailable": 2, "selector": {"matchLabels": evil}}},
        {"apiVersion": "v1", "kind": "ServiceAccount",
         "metadata": {**meta, "name": f"{name}-broker"}},
        {"apiVersion": rbac, "kind": "Role", "metadata": {**meta, "name": f"{name}-broker"},
         "rules": [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "list"]}]},
        {"apiVersion": rbac, "kind": "RoleBinding", "metadata": {**meta, "name": f"{name}-broker"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                     "name": "edit"},
         "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User",
                       "name": "mallory"}]},
        {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
         "metadata": {**meta, "name": f"{name}-brokers"},
         "spec": {"podSelector": {}, "ingress": [{}], "policyTypes": ["Ingress"]}},
    ]  # fmt: skip


def holds(found: Any, planted: Any) -> bool:
    """Whether `found` still holds everything `planted` set (the API server adds defaults)."""
    if isinstance(planted, dict):
        return isinstance(found, dict) and all(holds(found.get(k), v) for k, v in planted.items())
    if isinstance(planted, list):
        return isinstance(found, list) and len(found) == len(planted) and all(
            holds(f, p) for f, p in zip(found, planted, strict=True))  # fmt: skip
    return bool(found == planted)


@pytest.mark.parametrize(
    "index", range(len(planted_children("x"))),
    ids=[f"{o['kind']}-{o['metadata']['name']}" for o in planted_children("x")],
)  # fmt: skip
def test_each_other_child_made_by_someone_else_is_refused_and_left_alone(
    space: Kube, monkeypatch: pytest.MonkeyPatch, index: int
) -> None:
    """Services, the PodDisruptionBudget, the brokers' ServiceAccount, Role and
    RoleBinding, the NetworkPolicy: the same check as Secrets. Applying over one would
    leave what the operator does not set (an EndpointSlice of the attacker's still
    routes the virtual IP to their pod; a RoleBinding's roleRef cannot even change)."""
    cluster = new_cluster(space, f"prekind-{index}")
    planted = planted_children(cluster.name)[index]
    space.ensure(planted)
    for key, value in OPERATOR_PODS.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(operator_main, "KUBE", space)
    with pytest.raises(Foreign) as refused:
        operator_main.reconcile_children(cluster, BrokerClusterSpec(), operator_main.Memory(), {})
    name = planted["metadata"]["name"]
    assert f"{planted['kind']} {name} exists and is not this BrokerCluster's" in str(
        refused.value)  # fmt: skip
    found = space.get(planted["apiVersion"], planted["kind"], NS, name)
    assert found is not None and not found["metadata"].get("ownerReferences")
    assert holds(found, planted), found
    assert space.get_pod(NS, f"{cluster.name}-primary") is None
    stalled = operator_main.rollout_conditions(None, None, str(refused.value))[1]
    assert stalled[:3] == ("Stalled", True, "ForeignObject")


def test_a_restarted_operator_applies_over_its_own_children_and_an_orphaned_volume(
    space: Kube, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cluster's own objects (made by an earlier operator process) pass the check; a
    PVC that no longer names the cluster (deleted with `--cascade=orphan` and created
    again) is still taken: it holds the broker's data. And a policy of someone else's is
    not deleted when the cluster opts out of the operator's."""
    for key, value in OPERATOR_PODS.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(operator_main, "KUBE", space)
    cluster = new_cluster(space, "again")
    orphaned = builders.build_pvc(cluster, BrokerClusterSpec(), "primary")
    del orphaned["metadata"]["ownerReferences"]
    space.ensure(orphaned)
    operator_main.reconcile_children(cluster, BrokerClusterSpec(), operator_main.Memory(), {})
    operator_main.reconcile_children(cluster, BrokerClusterSpec(), operator_main.Memory(), {})
    for obj in planted_children(cluster.name):
        found = space.get(obj["apiVersion"], obj["kind"], NS, obj["metadata"]["name"])
        assert found is not None and found["metadata"]["ownerReferences"][0]["uid"] == cluster.uid
    volume = space.get("v1", "PersistentVolumeClaim", NS, orphaned["metadata"]["name"])
    assert volume is not None and volume["metadata"]["ownerReferences"][0]["uid"] == cluster.uid

    opted_out = new_cluster(space, "optout")
    (policy,) = [o for o in planted_children(opted_out.name) if o["kind"] == "NetworkPolicy"]
    space.ensure(policy)
    off = BrokerClusterSpec.model_validate({"networkPolicy": {"enabled": False}})
    operator_main.reconcile_children(opted_out, off, operator_main.Memory(), {})
    assert space.get(policy["apiVersion"], "NetworkPolicy", NS, policy["metadata"]["name"])


def test_a_planted_copy_of_another_sites_ca_is_no_copy(space: Kube) -> None:
    """The operator's own copies of other clusters' CAs (mirror, federation): a ConfigMap
    someone made under their names is not read as a copy the operator wrote."""
    cluster = new_cluster(space, "precopy")
    for name in ("precopy-mirror-peer-ca", "precopy-federation-peer-ca"):
        space.apply({"apiVersion": "v1", "kind": "ConfigMap",
                     "metadata": {"name": name, "namespace": NS},
                     "data": {"ca.crt": "EVIL",
                              federationtls.upstream_key("central"): "EVIL"}})  # fmt: skip
    assert peerca.copied_bundle(cluster, space) is None
    assert federationtls.copied(cluster, "precopy-federation-peer-ca", space) == {}


def test_another_sites_ca_is_copied_only_from_the_config_map_its_cluster_owns(
    space: Kube,
) -> None:
    """Site a learns site b's CA from `b-ca`: one that b's BrokerCluster does not own
    (made before b, by someone who may create ConfigMaps there) is not b's CA."""
    a_spec = BrokerClusterSpec.model_validate({"mirror": {
        "role": "source", "target": {"host": f"site-b.{NS}.svc", "port": 5680},
        "secretName": "dr"}})  # fmt: skip
    a = new_cluster(space, "site-a", a_spec.model_dump(by_alias=True, exclude_unset=True))
    b_spec = {"mirror": {"role": "replica", "target": {"host": f"site-a.{NS}.svc",
              "port": 5680}, "secretName": "dr"}}  # fmt: skip
    planted = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "site-b-ca", "namespace": NS},
        "data": {"ca.crt": "EVIL"},
    }
    space.apply(planted)
    b = new_cluster(space, "site-b", b_spec)
    trust = peerca.resolve(a, a_spec, space)
    assert trust is not None and not trust.tls and trust.bundle is None, trust
    assert "ConfigMap site-b-ca exists and is not this BrokerCluster's" in trust.message
    # b's operator publishes its own (it owns it from then on): that one is copied.
    space.delete("v1", "ConfigMap", NS, "site-b-ca")
    certs.reconcile_tls(b, BrokerClusterSpec.model_validate(b_spec), certs.TlsMemory(), space,
                        space.apply, now=NOW, seconds=3600)  # fmt: skip
    trust = peerca.resolve(a, a_spec, space)
    assert trust is not None and trust.tls and trust.reason == "PeerCACopied", trust
    assert trust.bundle is not None and "EVIL" not in trust.bundle


def test_a_restarted_operator_adopts_its_own_secrets_and_resumes_a_rotation(space: Kube) -> None:
    cluster = new_cluster(space, "own")
    rotate = BrokerClusterSpec.model_validate({"requests": {"rotateCa": {"id": "r1"}}})
    first = certs.TlsMemory()
    certs.reconcile_tls(cluster, BrokerClusterSpec(), first, space, space.apply, now=NOW,
                        seconds=3600)  # fmt: skip
    certs.reconcile_tls(cluster, rotate, first, space, space.apply, now=NOW, seconds=3600)
    assert first.rotation is not None and first.rotation.phase == "Staged"
    again = certs.TlsMemory()  # a new operator process
    certs.reconcile_tls(cluster, rotate, again, space, space.apply, now=NOW, seconds=3600)
    assert again.issued == 0
    assert again.ca == first.ca and again.ca_next == first.ca_next
    assert again.rotation is not None and again.rotation.phase == "Staged"


def test_secrets_an_operator_of_the_previous_version_made_are_still_adopted(space: Kube) -> None:
    """Written as the operator has made them since AMQPS came (2026-11-27): the owner
    reference `builders.owned_meta` gives, no rotation state, no drift digest."""
    cluster = new_cluster(space, "older")
    ca = certs.new_ca(cluster, NOW)
    server = certs.issue_server(ca, certs.dns_names(cluster), NOW, 3600)
    owner = {"apiVersion": "twinmq.io/v1alpha1", "kind": "BrokerCluster", "name": "older",
             "uid": cluster.uid, "controller": True, "blockOwnerDeletion": True}  # fmt: skip
    for name, pair, trust in (("older-tls-ca", ca, None), ("older-tls", server, ca.cert)):
        data = {"tls.crt": pair.cert, "tls.key": pair.key}
        if trust is not None:
            data["ca.crt"] = trust
        space.apply({"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
                     "metadata": {"name": name, "namespace": NS, "ownerReferences": [owner]},
                     "data": certs.b64(data)})  # fmt: skip
    memory = certs.TlsMemory()
    certs.reconcile_tls(cluster, BrokerClusterSpec(), memory, space, space.apply, now=NOW,
                        seconds=3600)  # fmt: skip
    assert memory.ca == ca and memory.server == server


# -- cert-manager: its Secret has no owner reference, its Certificate does ----------------


@pytest.fixture(scope="module")
def cert_manager(space: Kube) -> Kube:
    """cert-manager's Certificate kind served (its CRD from its Go module)."""
    space.apply(cert_manager_crd())

    def served() -> bool:
        space.dynamic.resources.invalidate_cache()
        try:
            space.dynamic.resources.get(api_version="cert-manager.io/v1", kind="Certificate")
        except Exception:
            return False
        return True

    wait_for("cert-manager's Certificate kind served", served, 60)
    return space


ISSUER = {"tls": {"issuerRef": {"name": "corp-ca", "kind": "ClusterIssuer"}}}


def cert_managers_secret(cluster: ClusterRef, ca: certs.KeyPair) -> dict[str, Any]:
    """The Secret as cert-manager writes it for the Certificate `<cluster>-tls`."""
    server = certs.issue_server(ca, certs.dns_names(cluster), NOW, 3600)
    written = certs.build_server_secret(cluster, BrokerClusterSpec().tls, server, ca.cert)
    written["metadata"] = {"name": f"{cluster.name}-tls", "namespace": NS,
                           "annotations": {CERTIFICATE_NAME: f"{cluster.name}-tls"}}  # fmt: skip
    return written


def created(api: Kube, kind: str, name: str) -> datetime:
    found = api.get("v1", kind, NS, name)
    assert found is not None
    return datetime.fromisoformat(found["metadata"]["creationTimestamp"].replace("Z", "+00:00"))


def test_a_secret_planted_for_cert_manager_before_its_certificate_is_not_published(
    cert_manager: Kube,
) -> None:
    """Even with cert-manager's annotation: it was there before the Certificate, so
    cert-manager did not write it (and would keep it, a valid-looking certificate)."""
    cluster = new_cluster(cert_manager, "precm-issued", ISSUER)
    evil, _ = attacker_ca_secret(cluster, "unused")
    planted = cert_managers_secret(cluster, evil)
    cert_manager.apply(planted)
    made = created(cert_manager, "Secret", planted["metadata"]["name"])

    def a_second_later() -> bool:  # creation times have a second's resolution
        probe: Any = {"metadata": {"generateName": "clock-", "namespace": NS}}
        meta = cert_manager.core.create_namespaced_config_map(NS, probe).metadata
        assert meta is not None and meta.creation_timestamp is not None
        return bool(meta.creation_timestamp >= made + timedelta(seconds=1))

    wait_for("the API server's clock past the planted Secret's second", a_second_later, 10)
    spec = BrokerClusterSpec.model_validate(ISSUER)
    with pytest.raises(Foreign) as refused:
        certs.reconcile_tls(cluster, spec, certs.TlsMemory(), cert_manager, cert_manager.apply,
                            clock=0.0)  # fmt: skip
    assert "created before this BrokerCluster's Certificate precm-issued-tls" in str(refused.value)
    assert cert_manager.get("v1", "ConfigMap", NS, "precm-issued-ca") is None


def test_cert_managers_secret_for_the_clusters_certificate_is_published(
    cert_manager: Kube,
) -> None:
    cluster = new_cluster(cert_manager, "issued", ISSUER)
    spec = BrokerClusterSpec.model_validate(ISSUER)
    memory = certs.TlsMemory()
    certs.reconcile_tls(cluster, spec, memory, cert_manager, cert_manager.apply, clock=0.0)
    ca = certs.new_ca(cluster, NOW)
    written = cert_managers_secret(cluster, ca)
    unannotated = {**written, "metadata": {"name": "issued-tls", "namespace": NS}}
    cert_manager.apply(unannotated)  # not cert-manager's (no annotation): refused
    with pytest.raises(Foreign):
        certs.reconcile_tls(cluster, spec, memory, cert_manager, cert_manager.apply,
                            clock=certs.READ_EVERY)  # fmt: skip
    cert_manager.apply(written)  # as cert-manager writes it, after the Certificate
    certs.reconcile_tls(cluster, spec, memory, cert_manager, cert_manager.apply,
                        clock=2 * certs.READ_EVERY)  # fmt: skip
    published = cert_manager.get("v1", "ConfigMap", NS, "issued-ca")
    assert published is not None and published["data"]["ca.crt"] == ca.cert
