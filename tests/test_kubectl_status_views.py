"""`kubectl twinmq mirror status` and `federation status` (issues 14, 15) against a real API
server: each BrokerCluster's status is what the operator would write (its own functions,
`operator/mirroring.py` and `operator/federation.py`, from a broker's `GET /status` report),
written through the status subresource (so it survives the CRD's schema), then read back
by the plugin as kubectl runs it."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from twinmq.broker.api import (
    FederationLinkStatus,
    FederationStatus,
    MirrorRole,
    MirrorStatus,
    MirrorUnmirrored,
)
from twinmq.cli.kubectl import FEDERATION_COLUMNS, MIRROR_COLUMNS, run
from twinmq.operator import federation, mirroring
from twinmq.operator.kube import Kube
from twinmq.operator.models import GROUP, KIND, VERSION, BrokerClusterSpec

API_VERSION = f"{GROUP}/{VERSION}"
MIRROR_NS, FED_NS, PLAIN_NS = "kstatus-dr", "kstatus-fed", "kstatus-plain"


def cluster(api: Kube, namespace: str, name: str, spec: dict[str, Any]) -> BrokerClusterSpec:
    """A BrokerCluster in its own namespace (as the CRD accepts it)."""
    api.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    api.apply({"apiVersion": API_VERSION, "kind": KIND,
               "metadata": {"name": name, "namespace": namespace}, "spec": spec})  # fmt: skip
    return BrokerClusterSpec.model_validate(spec)


def write_status(api: Kube, namespace: str, name: str, status: dict[str, Any]) -> None:
    """Merge `status` into the cluster's status subresource, as the operator writes it."""
    clusters = api.dynamic.resources.get(api_version=API_VERSION, kind=KIND)
    clusters.status.patch(body={"status": status}, name=name, namespace=namespace,
                          content_type="application/merge-patch+json")  # fmt: skip


def plugin(kubeconfig: Path, *argv: str) -> str:
    """The plugin's standard output (it must succeed)."""
    out, err = io.StringIO(), io.StringIO()
    assert run([*argv, "--kubeconfig", str(kubeconfig)], out, err) == 0, err.getvalue()
    return out.getvalue()


def mirror_report(role: MirrorRole, epoch: int, **more: Any) -> MirrorStatus:
    """A broker's `GET /status` `mirror`, as the active of a site reports it."""
    return MirrorStatus(enabled=role == "source", role=role, epoch=epoch,
                        state="connected" if role == "source" else "disabled",
                        connected=role == "source", **more)  # fmt: skip


def test_mirror_status_shows_what_a_forced_failover_lost_and_kept_on_the_old_source(
    api: Kube, kube_apiserver: Any
) -> None:
    kubeconfig = kube_apiserver.kubeconfig
    old_spec = cluster(api, MIRROR_NS, "site-a", {"mirror": {"role": "source",
                       "secretName": "dr", "target": {"host": "site-b.example.com"}}})  # fmt: skip
    new_spec = cluster(api, MIRROR_NS, "site-b", {"mirror": {"role": "replica",
                       "secretName": "dr"}})  # fmt: skip
    # Before: site-a the source, site-b its replica; nothing lost, nothing under the table.
    for name, spec, report in (
        ("site-a", old_spec, mirror_report("source", 1)),
        ("site-b", new_spec, mirror_report("replica", 1)),
    ):
        state = mirroring.state_of(spec.mirror, report)
        assert state is not None
        write_status(api, MIRROR_NS, name, {"mirror": state.model_dump(by_alias=True)})
    before = plugin(kubeconfig, "mirror", "status", "-n", MIRROR_NS).splitlines()
    assert before[0].split() == list(MIRROR_COLUMNS)
    assert [line.split()[0] for line in before[1:]] == ["site-a", "site-b"]

    # site-b took over by force; site-a came back, reversed to a replica and re-seeded: it
    # counted what site-b never got, 3 messages site-b claimed to hold but whose seed did
    # not show them kept unverified, and 8 messages moved to its orphan queue.
    lost = MirrorUnmirrored(promoted="site-b", applied_seq=40, events=7, messages=5,
                            settles=2, counted_at=1.0, unverified_events=1,
                            unverified_messages=3, epoch=2)  # fmt: skip
    state = mirroring.state_of(
        old_spec.mirror, mirror_report("replica", 2, orphans=8, unmirrored=lost)
    )
    assert state is not None
    write_status(api, MIRROR_NS, "site-a", {"mirror": state.model_dump(by_alias=True)})

    lines = plugin(kubeconfig, "mirror", "status", "-n", MIRROR_NS).splitlines()
    assert lines[1].split()[:3] == ["site-a", "replica", "Listening"]
    assert lines[3:] == [
        "",
        "site-a: 5 messages and 2 settles (7 events after event 40) never reached site-b, "
        "which took over by force; 3 more messages it claims to hold were not found in its "
        "seed and are kept here; 8 orphaned messages kept in amq.twinmq.mirror-orphans",
    ]
    # Across namespaces the line names the namespace too; as JSON the status is whole.
    everywhere = plugin(kubeconfig, "mirror", "status", "-A").splitlines()
    assert f"{MIRROR_NS}/site-a: 5 messages and 2 settles" in everywhere[-1]
    as_json = plugin(kubeconfig, "mirror", "status", "site-a", "-n", MIRROR_NS, "-o", "json")
    assert '"orphans": 8' in as_json and "3 more messages" in as_json
    # site-b, forced on a full disk: its seed is not durable, its clients are refused.
    pending = mirror_report("source", 2, seed_pending="its seed for the old source is not "
                            "durable yet")  # fmt: skip
    state = mirroring.state_of(new_spec.mirror, pending)
    assert state is not None
    write_status(api, MIRROR_NS, "site-b", {"mirror": state.model_dump(by_alias=True)})
    lines = plugin(kubeconfig, "mirror", "status", "-n", MIRROR_NS).splitlines()
    assert "site-b: clients refused: its seed for the old source is not durable yet" in lines


def federation_spec(*vhosts: str | None) -> dict[str, Any]:
    """A downstream federating `market` from `central`, once per vhost given (None: `/`,
    the default, left unset)."""
    exchanges = [{"exchange": "market", "upstream": "central",
                  **({"vhost": v} if v is not None else {})} for v in vhosts]  # fmt: skip
    upstreams = [{"name": "central", "uri": "amqp://fed@central.example.com:5672/",
                  "passwordSecret": {"name": "central-login"}}]  # fmt: skip
    return {"federation": {"upstreams": upstreams, "exchanges": exchanges}}


def running_link(vhost: str, received: int) -> FederationLinkStatus:
    """A link of `market` in `vhost`, running, as the downstream's active reports it."""
    return FederationLinkStatus(
        exchange="market", vhost=vhost, upstream_vhost=vhost, upstream="central",
        uri="amqp://fed@central.example.com:5672/", upstream_exchange="market",
        queue=f"federation: market -> {vhost}", state="running", bindings=1,
        local_bindings=2, messages_received=received,
    )  # fmt: skip


def test_federation_status_shows_each_links_vhost_and_keeps_a_slash_only_listing_as_it_was(
    api: Kube, kube_apiserver: Any
) -> None:
    kubeconfig = kube_apiserver.kubeconfig
    # Two tenants' exchanges of one name: two links, told apart by their vhost.
    spec = cluster(api, FED_NS, "orders", federation_spec(None, "tenant-a"))
    links = [running_link("/", 10), running_link("tenant-a", 20)]
    seen = FederationStatus(server_id="eu.orders", links=links)
    state = federation.state_of(spec.federation, FED_NS, "orders", seen)
    assert state is not None
    write_status(api, FED_NS, "orders", {"federation": state.model_dump(by_alias=True)})
    header, *rows = plugin(kubeconfig, "federation", "status", "-n", FED_NS).splitlines()
    at = FEDERATION_COLUMNS.index("EXCHANGE") + 1
    assert header.split() == [*FEDERATION_COLUMNS[:at], "VHOST", *FEDERATION_COLUMNS[at:]]
    assert [row.split()[:7] for row in rows] == [
        ["orders", "eu.orders", "market", "/", "central", "Running", "1/2"],
        ["orders", "eu.orders", "market", "tenant-a", "central", "Running", "1/2"],
    ]
    assert [row.split()[7] for row in rows] == ["10", "20"]

    # Not seen yet: the links the spec declares, with their vhosts.
    cluster(api, FED_NS, "shop", federation_spec("tenant-b"))
    shop = plugin(kubeconfig, "federation", "status", "shop", "-n", FED_NS).splitlines()
    assert shop[1].split()[:6] == ["shop", f"{FED_NS}.shop", "market", "tenant-b", "central",
                                   "Unknown"]  # fmt: skip

    # Links only in `/`: no VHOST column, the listing as it always was.
    plain_spec = cluster(api, PLAIN_NS, "orders", federation_spec(None))
    seen = FederationStatus(server_id="us.orders", links=[running_link("/", 5)])
    state = federation.state_of(plain_spec.federation, PLAIN_NS, "orders", seen)
    assert state is not None
    write_status(api, PLAIN_NS, "orders", {"federation": state.model_dump(by_alias=True)})
    header, row = plugin(kubeconfig, "federation", "status", "-n", PLAIN_NS).splitlines()
    assert header.split() == list(FEDERATION_COLUMNS)
    assert row.split()[:7] == ["orders", "us.orders", "market", "central", "Running", "1/2", "5"]
