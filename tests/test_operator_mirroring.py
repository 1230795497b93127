"""spec.mirror on Kubernetes: the brokers' settings, the virtual IP's mirror port, the status."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mirrorsites import Sites, mirror_status, publish, queues
from pydantic import ValidationError

from twinmq.broker.api import DemotionToken, MirrorStatus
from twinmq.broker.names import MIRROR_PORT, setting_env
from twinmq.broker.settings import BrokerSettings
from twinmq.operator.builders import ClusterRef, build_pod, build_vip_service
from twinmq.operator.mirroring import condition, events, state_of, switch_requests
from twinmq.operator.models import (
    BrokerClusterSpec,
    HandledRequests,
    Mirror,
    MirrorState,
    Requests,
)

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
