"""The DR mirror on Kubernetes: what a BrokerCluster's `spec.mirror` asks of its pods and
Services, and what its status says of the link (docs/mirror.md, "On Kubernetes").

A source's brokers get `--mirror-to` the target's address (the mirror BrokerCluster's
virtual-IP Service, which exposes the mirror port: only the mirror's active applies);
a replica's brokers listen on the mirror port. Both take the link's token from the
Secret the spec names and identify their site as `<namespace>/<name>`. Only the
active broker of a pair mirrors or applies; the status is read from its `GET /status`.
"""

from __future__ import annotations

from typing import Any

from twinmq.broker.api import MirrorStatus
from twinmq.broker.names import MIRROR_PORT, setting_env
from twinmq.operator.models import Mirror, MirrorState, MirrorStateName

Obj = dict[str, Any]
SOURCE_STATES: dict[str, MirrorStateName] = {
    "connected": "Connected",
    "needs-resync": "NeedsResync",
    "fenced": "Fenced",
}
TOKEN_KEY = "mirror-token"
PORT_NAME = "mirror"


def site_id(namespace: str, name: str) -> str:
    """The origin a site's events carry (unique across the sites of one mirror)."""
    return f"{namespace}/{name}"


def broker_env(mirror: Mirror | None, namespace: str, name: str) -> list[Obj]:
    """The broker container's environment for `spec.mirror` (none without one)."""
    if mirror is None:
        return []
    env: list[Obj] = [
        {
            "name": setting_env("mirror_token"),
            "valueFrom": {"secretKeyRef": {"name": mirror.secret_name, "key": TOKEN_KEY}},
        },
        {"name": setting_env("mirror_id"), "value": site_id(namespace, name)},
    ]
    if mirror.role == "source":
        assert mirror.target is not None  # the CRD's CEL rule
        target = f"{mirror.target.host}:{mirror.target.port}"
        env += [
            {"name": setting_env("mirror_to"), "value": target},
            {"name": setting_env("mirror_max_lag"), "value": str(mirror.max_lag_seconds)},
        ]
    else:
        env.append({"name": setting_env("mirror_port"), "value": str(MIRROR_PORT)})
    return env


def container_ports(mirror: Mirror | None) -> list[Obj]:
    """The mirror port of a replica's broker container."""
    if mirror is None or mirror.role != "replica":
        return []
    return [{"name": PORT_NAME, "containerPort": MIRROR_PORT}]


def service_ports(mirror: Mirror | None) -> list[Obj]:
    """The mirror port on a replica's virtual-IP Service (sources reach its active there)."""
    if mirror is None or mirror.role != "replica":
        return []
    return [{"name": PORT_NAME, "port": MIRROR_PORT, "targetPort": PORT_NAME}]


def state_of(mirror: Mirror | None, seen: MirrorStatus | None) -> MirrorState | None:
    """`status.mirror` from the active broker's report of its mirror (`GET /status`,
    `mirror`; Unknown without one)."""
    if mirror is None:
        return None
    if seen is None:
        return MirrorState(role=mirror.role)
    role = seen.role or mirror.role  # after a switchover, the site's recorded role
    state: MirrorStateName
    if role == "replica":
        state = "Connected" if seen.sources_connected else "Listening"
    else:
        state = SOURCE_STATES.get(seen.state, "Disconnected")
    return MirrorState(
        role=role,
        state=state,
        epoch=seen.epoch,
        message=seen.needs_resync or seen.link_error or "",
        target=seen.target or "",
        queue_events=seen.queue_events,
        queue_bytes=seen.queue_bytes,
        lag_seconds=round(seen.oldest_event_age_seconds, 3),
        flow_control=seen.flow_control,
        sources_connected=seen.sources_connected,
    )


def condition(state: MirrorState | None) -> tuple[str, bool, str, str] | None:
    """The `Mirroring` condition (True while the link is up), None without a mirror."""
    if state is None:
        return None
    why = state.message or {
        "Connected": f"the {state.role}'s link is up",
        "Listening": "no source is linked to this replica",
        "Unknown": "no active broker has reported the mirror",
    }.get(state.state, "")
    return ("Mirroring", state.state == "Connected", state.state, why)


def events(old: MirrorState | None, new: MirrorState | None) -> list[tuple[str, str, str]]:
    """(type, reason, message) of the Events for a change of the link's state: a Warning
    when it goes down, resyncs or is fenced, a Normal one when it comes up."""
    if new is None or new.state == "Unknown" or (old is not None and old.state == new.state):
        return []
    warning = new.state in ("Disconnected", "NeedsResync", "Fenced")
    text = {
        "Connected": f"the {new.role}'s mirror link is up"
        + (f" ({new.target})" if new.target else ""),
        "Listening": "no source is linked to this replica any more",
        "Disconnected": f"the mirror link is down: {new.message or 'no heartbeat came back'}",
        "NeedsResync": f"the mirror needs a re-seed: {new.message}",
        "Fenced": "a newer site took over: this source is fenced (read-only)",
    }[new.state]
    return [("Warning" if warning else "Normal", f"Mirror{new.state}", text)]
