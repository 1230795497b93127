"""spec.federation in virtual hosts: a federated exchange's `vhost` and `upstreamVhost`
reach the brokers' federation file, and the CRD's rules on a real API server
(docs/operator.md, docs/federation.md "Virtual hosts")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from apiserver import install_crd

from twinmq.broker.federation.config import load
from twinmq.operator import federation as operator_federation
from twinmq.operator.builders import ClusterRef, build_federation_config_map
from twinmq.operator.kube import Kube, Refused
from twinmq.operator.models import (
    GROUP,
    KIND,
    VERSION,
    BrokerClusterSpec,
    FederationLinkState,
    FederationState,
)

REMOTE = ClusterRef(name="remote", namespace="site-b", uid="u-2")
UP = {"name": "central", "clusterRef": {"name": "central"}}


@pytest.fixture(scope="module")
def crd_kube(kube_apiserver: Any) -> Kube:
    """A real API server with the BrokerCluster CRD as generated (regenerated for vhosts)."""
    api = Kube(str(kube_apiserver.kubeconfig))
    install_crd(api)
    return api


def federation(*exchanges: dict[str, Any]) -> dict[str, Any]:
    return {"upstreams": [UP], "exchanges": list(exchanges)}


def create(api: Kube, name: str, fed: dict[str, Any]) -> None:
    api.apply({
        "apiVersion": f"{GROUP}/{VERSION}", "kind": KIND,
        "metadata": {"name": name, "namespace": "default"}, "spec": {"federation": fed},
    })  # fmt: skip


def test_the_vhosts_of_a_federated_exchange_reach_the_file_the_broker_reads(
    tmp_path: Path,
) -> None:
    fed = federation(
        {"exchange": "market", "upstream": "central", "vhost": "tenant-a"},
        {"exchange": "market", "upstream": "central"},
        {"exchange": "prices", "upstream": "central", "vhost": "tenant-a",
         "upstreamVhost": "shared"},
    )  # fmt: skip
    config_map = build_federation_config_map(REMOTE, BrokerClusterSpec.model_validate(
        {"federation": fed}
    ))  # fmt: skip
    assert config_map is not None
    path = tmp_path / "federation.yaml"
    path.write_text(config_map["data"]["federation.yaml"])
    loaded = load(path)
    upstream = loaded.upstreams["central"]
    seen = [(e.vhost, e.exchange, e.source_vhost(upstream)) for e in loaded.exchanges]
    assert seen == [
        ("tenant-a", "market", "tenant-a"), ("/", "market", "/"),
        ("tenant-a", "prices", "shared"),
    ]  # fmt: skip


def test_the_crd_accepts_one_exchange_name_in_two_vhosts(crd_kube: Kube) -> None:
    create(crd_kube, "tenants", federation(
        {"exchange": "market", "upstream": "central"},
        {"exchange": "market", "upstream": "central", "vhost": "tenant-a",
         "upstreamVhost": "tenant-b"},
        # One exchange upstream, in two upstream vhosts: two link queues.
        {"exchange": "prices", "upstream": "central", "vhost": "tenant-a"},
        {"exchange": "prices", "upstream": "central", "vhost": "tenant-b"},
    ))  # fmt: skip
    # A uri naming a vhost decides for the exchanges that name none upstream (here `t2` for
    # `market` and `t1` for `orders`: two link queues), which the CRD leaves to the broker.
    other = {
        "name": "other",
        "uri": "amqp://fed@other.example/t2",
        "passwordSecret": {"name": "other-login"},
    }
    create(crd_kube, "by-uri", {"upstreams": [other], "exchanges": [
        {"exchange": "market", "upstream": "other", "vhost": "t1"},
        {"exchange": "orders", "upstream": "other", "vhost": "t5", "upstreamVhost": "t1",
         "upstreamExchange": "market"},
    ]})  # fmt: skip
    found = crd_kube.get(f"{GROUP}/{VERSION}", KIND, "default", "tenants")
    assert found is not None
    spec = BrokerClusterSpec.model_validate(found["spec"])
    assert spec.federation is not None
    assert [e.vhost for e in spec.federation.exchanges] == [
        None, "tenant-a", "tenant-a", "tenant-b"
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("exchanges", "message"),
    [
        (
            [{"exchange": "m", "upstream": "central", "vhost": "t"},
             {"exchange": "m", "upstream": "central", "vhost": "t"}],
            "each exchange is federated once (per vhost)",
        ),
        (
            # `/` spelled out is the default's vhost.
            [{"exchange": "m", "upstream": "central"},
             {"exchange": "m", "upstream": "central", "vhost": "/"}],
            "each exchange is federated once (per vhost)",
        ),
        (
            # Both from central's `t` vhost, exchange `m`: one link queue for two.
            [{"exchange": "m", "upstream": "central", "vhost": "t"},
             {"exchange": "n", "upstream": "central", "upstreamExchange": "m",
              "upstreamVhost": "t"}],
            "they would share one link queue",
        ),
        ([{"exchange": "m", "upstream": "central", "vhost": ""}], "exchanges[0].vhost"),
        ([{"exchange": "m", "upstream": "central", "upstreamVhost": ""}],
         "exchanges[0].upstreamVhost"),
    ],
)  # fmt: skip
def test_the_crd_refuses_a_vhost_federated_twice_or_empty(
    crd_kube: Kube, exchanges: list[dict[str, Any]], message: str
) -> None:
    with pytest.raises(Refused) as refused:
        create(crd_kube, "bad", federation(*exchanges))
    assert message in str(refused.value)


def test_the_status_holds_two_links_of_one_exchange_name_in_two_vhosts(crd_kube: Kube) -> None:
    """status.federation.links is a list-map keyed by exchange and vhost: the active
    broker's report of `market` in `/` and in `tenant-a` is written whole (keyed by the
    exchange alone, the API server refused it as a duplicate entry)."""
    create(crd_kube, "two-links", federation(
        {"exchange": "market", "upstream": "central"},
        {"exchange": "market", "upstream": "central", "vhost": "tenant-a"},
    ))  # fmt: skip
    resource = crd_kube.dynamic.resources.get(api_version=f"{GROUP}/{VERSION}", kind=KIND)
    links = [
        {"exchange": "market", "upstream": "central", "state": "Running"},
        {"exchange": "market", "vhost": "tenant-a", "upstream": "central", "state": "Connecting"},
    ]
    resource.status.patch(
        body={"status": {"federation": {"links": links}}}, name="two-links",
        namespace="default", content_type="application/merge-patch+json",
    )  # fmt: skip
    found = crd_kube.get(f"{GROUP}/{VERSION}", KIND, "default", "two-links")
    assert found is not None
    seen = [(link["vhost"], link["state"]) for link in found["status"]["federation"]["links"]]
    assert seen == [("/", "Running"), ("tenant-a", "Connecting")]


def test_events_name_the_vhost_of_a_link_outside_root() -> None:
    old = FederationState(links=[
        FederationLinkState(exchange="market", upstream="central", state="Running"),
        FederationLinkState(exchange="market", vhost="tenant-a", upstream="central",
                            state="Running"),
    ])  # fmt: skip
    new = old.model_copy(update={"links": [
        old.links[0],
        old.links[1].model_copy(update={"state": "Connecting", "message": "cut"}),
    ]})  # fmt: skip
    assert operator_federation.events(old, new) == [
        ("Warning", "FederationLinkDown",
         "market (vhost tenant-a): the link from central is down: cut"),
    ]  # fmt: skip
