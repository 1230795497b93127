"""spec.mirror on Kubernetes: the brokers' settings, the virtual IP's mirror port, the status."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from apiserver import install_crd
from mirrorsites import Ring, Sites, depth, mirror_status, publish, queues
from pydantic import ValidationError

from twinmq.broker.api import DemotionToken, MirrorStatus, MirrorUnmirrored
from twinmq.broker.names import MIRROR_PORT, setting_env
from twinmq.broker.settings import BrokerSettings
from twinmq.operator.builders import ClusterRef, build_pod, build_vip_service
from twinmq.operator.kube import Kube, Refused
from twinmq.operator.mirroring import condition, events, state_of, switch_requests
from twinmq.operator.models import (
    GROUP,
    KIND,
    VERSION,
    BrokerClusterSpec,
    HandledRequests,
    Mirror,
    MirrorState,
    Requests,
)
from twinmq.testing.launcher import BrokerProcess
from twinmq.testing.waiting import wait_for

SOURCE = ClusterRef(name="orders", namespace="site-a", uid="u-1")
REPLICA = ClusterRef(name="orders", namespace="site-b", uid="u-2")
TARGET = {"host": "orders.site-b.svc", "port": MIRROR_PORT}


def spec(mirror: dict[str, Any]) -> BrokerClusterSpec:
    return BrokerClusterSpec.model_validate({"mirror": mirror})


def env_of(pod: dict[str, Any]) -> dict[str, Any]:
    (container,) = pod["spec"]["containers"]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def settings_from(env: dict[str, Any], token: str = "t") -> BrokerSettings:
    """What the broker makes of the pod's mirror variables (the Secret read as `token`)."""
    values = {k: (token if isinstance(v, dict) else v) for k, v in env.items()
              if k.startswith("TWINMQ_MIRROR_")}  # fmt: skip
    fields = {k.removeprefix("TWINMQ_").lower(): v for k, v in values.items()}
    return BrokerSettings.model_validate(fields)


@pytest.mark.parametrize("broker", ["primary", "backup"])
def test_a_source_mirrors_to_its_target_with_the_token_of_its_secret(broker: str) -> None:
    source = spec({"role": "source", "target": TARGET, "secretName": "dr", "maxLagSeconds": 5})
    env = env_of(build_pod(SOURCE, source, broker))  # type: ignore[arg-type]
    assert env[setting_env("mirror_to")] == f"orders.site-b.svc:{MIRROR_PORT}"
    assert env[setting_env("mirror_token")] == {
        "secretKeyRef": {"name": "dr", "key": "mirror-token"}
    }
    assert env[setting_env("mirror_id")] == "site-a/orders"
    settings = settings_from(env)
    # Both ends on every site (the role says which runs): a switchover can reverse them.
    assert (settings.mirror_to, settings.mirror_port, settings.mirror_role) == (
        f"orders.site-b.svc:{MIRROR_PORT}", MIRROR_PORT, "source",
    )  # fmt: skip
    assert settings.mirror_max_lag == 5.0
    assert {"name": "mirror", "port": MIRROR_PORT, "targetPort": "mirror"} in build_vip_service(
        SOURCE, source.mirror
    )["spec"]["ports"]


def test_a_replica_listens_on_the_mirror_port_behind_its_virtual_ip() -> None:
    replica = spec({"role": "replica", "secretName": "dr"})
    pod = build_pod(REPLICA, replica, "primary")
    env = env_of(pod)
    assert setting_env("mirror_to") not in env  # not switchable: it names no source
    assert settings_from(env).mirror_port == MIRROR_PORT
    switchable = spec({"role": "replica", "secretName": "dr", "target": TARGET})
    settings = settings_from(env_of(build_pod(REPLICA, switchable, "primary")))
    assert (settings.mirror_role, settings.mirror_to) == ("replica", "orders.site-b.svc:5674")
    (container,) = pod["spec"]["containers"]
    assert {"name": "mirror", "containerPort": MIRROR_PORT} in container["ports"]
    ports = build_vip_service(REPLICA, replica.mirror)["spec"]["ports"]
    assert {"name": "mirror", "port": MIRROR_PORT, "targetPort": "mirror"} in ports


def test_no_mirror_adds_nothing() -> None:
    env = env_of(build_pod(SOURCE, BrokerClusterSpec(), "primary"))
    assert not [name for name in env if name.startswith("TWINMQ_MIRROR")]


def test_a_mirror_without_its_secret_or_role_is_refused() -> None:
    with pytest.raises(ValidationError):
        Mirror.model_validate({"role": "source", "target": TARGET})
    with pytest.raises(ValidationError):
        Mirror.model_validate({"role": "both", "secretName": "dr"})


def test_the_status_says_connected_lag_and_backlog_from_the_active() -> None:
    source = spec({"role": "source", "target": TARGET, "secretName": "dr"}).mirror
    seen = MirrorStatus(
        enabled=True,
        role="source",
        state="connected",
        connected=True,
        target="orders.site-b.svc:5674",
        queue_events=12,
        queue_bytes=3400,
        oldest_event_age_seconds=0.25,
    )
    state = state_of(source, seen)
    assert state is not None
    assert (state.state, state.queue_events, state.lag_seconds) == ("Connected", 12, 0.25)
    cut = seen.model_copy(update={"connected": False, "state": "connecting", "link_error": "no"})
    assert state_of(source, cut).state == "Disconnected"  # type: ignore[union-attr]
    assert state_of(source, cut).message == "no"  # type: ignore[union-attr]
    dropped = seen.model_copy(update={"state": "needs-resync", "needs_resync": "past 10 events"})
    assert state_of(source, dropped).state == "NeedsResync"  # type: ignore[union-attr]
    # After a switchover the site is a replica, whatever the spec first said.
    switched = MirrorStatus(enabled=False, role="replica", listening=True, sources_connected=1)
    assert state_of(source, switched).role == "replica"  # type: ignore[union-attr]
    assert state_of(source, None).state == "Unknown"  # type: ignore[union-attr]
    replica = spec({"role": "replica", "secretName": "dr"}).mirror
    listening = MirrorStatus(enabled=False, listening=True, sources_connected=0)
    assert state_of(replica, listening).state == "Listening"  # type: ignore[union-attr]
    linked = listening.model_copy(update={"sources_connected": 1})
    assert state_of(replica, linked).state == "Connected"  # type: ignore[union-attr]
    assert state_of(None, seen) is None


def test_the_mirroring_condition_and_events_follow_the_links_state() -> None:
    up = MirrorState(role="source", state="Connected", target="orders.site-b.svc:5674")
    down = up.model_copy(update={"state": "Disconnected", "message": "connection refused"})
    assert condition(None) is None
    assert condition(up) == ("Mirroring", True, "Connected", "the source's link is up")
    assert condition(down) == ("Mirroring", False, "Disconnected", "connection refused")
    assert events(None, MirrorState(role="source")) == []  # nothing heard yet: no Event
    assert events(up, up) == []
    ((kind, reason, message),) = events(up, down)
    assert (kind, reason) == ("Warning", "MirrorDisconnected") and "connection refused" in message
    ((kind, reason, _),) = events(down, up)
    assert (kind, reason) == ("Normal", "MirrorConnected")
    resync = up.model_copy(update={"state": "NeedsResync", "message": "past 10 events"})
    assert events(up, resync)[0][:2] == ("Warning", "MirrorNeedsResync")
    orphaned = up.model_copy(update={"orphans": 4})
    ((kind, reason, message),) = events(up, orphaned)
    assert (kind, reason) == ("Warning", "MirrorOrphans") and message.startswith("4 messages")
    assert events(orphaned, orphaned) == []
    lost = MirrorUnmirrored(promoted="site-b", applied_seq=40, events=7, messages=5,
                            settles=2, counted_at=0.0)  # fmt: skip
    seen = MirrorStatus(enabled=False, role="replica", listening=True, unmirrored=lost)
    back = state_of(spec({"role": "source", "target": TARGET, "secretName": "dr"}).mirror, seen)
    assert back is not None and back.unmirrored.startswith("5 messages and 2 settles")
    assert "never reached site-b" in back.unmirrored
    ((kind, reason, message),) = events(up, back.model_copy(update={"state": "Connected"}))
    assert (kind, reason) == ("Warning", "MirrorUnmirrored") and "5 messages" in message
    assert events(back, back) == []
    doubted = lost.model_copy(update={"unverified_events": 1, "unverified_messages": 3})
    seen = seen.model_copy(update={"unmirrored": doubted})
    back = state_of(spec({"role": "source", "target": TARGET, "secretName": "dr"}).mirror, seen)
    assert back is not None and "3 more messages it claims to hold" in back.unmirrored


def test_a_forced_promotion_whose_seed_is_not_durable_is_shown_and_announced() -> None:
    seen = MirrorStatus(enabled=True, role="source", listening=False,
                        seed_pending="its seed for the old source is not durable yet")  # fmt: skip
    pending = state_of(spec({"role": "source", "target": TARGET, "secretName": "dr"}).mirror, seen)
    assert pending is not None and pending.seed_pending.startswith("its seed")
    before = pending.model_copy(update={"seed_pending": ""})
    ((kind, reason, message),) = events(before, pending)
    assert (kind, reason) == ("Warning", "MirrorSeedPending") and "refused" in message
    assert events(pending, pending) == []
    ((kind, reason, _),) = events(pending, before)
    assert (kind, reason) == ("Normal", "MirrorSeeded")


# -- bidirectional sites: two, or a ring of three ----------------------------------------------

RING = ["site-a", "site-b", "site-c"]


def bidirectional(namespace: str, ring: list[str] = RING) -> BrokerClusterSpec:
    """The spec of `orders` in `namespace`: bidirectional, mirroring to the next site."""
    after = ring[(ring.index(namespace) + 1) % len(ring)]
    return spec({"role": "bidirectional", "secretName": "dr",
                 "target": {"host": f"orders.{after}.svc"}})  # fmt: skip


@pytest.mark.parametrize("ring", [RING[:2], RING], ids=["two-sites", "ring-of-three"])
def test_bidirectional_sites_run_both_ends_each_mirroring_to_the_next(ring: list[str]) -> None:
    origins = set()
    for i, namespace in enumerate(ring):
        ref = ClusterRef(name="orders", namespace=namespace, uid=f"u-{i}")
        site = bidirectional(namespace, ring)
        for broker in ("primary", "backup"):
            settings = settings_from(env_of(build_pod(ref, site, broker)))  # type: ignore[arg-type]
            after = ring[(i + 1) % len(ring)]
            assert (settings.mirror_role, settings.mirror_to, settings.mirror_port) == (
                "bidirectional", f"orders.{after}.svc:{MIRROR_PORT}", MIRROR_PORT,
            )  # fmt: skip
            assert settings.mirror_first_role == "bidirectional"
            origins.add(settings.mirror_id)
        ports = build_vip_service(ref, site.mirror)["spec"]["ports"]
        assert {"name": "mirror", "port": MIRROR_PORT, "targetPort": "mirror"} in ports
    # One origin per site (both brokers of a pair share it), distinct across the ring.
    assert origins == {f"{namespace}/orders" for namespace in ring}


def test_a_bidirectional_sites_status_shows_both_directions_from_real_brokers(
    tmp_path: Path,
) -> None:
    """A ring of three real bidirectional sites, read as the operator reads them: each
    site's outgoing link and incoming one are Connected; a site stopped shows on the next
    site as its incoming direction Listening (condition False, a Warning Event), and on
    the site before it as its outgoing link Disconnected."""
    mirrors = {name: bidirectional(name).mirror for name in RING}

    def state(site: BrokerProcess) -> MirrorState:
        seen = mirror_status(site)
        got = state_of(mirrors[site.name], MirrorStatus.model_validate(seen) if seen else None)
        assert got is not None
        return got

    assert state_of(mirrors["site-a"], None) == MirrorState(role="bidirectional",
                                                             inbound="Unknown")  # fmt: skip
    with Ring(tmp_path, 3) as ring:
        a, b, c = ring.sites
        wait_for("every site linked both ways",
                 lambda: all(state(s).inbound == "Connected" for s in ring.sites))  # fmt: skip
        up = {s.name: state(s) for s in ring.sites}
        for seen in up.values():
            assert (seen.role, seen.state, seen.inbound) == (
                "bidirectional", "Connected", "Connected",
            )  # fmt: skip
            assert condition(seen) == ("Mirroring", True, "Connected", "both directions are up")
        publish(a, "orders", [b"from-a"])
        ring.caught_up()
        assert depth(c, "orders") == 1  # A -> B -> C: the ring passes it on
        b.stop()
        wait_for("site-c's incoming direction down", lambda: state(c).inbound == "Listening")
        wait_for("site-a's link down", lambda: state(a).state == "Disconnected")
        lost = state(c)
        assert condition(lost)[:3] == ("Mirroring", False, "InboundListening")  # type: ignore[index]
        assert [e[:2] for e in events(up["site-c"], lost)] == [
            ("Warning", "MirrorInboundListening")
        ]
        assert [e[:2] for e in events(up["site-a"], state(a))] == [
            ("Warning", "MirrorDisconnected")
        ]
        assert [e[:2] for e in events(lost, up["site-c"])] == [("Normal", "MirrorInboundConnected")]


def test_a_declared_switchover_of_a_bidirectional_site_is_refused_once(tmp_path: Path) -> None:
    with Ring(tmp_path, 2) as ring:
        handled, seen = HandledRequests(), MirrorState(role="bidirectional")
        ((kind, reason, message),) = handle(
            {"mirrorDemote": {"id": "d-1"}}, handled, seen, ring.sites[0]
        )
        assert (kind, reason, handled.mirror_demote) == ("Warning", "MirrorDemoteRefused", "d-1")
        assert "bidirectional" in message
        publish(ring.sites[0], "orders", [b"still-writable"])


# -- the CRD's rules on a real API server ----------------------------------------------------


@pytest.fixture(scope="module")
def crd_kube(kube_apiserver: Any) -> Kube:
    api = Kube(str(kube_apiserver.kubeconfig))
    install_crd(api)
    return api


def apply_mirror(api: Kube, name: str, mirror: dict[str, Any]) -> None:
    api.apply({
        "apiVersion": f"{GROUP}/{VERSION}", "kind": KIND,
        "metadata": {"name": name, "namespace": "default"}, "spec": {"mirror": mirror},
    })  # fmt: skip


def test_the_crd_refuses_a_bidirectional_site_without_target_and_a_change_of_mode(
    crd_kube: Kube,
) -> None:
    with pytest.raises(Refused) as refused:
        apply_mirror(crd_kube, "no-target", {"role": "bidirectional", "secretName": "dr"})
    assert "a mirror source or bidirectional site names its target" in str(refused.value)
    both = {"role": "bidirectional", "secretName": "dr", "target": TARGET}
    apply_mirror(crd_kube, "both-ways", both)
    with pytest.raises(Refused) as refused:
        apply_mirror(crd_kube, "both-ways", {**both, "role": "source"})
    assert "cannot change to or from bidirectional" in str(refused.value)
    one_way = {"role": "replica", "secretName": "dr", "target": TARGET}
    apply_mirror(crd_kube, "one-way", one_way)
    with pytest.raises(Refused):
        apply_mirror(crd_kube, "one-way", {**one_way, "role": "bidirectional"})
    apply_mirror(crd_kube, "one-way", {**one_way, "role": "source"})  # a one-way edit passes
    apply_mirror(crd_kube, "both-ways", {**both, "maxLagSeconds": 5})  # so does any other


def test_the_crd_refuses_a_cross_site_audit_store_without_a_mirror_or_outside_s3(
    crd_kube: Kube,
) -> None:
    def apply(name: str, spec: dict[str, Any]) -> None:
        crd_kube.apply({
            "apiVersion": f"{GROUP}/{VERSION}", "kind": KIND,
            "metadata": {"name": name, "namespace": "default"}, "spec": spec,
        })  # fmt: skip

    audit = {"enabled": True, "storeUrl": "s3://audits/a", "mirrorStoreUrl": "s3://audits/b"}
    with pytest.raises(Refused) as refused:
        apply("no-mirror", {"audit": audit})
    assert "audit.mirrorStoreUrl compares DR sites: it needs spec.mirror" in str(refused.value)
    mirror = {"role": "source", "secretName": "dr", "target": TARGET}
    with pytest.raises(Refused) as refused:
        apply("not-s3", {"mirror": mirror, "audit": {**audit, "mirrorStoreUrl": "/data/b"}})
    assert "mirrorStoreUrl is the other DR site's audit store" in str(refused.value)
    apply("audited-site", {"mirror": mirror, "audit": audit})


# -- declarative DR switchover, against real brokers -----------------------------------------


@pytest.fixture
def sites(tmp_path: Path) -> Iterator[Sites]:
    with Sites(tmp_path, reversible=True) as both:
        both.caught_up()
        yield both


def handle(
    requests: dict[str, Any], handled: HandledRequests, state: MirrorState | None, broker: Any
) -> list[tuple[str, str, str]]:
    """One reconcile pass's switch handling, as the operator runs it (the admin client of
    the active broker)."""
    spec_requests = Requests.model_validate(requests)
    return switch_requests(spec_requests, handled, state, broker.admin, "2026-11-24T00:00:00Z")


def test_a_declared_switchover_demotes_the_source_and_promotes_the_replica_with_its_token(
    sites: Sites,
) -> None:
    publish(sites.source, "orders", [b"before"])
    sites.caught_up()
    a_state, a_handled = MirrorState(role="source"), HandledRequests()
    ((kind, reason, message),) = handle(
        {"mirrorDemote": {"id": "dr-1"}}, a_handled, a_state, sites.source
    )
    assert (kind, reason, a_handled.mirror_demote) == ("Normal", "MirrorDemoted", "dr-1")
    assert a_state.role == "replica" and a_state.demotion_token, message
    assert handle({"mirrorDemote": {"id": "dr-1"}}, a_handled, a_state, sites.source) == []
    # The replica's request carries the token as the source's status shows it.
    b_state, b_handled = MirrorState(role="replica"), HandledRequests()
    promote = {"mirrorPromote": {"id": "dr-1", "token": a_state.demotion_token}}
    ((kind, reason, _),) = handle(promote, b_handled, b_state, sites.mirror)
    assert (kind, reason, b_state.role) == ("Normal", "MirrorPromoted", "source")
    assert "promoted to source at DR epoch 1" in b_state.last_switch
    publish(sites.mirror, "orders", [b"after"])  # the promoted site takes writes


def test_a_bad_token_or_a_site_without_a_mirror_is_refused_once_with_a_warning(
    sites: Sites,
) -> None:
    handled = HandledRequests()
    bad = {"mirrorPromote": {"id": "p-1", "token": "{not a token"}}
    ((kind, reason, message),) = handle(bad, handled, MirrorState(role="replica"), sites.mirror)
    assert (kind, reason, handled.mirror_promote) == ("Warning", "MirrorPromoteRefused", "p-1")
    assert "not a demotion token" in message
    stale = DemotionToken(origin="site-a", seq=10**9, epoch=1).model_dump_json()
    unmet = {"mirrorPromote": {"id": "p-2", "token": stale}}
    events = handle(unmet, handled, MirrorState(role="replica"), sites.mirror)
    assert events == [] or events[0][:2] == ("Warning", "MirrorPromoteRefused")
    none = {"mirrorDemote": {"id": "d-1"}}
    ((kind, reason, _),) = handle(none, handled, None, sites.source)
    assert (kind, reason, handled.mirror_demote) == ("Warning", "MirrorDemoteRefused", "d-1")


def test_a_declared_reseed_takes_the_source_out_of_needs_resync_once(tmp_path: Path) -> None:
    with Sites(tmp_path, source_args=["--mirror-retention-events", "3"]) as sites:
        sites.caught_up()
        sites.mirror.stop()
        publish(sites.source, "orders", [b"x"] * 10)
        sites.mirror.start()
        assert mirror_status(sites.source)["state"] == "needs-resync"
        state, handled = MirrorState(role="source"), HandledRequests()
        ((kind, reason, message),) = handle(
            {"mirrorReseed": {"id": "rs-1"}}, handled, state, sites.source
        )
        assert (kind, reason, handled.mirror_reseed) == ("Normal", "MirrorReseeded", "rs-1")
        assert "a seed of 10 messages" in message
        assert handle({"mirrorReseed": {"id": "rs-1"}}, handled, state, sites.source) == []
        sites.caught_up()
        assert queues(sites.mirror)["orders"]["messages"] == 10
        ((kind, reason, _),) = handle(
            {"mirrorReseed": {"id": "rs-2"}}, handled, state, sites.mirror
        )
        assert (kind, reason) == ("Warning", "MirrorReseedRefused")  # a replica does not seed
