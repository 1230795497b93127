"""spec.mirror on Kubernetes: the brokers' settings, the virtual IP's mirror port, the status."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from twinmq.broker.api import MirrorStatus
from twinmq.broker.names import MIRROR_PORT, setting_env
from twinmq.broker.settings import BrokerSettings
from twinmq.operator.builders import ClusterRef, build_pod, build_vip_service
from twinmq.operator.mirroring import condition, events, state_of
from twinmq.operator.models import BrokerClusterSpec, Mirror, MirrorState

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
    assert (settings.mirror_to, settings.mirror_port, settings.mirror_max_lag) == (
        f"orders.site-b.svc:{MIRROR_PORT}", None, 5.0,
    )  # fmt: skip
    assert build_vip_service(SOURCE, source.mirror)["spec"]["ports"] == [
        {"name": "amqp", "port": 5672, "targetPort": "amqp"}
    ]


def test_a_replica_listens_on_the_mirror_port_behind_its_virtual_ip() -> None:
    replica = spec({"role": "replica", "secretName": "dr"})
    pod = build_pod(REPLICA, replica, "primary")
    env = env_of(pod)
    assert setting_env("mirror_to") not in env
    assert settings_from(env).mirror_port == MIRROR_PORT
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
