"""A full mesh of DR sites declared in Kubernetes (`spec.mirror.targets`, issue 14): the
CRD's rules on a real API server, the brokers' settings and ports of a three-site mesh,
its NetworkPolicy, the other sites' CAs copied into one bundle, `status.mirror.targets`
from a real broker mesh with its condition and Events, and `kubectl twinmq mirror status`
with one line per target."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from mirrorsites import Mesh, mirror_status
from test_kubectl_plugin import FakeKube, run
from test_operator_mirror_peer_ca import NOW, Operator, published_ca, site
from test_operator_mirroring import env_of, settings_from

from twinmq.broker.api import MirrorStatus
from twinmq.broker.names import MIRROR_PORT
from twinmq.cli import kubectl
from twinmq.operator import certs, peerca
from twinmq.operator.builders import ClusterRef, build_pod, build_vip_service
from twinmq.operator.kube import Kube, Refused
from twinmq.operator.mirroring import condition, events, state_of
from twinmq.operator.models import (
    GROUP,
    KIND,
    VERSION,
    BrokerClusterSpec,
    BrokerName,
    Mirror,
    MirrorState,
)
from twinmq.operator.netpolicy import OperatorPods, build_network_policy
from twinmq.testing.launcher import BrokerProcess
from twinmq.testing.waiting import wait_for

SITES = ["site-a", "site-b", "site-c"]


def mesh_mirror(namespace: str, sites: list[str] = SITES) -> dict[str, Any]:
    """`spec.mirror` of `orders` in `namespace`: a mesh naming every other site."""
    targets = [{"host": f"orders.{other}.svc"} for other in sites if other != namespace]
    return {"role": "bidirectional", "secretName": "dr", "targets": targets}


def spec(mirror: dict[str, Any]) -> BrokerClusterSpec:
    return BrokerClusterSpec.model_validate({"mirror": mirror})


# -- the brokers' settings and ports -----------------------------------------------------------


def test_each_site_of_a_three_site_mesh_runs_one_link_per_other_site() -> None:
    origins = set()
    brokers: list[BrokerName] = ["primary", "backup"]
    for i, namespace in enumerate(SITES):
        ref = ClusterRef(name="orders", namespace=namespace, uid=f"u-{i}")
        declared = spec(mesh_mirror(namespace))
        others = [f"orders.{other}.svc:{MIRROR_PORT}" for other in SITES if other != namespace]
        for broker in brokers:
            pod = build_pod(ref, declared, broker)
            settings = settings_from(env_of(pod))
            assert settings.mirror_targets == others
            assert settings.mirror_mesh and settings.mirror_port == MIRROR_PORT
            assert {"name": "mirror", "containerPort": MIRROR_PORT} in (
                pod["spec"]["containers"][0]["ports"]
            )
            origins.add(settings.mirror_id)
        ports = build_vip_service(ref, declared.mirror)["spec"]["ports"]
        assert {"name": "mirror", "port": MIRROR_PORT, "targetPort": "mirror"} in ports
    assert origins == {f"{namespace}/orders" for namespace in SITES}


def test_one_target_is_still_one_link_and_a_mesh_lists_every_target() -> None:
    ring = Mirror.model_validate({"role": "bidirectional", "secretName": "dr",
                                  "target": {"host": "orders.site-b.svc"}})  # fmt: skip
    assert [t.host for t in ring.all_targets()] == ["orders.site-b.svc"]
    mesh = Mirror.model_validate(mesh_mirror("site-a"))
    assert [t.host for t in mesh.all_targets()] == ["orders.site-b.svc", "orders.site-c.svc"]
    assert Mirror.model_validate({"role": "replica", "secretName": "dr"}).all_targets() == []


# -- the CRD's rules on a real API server ------------------------------------------------------


def apply_mirror(api: Kube, name: str, mirror: dict[str, Any]) -> None:
    api.apply({
        "apiVersion": f"{GROUP}/{VERSION}", "kind": KIND,
        "metadata": {"name": name, "namespace": "default"}, "spec": {"mirror": mirror},
    })  # fmt: skip


@pytest.mark.parametrize(
    ("change", "refusal"),
    [
        ({"role": "source"}, "spec.mirror.targets (a full mesh) needs role bidirectional"),
        ({"targets": [{"host": "orders.site-b.svc"}]}, "should have at least 2 items"),
        ({"target": {"host": "orders.site-b.svc"}}, "one target or a mesh's targets, not both"),
        (
            {
                "targets": [
                    {"host": "orders.site-b.svc"},
                    {"host": "orders.site-b.svc", "port": MIRROR_PORT},
                ]
            },
            "spec.mirror.targets must be unique (host and port)",
        ),
        ({"tls": {"serverName": "orders"}}, "name each target's Service in targets[].host"),
    ],
    ids=["one-way", "one-target", "target-and-targets", "duplicate", "server-name"],
)
def test_the_crd_refuses_a_mesh_that_the_brokers_could_not_run(
    api: Kube, change: dict[str, Any], refusal: str
) -> None:
    with pytest.raises(Refused) as refused:
        apply_mirror(api, "bad-mesh", {**mesh_mirror("site-a"), **change})
    assert refusal in str(refused.value)


def test_the_crd_takes_a_mesh_and_the_same_host_on_two_ports(api: Kube) -> None:
    apply_mirror(api, "mesh", mesh_mirror("site-a", [*SITES, "site-d"]))
    two_ports = [{"host": "dr.example.com", "port": 5674}, {"host": "dr.example.com", "port": 5675}]
    apply_mirror(api, "mesh-ports", {**mesh_mirror("site-a"), "targets": two_ports})
    got = api.get(f"{GROUP}/{VERSION}", KIND, "default", "mesh")
    assert got is not None
    assert len(spec(got["spec"]["mirror"]).mirror.all_targets()) == 3  # type: ignore[union-attr]


# -- the NetworkPolicy -------------------------------------------------------------------------

OPERATOR = OperatorPods("twinmq-system", {"app.kubernetes.io/name": "twinmq-operator"})


def mirror_rule(policy: dict[str, Any]) -> list[dict[str, Any]]:
    """The ingress rules that admit the mirror port."""
    return [rule for rule in policy["spec"]["ingress"]
            if {"protocol": "TCP", "port": MIRROR_PORT} in rule["ports"]]  # fmt: skip


def test_a_mesh_sites_policy_admits_the_mirror_port_from_its_listed_sites_only(
    api: Kube,
) -> None:
    ref = ClusterRef(name="orders", namespace="default", uid="u-1")
    policy = build_network_policy(ref, spec(mesh_mirror("default", ["default", *SITES[1:]])),
                                  OPERATOR)  # fmt: skip
    (rule,) = mirror_rule(policy)
    assert rule["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": other}},
         "podSelector": {"matchLabels": {"twinmq.io/cluster": "orders"},
                         "matchExpressions": [{"key": "twinmq.io/broker",
                                               "operator": "Exists"}]}}
        for other in SITES[1:]
    ]  # fmt: skip
    api.apply(policy)  # a shape the API server takes
    # A target outside this Kubernetes cluster: the port stays open (its source is unknown).
    outside = mesh_mirror("default")
    outside["targets"][0]["host"] = "dr.example.com"
    (rule,) = mirror_rule(build_network_policy(ref, spec(outside), OPERATOR))
    assert "from" not in rule
    # One target (one way, or a ring whose incoming site is not its target): open too.
    ring = {"role": "bidirectional", "secretName": "dr", "target": {"host": "orders.site-b.svc"}}
    (rule,) = mirror_rule(build_network_policy(ref, spec(ring), OPERATOR))
    assert "from" not in rule


# -- mutual TLS: every other site's CA in one bundle ------------------------------------------


def test_a_mesh_site_copies_every_other_sites_ca_into_one_bundle(api: Kube) -> None:
    names = ["pcm-a", "pcm-b", "pcm-c"]
    raws = {ns: {"mirror": mesh_mirror(ns, names)} for ns in names}
    refs = {ns: site(api, ns, "orders", raws[ns]) for ns in names}
    at_a = Operator(api, refs["pcm-a"], raws["pcm-a"])
    trust = at_a.reconcile(0.0)
    assert trust.tls and trust.reason == "PeerCACopied", trust.message
    copy = api.get("v1", "ConfigMap", "pcm-a", "orders-mirror-peer-ca")
    assert copy is not None
    bundle = copy["data"]["ca.crt"]
    assert published_ca(api, refs["pcm-b"]) in bundle
    assert published_ca(api, refs["pcm-c"]) in bundle
    assert published_ca(api, refs["pcm-a"]) not in bundle
    assert copy["metadata"]["annotations"]["twinmq.io/copied-from"] == (
        "pcm-b/orders-ca, pcm-c/orders-ca"
    )
    assert [e[1] for e in at_a.events] == ["MirrorPeerCACopied"]
    # The pods mount the bundle as their mirror CA.
    pod = build_pod(refs["pcm-a"], peerca.effective(BrokerClusterSpec.model_validate(
        raws["pcm-a"]), trust), "primary")  # fmt: skip
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["mirror-ca"]["configMap"]["name"] == "orders-mirror-peer-ca"

    # C's CA rotates: the bundle follows.
    rotated = certs.new_ca(refs["pcm-c"], NOW).cert
    api.apply(certs.build_ca_config_map(refs["pcm-c"], rotated))  # as its operator does
    at_a.reconcile(peerca.READ_EVERY)
    assert at_a.events[-1][1] == "MirrorPeerCAUpdated"
    copy = api.get("v1", "ConfigMap", "pcm-a", "orders-mirror-peer-ca")
    assert copy is not None and rotated in copy["data"]["ca.crt"]

    # A site that does not name A back: every link stays plaintext (one CA bundle for all
    # of them), and the condition names that target.
    lone = {"mirror": mesh_mirror("pcm-d", ["pcm-d", "pcm-a", "pcm-b"])}
    lone_ref = site(api, "pcm-d", "orders", lone)
    told = Operator(api, lone_ref, lone).reconcile(0.0)
    assert not told.tls and told.reason == "PeerCAUnknown"
    assert told.message.startswith("target orders.pcm-a.svc: ") and "does not name" in told.message


# -- the status from a real broker mesh --------------------------------------------------------


def test_a_mesh_sites_status_shows_each_target_from_real_brokers(tmp_path: Path) -> None:
    """Three real full-mesh sites read as the operator reads them: each site's two targets
    Connected (the Mirroring condition True); a site stopped shows on each other site as
    that one target Disconnected, the site's state the worst of its targets', the
    condition naming the target, and a Warning Event for the target."""
    declared = Mirror.model_validate(mesh_mirror("site-a"))

    def state(site: BrokerProcess) -> MirrorState:
        seen = mirror_status(site)
        got = state_of(declared, MirrorStatus.model_validate(seen) if seen else None)
        assert got is not None
        return got

    def linked(site: BrokerProcess) -> bool:
        got = state(site)
        return got.inbound == "Connected" and got.sources_connected == 2

    with Mesh(tmp_path, 3) as mesh:
        a, b, c = mesh.sites
        wait_for("every site linked both ways", lambda: all(linked(s) for s in mesh.sites))
        up = {s.name: state(s) for s in mesh.sites}
        for seen in up.values():
            assert seen.state == "Connected"
            assert [(t.state, t.connected) for t in seen.targets] == [("Connected", True)] * 2
            linked_text = "all 2 targets are linked, and 2 sites are linked in"
            assert condition(seen) == ("Mirroring", True, "Connected", linked_text)
        c_address = next(t.target for t in up["site-a"].targets
                         if t.target.endswith(f":{c.extra_args[1]}"))  # fmt: skip
        c.stop()

        def c_down(site: BrokerProcess) -> bool:
            return {t.target: t.state for t in state(site).targets}[c_address] == "Disconnected"

        wait_for("site-c's link down on site-a", lambda: c_down(a))
        down = state(a)
        assert down.state == "Disconnected"  # the worst of its targets'
        others = [t for t in down.targets if t.target != c_address]
        assert [t.state for t in others] == ["Connected"]
        (lost,) = [t for t in down.targets if t.target == c_address]
        assert lost.message  # why the link is down, from the broker
        reason = condition(down)
        assert reason is not None and reason[:3] == ("Mirroring", False, "Disconnected")
        assert reason[3].startswith(f"1 of 2 targets not connected: {c_address} Disconnected")
        happened = events(up["site-a"], down)
        assert ("Warning", "MirrorTargetDisconnected") in [e[:2] for e in happened]
        assert any(c_address in e[2] and "Connected -> Disconnected" in e[2] for e in happened)
        # And back: the target's Normal Event.
        back = [e[:2] for e in events(down, up["site-a"])]
        assert ("Normal", "MirrorTargetConnected") in back
        wait_for("site-c's link down on site-b", lambda: c_down(b))


# -- kubectl twinmq mirror status --------------------------------------------------------------


def test_mirror_status_prints_one_line_per_target_of_a_mesh() -> None:
    cluster = {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": KIND,
        "metadata": {"name": "orders", "namespace": "prod"},
        "spec": {"mirror": mesh_mirror("site-a")},
        "status": {"mirror": {
            "role": "bidirectional", "state": "Disconnected", "inbound": "Connected",
            "epoch": 0, "sourcesConnected": 1, "tls": True,
            "targets": [
                {"target": f"orders.site-b.svc:{MIRROR_PORT}", "state": "Connected",
                 "connected": True, "queueEvents": 0, "lagSeconds": 0.0},
                {"target": f"orders.site-c.svc:{MIRROR_PORT}", "state": "Disconnected",
                 "queueEvents": 42, "lagSeconds": 12.5, "message": "connection refused"},
            ],
        }},
    }  # fmt: skip
    code, out, _ = run(FakeKube(cluster), ["mirror", "status"])
    assert code == kubectl.EXIT_OK
    header, *rows = out.splitlines()
    assert header.split() == list(kubectl.MIRROR_COLUMNS)
    assert [row.split() for row in rows] == [
        ["orders", "bidirectional", "Connected", "Connected", "0",
         f"orders.site-b.svc:{MIRROR_PORT}", "0", "0.0s", "1", "yes"],
        ["orders", "bidirectional", "Disconnected", "Connected", "0",
         f"orders.site-c.svc:{MIRROR_PORT}", "42", "12.5s", "1", "yes", "connection", "refused"],
    ]  # fmt: skip
    # Before the active reported anything: a line per declared target, Unknown.
    del cluster["status"]
    assert [row[2] for row in kubectl.mirror_rows([cluster])] == ["Unknown", "Unknown"]
