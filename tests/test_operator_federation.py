"""spec.federation on Kubernetes: the brokers' server id and federation file, the status,
conditions and Events from real brokers' reports, and the CRD's rules on a real API server."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from apiserver import install_crd
from federationsites import channel, publish_confirmed, site

from twinmq.broker.api import BrokerStatus
from twinmq.broker.federation.config import load
from twinmq.broker.settings import BrokerSettings
from twinmq.operator import federation
from twinmq.operator.builders import (
    ClusterRef,
    build_federation_config_map,
    build_pod,
    pod_revision,
)
from twinmq.operator.kube import Kube, Refused
from twinmq.operator.models import GROUP, KIND, VERSION, BrokerClusterSpec, Federation
from twinmq.testing.launcher import BrokerProcess
from twinmq.testing.pair import status
from twinmq.testing.waiting import wait_for

REMOTE = ClusterRef(name="remote", namespace="site-b", uid="u-2")
CENTRAL_REF = {"name": "central", "namespace": "site-a"}


def spec(fed: dict[str, Any] | None) -> BrokerClusterSpec:
    return BrokerClusterSpec.model_validate({} if fed is None else {"federation": fed})


def downstream(**exchange: Any) -> dict[str, Any]:
    """A downstream's spec.federation: `market` from the BrokerCluster central in site-a."""
    return {
        "upstreams": [{"name": "central", "clusterRef": CENTRAL_REF,
                       "passwordSecret": {"name": "central-login"}}],
        "exchanges": [{"exchange": "market", "upstream": "central", **exchange}],
    }  # fmt: skip


def container(pod: dict[str, Any]) -> dict[str, Any]:
    (broker,) = pod["spec"]["containers"]
    return dict(broker)


def flags(pod: dict[str, Any]) -> dict[str, str]:
    return dict(a.removeprefix("--").partition("=")[::2] for a in container(pod)["args"])


@pytest.mark.parametrize("broker", ["primary", "backup"])
def test_both_brokers_of_a_pair_announce_one_server_id_defaulting_to_namespace_and_name(
    broker: str,
) -> None:
    pod = build_pod(REMOTE, spec({}), broker)  # type: ignore[arg-type]
    assert flags(pod)["server-id"] == "site-b.remote"
    named = build_pod(REMOTE, spec({"serverId": "eu-west"}), broker)  # type: ignore[arg-type]
    assert flags(named)["server-id"] == "eu-west"
    settings = BrokerSettings.model_validate({"name": "x", "server_id": "site-b.remote"})
    assert settings.effective_server_id == "site-b.remote"


def test_no_federation_adds_nothing_to_the_pods() -> None:
    pod = build_pod(REMOTE, spec(None), "primary")
    assert not [a for a in container(pod)["args"] if "server-id" in a or "federation" in a]
    assert not [v for v in pod["spec"]["volumes"] if v["name"].startswith("federation")]
    assert build_federation_config_map(REMOTE, spec(None)) is None


def test_the_federation_file_is_a_config_map_the_broker_accepts_and_passwords_are_files(
    tmp_path: Path,
) -> None:
    wanted = spec(downstream(type="fanout", maxHops=2, upstreamExchange="prices", forward=True))
    config_map = build_federation_config_map(REMOTE, wanted)
    assert config_map is not None and config_map["metadata"]["name"] == "remote-federation"
    text = config_map["data"]["federation.yaml"]
    assert "password" not in yaml.safe_load(text)["upstreams"]["central"]["uri"]
    path = tmp_path / "federation.yaml"
    path.write_text(text)
    loaded = load(path)  # what the broker reads at start-up
    central = loaded.upstreams["central"]
    assert central.uri == "amqp://twinmq-federation@central.site-a.svc:5672/"
    assert str(central.password_file) == f"{federation.PASSWORD_DIR}/central"
    (market,) = loaded.exchanges
    assert (market.type, market.max_hops, market.source_exchange) == ("fanout", 2, "prices")
    assert market.forward
    pod = build_pod(REMOTE, wanted, "primary")
    assert flags(pod)["federation-config"] == f"{federation.CONFIG_DIR}/federation.yaml"
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["federation-config"]["configMap"]["name"] == "remote-federation"
    (secret,) = volumes["federation-passwords"]["projected"]["sources"]
    assert secret["secret"] == {
        "name": "central-login", "items": [{"key": "password", "path": "central"}]
    }  # fmt: skip
    mounts = {m["mountPath"] for m in container(pod)["volumeMounts"]}
    assert {federation.CONFIG_DIR, federation.PASSWORD_DIR} <= mounts
    # Never a password in the environment or on the command line.
    assert not [e for e in container(pod)["env"] if "FEDERATION" in e["name"]]


def test_a_same_namespace_upstream_cluster_defaults_to_its_generated_credentials() -> None:
    fed = Federation.model_validate({
        "upstreams": [{"name": "central", "clusterRef": {"name": "central"}}],
        "exchanges": [{"exchange": "market", "upstream": "central"}],
    })  # fmt: skip
    (upstream,) = fed.upstreams
    ref = federation.password_ref(upstream)
    assert ref is not None and (ref.name, ref.key) == ("central-auth", "federation-password")
    assert (
        federation.upstream_uri(upstream, "site-b")
        == "amqp://twinmq-federation@central.site-b.svc:5672/"
    )


def test_the_global_key_options_reach_the_file_only_when_the_spec_sets_them(
    tmp_path: Path,
) -> None:
    plain = build_federation_config_map(REMOTE, spec(downstream()))
    assert plain is not None
    text = plain["data"]["federation.yaml"]
    # The file a spec without the options had before the broker gained them: an operator
    # upgrade does not roll such a cluster's pods.
    assert yaml.safe_load(text) == {
        "dedup-window": 100000,
        "exchanges": [{"exchange": "market", "forward": False, "max-hops": 1,
                       "prefetch": 256, "type": "topic", "upstream": "central"}],
        "upstreams": {"central": {
            "password-file": f"{federation.PASSWORD_DIR}/central",
            "reconnect-max-seconds": 30.0, "uri": "amqp://twinmq-federation@central.site-a.svc:5672/",
        }},
    }  # fmt: skip
    fed = downstream(type="direct", globalKeys=True, forward=True)
    fed.update(globalKeySeparator=":", statusIntervalSeconds=5)
    config_map = build_federation_config_map(REMOTE, spec(fed))
    assert config_map is not None
    path = tmp_path / "federation.yaml"
    path.write_text(config_map["data"]["federation.yaml"])
    loaded = load(path)
    assert (loaded.global_key_separator, loaded.status_interval_seconds) == (":", 5.0)
    assert loaded.exchanges[0].global_keys
    before = pod_revision(build_pod(REMOTE, spec(downstream()), "primary"))
    after = pod_revision(build_pod(REMOTE, spec(fed), "primary"))
    assert before != after


def test_a_change_of_the_federation_rolls_the_pods_out() -> None:
    before = pod_revision(build_pod(REMOTE, spec(downstream()), "primary"))
    same = pod_revision(build_pod(REMOTE, spec(downstream()), "primary"))
    after = pod_revision(build_pod(REMOTE, spec(downstream(maxHops=3)), "primary"))
    assert before == same and before != after


# -- status, conditions and Events from real brokers ----------------------------------------


def report(broker: BrokerProcess) -> BrokerStatus:
    data = status(broker)
    assert data is not None
    return BrokerStatus.model_validate(data)


def link_state(broker: BrokerProcess) -> str:
    seen = report(broker).federation
    return "" if seen is None or not seen.links else seen.links[0].state


@pytest.fixture
def central(tmp_path: Path) -> Iterator[BrokerProcess]:
    broker = site(tmp_path, "site-a.central")
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


def remote_site(tmp_path: Path, fed: Federation, upstream: BrokerProcess) -> BrokerProcess:
    """A downstream broker run with the file the operator renders (the upstream's URI and
    password file pointed at the test's loopback broker and a file of the test)."""
    password = tmp_path / "central-password"
    password.write_text("guest\n")
    rendered = federation.render(fed, "site-b")
    rendered.upstreams["central"] = rendered.upstreams["central"].model_copy(
        update={"uri": f"amqp://guest@127.0.0.1:{upstream.port}/", "password_file": password}
    )
    path = tmp_path / "federation.yaml"
    path.write_text(yaml.safe_dump(rendered.model_dump(by_alias=True, mode="json")))
    server_id = federation.server_id(fed, "site-b", "remote")
    broker = BrokerProcess(
        tmp_path / "remote" / "data", name="remote",
        extra_args=["--server-id", server_id, "--federation-config", str(path)],
    )  # fmt: skip
    broker.start()
    return broker


def test_the_status_condition_and_events_follow_a_real_link_up_and_down(
    tmp_path: Path, central: BrokerProcess
) -> None:
    fed = Federation.model_validate({
        "upstreams": [{"name": "central", "uri": "amqp://guest@x/",
                       "passwordSecret": {"name": "login"}}],
        "exchanges": [{"exchange": "market", "upstream": "central"}],
    })  # fmt: skip
    assert federation.state_of(None, "site-b", "remote", None) is None
    unknown = federation.state_of(fed, "site-b", "remote", None)
    assert unknown is not None and unknown.links[0].state == "Unknown"
    assert unknown.server_id == "site-b.remote" and unknown.running == "0/1"
    assert federation.events(None, unknown) == []
    remote = remote_site(tmp_path, fed, central)
    try:
        wait_for("the link running", lambda: link_state(remote) == "running", 30)
        up = federation.state_of(fed, "site-b", "remote", report(remote).federation)
        assert up is not None and up.running == "1/1"
        (link,) = up.links
        assert (link.state, link.connected, link.upstream_server_id) == (
            "Running", True, "site-a.central",
        )  # fmt: skip
        assert federation.condition(up) == (
            "Federated", True, "LinksRunning", "1 links running as site-b.remote",
        )  # fmt: skip
        ((kind, reason, _),) = federation.events(unknown, up)
        assert (kind, reason) == ("Normal", "FederationLinkUp")
        assert federation.events(up, up) == []
        # The upstream side: the link queue held there for the downstream, and the
        # link's link-up on its amq.peer (the status's peer counts, a printer column).
        wait_for(
            "the link-up on central's amq.peer",
            lambda: report(central).federation.peer_status_received >= 1,  # type: ignore[union-attr]
        )
        upstream = federation.state_of(Federation(), "site-a", "central",
                                       report(central).federation)  # fmt: skip
        assert upstream is not None and upstream.downstream_queues == 1
        assert upstream.peer_status_received >= 1 and upstream.peer_status_dropped == 0
        assert upstream.peer_status == f"{upstream.peer_status_received}/0"
        assert unknown.peer_status == "0/0"
        assert federation.condition(upstream) == (
            "Federated", True, "UpstreamOnly", "no federated exchange here; serving as "
            "site-a.central",
        )  # fmt: skip
        central.stop()
        wait_for("the link down", lambda: link_state(remote) == "connecting", 30)
        down = federation.state_of(fed, "site-b", "remote", report(remote).federation)
        assert down is not None and down.links[0].message
        ctype, ok, reason, why = federation.condition(down)  # type: ignore[misc]
        assert (ctype, ok, reason) == ("Federated", False, "LinksDown") and "market" in why
        ((kind, reason, message),) = federation.events(up, down)
        assert (kind, reason) == ("Warning", "FederationLinkDown") and "central" in message
    finally:
        remote.stop()


def test_the_link_status_shows_forwarded_messages_and_the_upstream_state_of_a_real_link(
    tmp_path: Path, central: BrokerProcess
) -> None:
    fed = Federation.model_validate({
        "globalKeySeparator": ":",
        "upstreams": [{"name": "central", "uri": "amqp://guest@x/",
                       "passwordSecret": {"name": "login"}}],
        "exchanges": [{"exchange": "market", "upstream": "central", "type": "direct",
                       "forward": True, "globalKeys": True}],
    })  # fmt: skip
    remote = remote_site(tmp_path, fed, central)
    try:
        wait_for("the link running", lambda: link_state(remote) == "running", 30)
        publish_confirmed(remote, "market", [("orders", b"one"), ("orders", b"two")])

        def forwarded() -> int:
            seen = report(remote).federation
            return 0 if seen is None else seen.links[0].messages_forwarded

        wait_for("both forwarded", lambda: forwarded() == 2, 30)
        state = federation.state_of(fed, "site-b", "remote", report(remote).federation)
        assert state is not None
        (link,) = state.links
        assert (link.forwarded, link.forward_pending, link.stale_unbound) == (2, 0, 0)
        # The upstream's replicated state: its epoch and change counter.
        assert link.upstream_epoch is not None and link.upstream_state_seq is not None
        # The separator reached the broker: its server-named queues carry it.
        connection, ch = channel(remote)
        try:
            queue = ch.queue_declare("", exclusive=True).method.queue
        finally:
            connection.close()
        assert queue.startswith("amq.gen-site-b.remote:")
    finally:
        remote.stop()


def test_a_duplicate_server_id_is_refused_with_a_warning_on_both_clusters(
    tmp_path: Path, central: BrokerProcess
) -> None:
    fed = Federation.model_validate({
        "serverId": "site-a.central",  # the upstream's own: a badly configured topology
        "upstreams": [{"name": "central", "uri": "amqp://guest@x/",
                       "passwordSecret": {"name": "login"}}],
        "exchanges": [{"exchange": "market", "upstream": "central"}],
    })  # fmt: skip
    remote = remote_site(tmp_path, fed, central)
    try:
        wait_for("the link refused", lambda: link_state(remote) == "refused", 30)
        refused = federation.state_of(fed, "site-b", "remote", report(remote).federation)
        assert refused is not None and "duplicate server id" in refused.links[0].message
        assert federation.condition(refused)[2] == "PeerRefused"  # type: ignore[index]
        ((kind, reason, _),) = federation.events(None, refused)
        assert (kind, reason) == ("Warning", "FederationPeerRefused")
        upstream_fed = Federation()

        def upstream_state() -> Any:
            return federation.state_of(upstream_fed, "site-a", "central",
                                       report(central).federation)  # fmt: skip

        wait_for("the refusal on the upstream", lambda: upstream_state().refused_peers, 30)
        time.sleep(1.5)  # a retry (1 s backoff) adds a refusal: still one Event
        on_upstream = upstream_state()
        events = federation.events(None, on_upstream)
        assert [e[:2] for e in events] == [("Warning", "FederationPeerRefused")]
        assert "duplicate server id" in events[0][2]
    finally:
        remote.stop()


# -- server ids unique across the operator's BrokerClusters ----------------------------------


def test_the_newer_of_two_clusters_with_one_server_id_gets_a_condition_and_a_warning() -> None:
    ids = federation.ServerIds()
    older = federation.Claim("eu", "2026-11-27T10:00:00Z", "site-a/central")
    newer = federation.Claim("eu", "2026-11-27T11:00:00Z", "site-b/remote")
    assert ids.claim("u-1", older) == ""
    assert ids.claim("u-2", newer) == "site-a/central"
    assert ids.claim("u-1", older) == ""  # the older one keeps its id, unwarned
    assert ids.claim("u-3", federation.Claim("us", "2026-11-27T12:00:00Z", "x/y")) == ""
    fed = Federation.model_validate({"serverId": "eu"})
    state = federation.state_of(fed, "site-b", "remote", None)
    assert state is not None
    state.duplicate_of = ids.claim("u-2", newer)
    ctype, ok, reason, message = federation.condition(state)  # type: ignore[misc]
    assert (ctype, ok, reason) == ("Federated", False, "DuplicateServerId")
    assert "site-a/central" in message and "serverId" in message
    ((kind, reason, _),) = federation.events(None, state)
    assert (kind, reason) == ("Warning", "DuplicateServerId")
    assert federation.events(state, state) == []  # once, not at every pass
    ids.forget("u-1")  # the older cluster deleted: the id is the newer one's now
    assert ids.claim("u-2", newer) == ""


def test_a_defaulted_server_id_counts_and_a_cluster_leaving_federation_frees_its_id() -> None:
    ids = federation.ServerIds()
    # site-a/remote by default is site-a.remote; another cluster names it explicitly.
    default, named = Federation(), Federation.model_validate({"serverId": "site-a.remote"})
    first = federation.state_of(default, "site-a", "remote", None)
    second = federation.state_of(named, "site-b", "other", None)
    assert first is not None and second is not None
    federation.check_server_id(
        ids, default, first, "u-1", "site-a", "remote", "2026-01-01T00:00:00Z"
    )
    federation.check_server_id(ids, named, second, "u-2", "site-b", "other", "2026-01-02T00:00:00Z")
    assert (first.duplicate_of, second.duplicate_of) == ("", "site-a/remote")
    federation.check_server_id(ids, None, None, "u-1", "site-a", "remote", "2026-01-01T00:00:00Z")
    federation.check_server_id(ids, named, second, "u-2", "site-b", "other", "2026-01-02T00:00:00Z")
    assert second.duplicate_of == ""


# -- the CRD's rules on a real API server ----------------------------------------------------


@pytest.fixture(scope="module")
def crd_kube(kube_apiserver: Any) -> Kube:
    api = Kube(str(kube_apiserver.kubeconfig))
    install_crd(api)

    return api


def create(api: Kube, name: str, fed: dict[str, Any]) -> None:
    api.apply({
        "apiVersion": f"{GROUP}/{VERSION}", "kind": KIND,
        "metadata": {"name": name, "namespace": "default"}, "spec": {"federation": fed},
    })  # fmt: skip


UP = {"name": "central", "clusterRef": {"name": "central"}}


@pytest.mark.parametrize(
    ("fed", "message"),
    [
        ({"upstreams": [UP, UP]}, "each upstream name appears once"),
        (
            {"upstreams": [UP], "exchanges": [{"exchange": "m", "upstream": "central"}] * 2},
            "each exchange is federated once",
        ),
        (
            {"upstreams": [UP], "exchanges": [{"exchange": "m", "upstream": "elsewhere"}]},
            "every federated exchange names one of spec.federation.upstreams",
        ),
        ({"upstreams": [{"name": "central"}]}, "names a clusterRef or a uri, not both"),
        (
            {
                "upstreams": [
                    {"name": "c", "uri": "amqp://u:pw@h/", "passwordSecret": {"name": "s"}}
                ]
            },
            "must not carry a password",
        ),
        (
            {"upstreams": [{"name": "c", "clusterRef": {"name": "c", "namespace": "other"}}]},
            "passwordSecret is required",
        ),
        ({"upstreams": [{"name": "c", "uri": "amqp://u@h/"}]}, "passwordSecret is required"),
        ({"serverId": "a b"}, "spec.federation.serverId"),
        (
            {
                "upstreams": [UP],
                "exchanges": [
                    {"exchange": "m", "upstream": "central", "type": "fanout", "globalKeys": True}
                ],
            },
            "globalKeys needs a direct or topic exchange",
        ),
        ({"globalKeySeparator": "a/b"}, "spec.federation.globalKeySeparator"),
        ({"statusIntervalSeconds": -1}, "spec.federation.statusIntervalSeconds"),
        (
            {"upstreams": [UP], "exchanges": [{"exchange": "a b", "upstream": "central"}]},
            "spec.federation.exchanges[0].exchange",
        ),
    ],
)
def test_the_crd_refuses_a_bad_federation_with_a_clear_message(
    crd_kube: Kube, fed: dict[str, Any], message: str
) -> None:
    with pytest.raises(Refused) as refused:
        create(crd_kube, "bad", fed)
    assert message in str(refused.value)


def test_the_crd_accepts_a_downstream_and_an_upstream_only_section(crd_kube: Kube) -> None:
    create(crd_kube, "remote", {
        "upstreams": [UP, {"name": "other", "uri": "amqp://fed@other.example:5672/",
                           "passwordSecret": {"name": "other-login", "key": "pw"}}],
        "exchanges": [{"exchange": "market", "upstream": "central"},
                      {"exchange": "orders", "upstream": "other", "type": "direct",
                       "globalKeys": True}],
        "globalKeySeparator": ":", "statusIntervalSeconds": 0,
    })  # fmt: skip
    create(crd_kube, "central", {})
    found = crd_kube.get(f"{GROUP}/{VERSION}", KIND, "default", "remote")
    assert found is not None
    spec_seen = BrokerClusterSpec.model_validate(found["spec"])
    assert spec_seen.federation is not None
    assert spec_seen.federation.exchanges[1].max_hops == 1  # defaults filled in
    assert spec_seen.federation.exchanges[1].global_keys
    assert (spec_seen.federation.global_key_separator,
            spec_seen.federation.status_interval_seconds) == (":", 0)  # fmt: skip
