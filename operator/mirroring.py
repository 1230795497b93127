"""The DR mirror on Kubernetes: what a BrokerCluster's `spec.mirror` asks of its pods and
Services, and what its status says of the link (docs/mirror.md, "On Kubernetes").

A source's brokers get `--mirror-to` the target's address (the mirror BrokerCluster's
virtual-IP Service, which exposes the mirror port: only the mirror's active applies);
a replica's brokers listen on the mirror port. Both take the link's token from the
Secret the spec names and identify their site as `<namespace>/<name>`. A bidirectional
site's brokers run both ends at once (`--mirror-role bidirectional`): two sites naming
each other, or a ring of three each naming the next; its status shows both directions.
A full mesh (`spec.mirror.targets`, bidirectional) gives the brokers every other site,
comma-separated (one link and one journaled cursor each); `status.mirror.targets` shows
each target's link, and `state` is the worst of them.
Only the active broker of a pair mirrors or applies; the status is read from its
`GET /status`.

Mutual TLS (`spec.mirror.tls`, on once the other site's CA is known, from the operator's
copy (`operator/peerca.py`, by default between BrokerClusters naming each other) or
`caConfigMap`, and `spec.tls` is on with certificates the operator issues or asks
cert-manager for; the spec seen here names the copy in `caConfigMap`): both
brokers of a site mount the site's mirror certificate (`<cluster>-mirror-tls`, client and
server use, its common name the site's origin, its DNS names the virtual-IP Service's and
`serverNames`), which they present when dialling the target and on the mirror listener;
and the other site's CA from the ConfigMap, which verifies the listener a source dials
(its name: the target's host) and the certificate a source presents (it must name the
origin the source claims). The two sites' CAs differ: each copies the other's in.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal, Protocol, TypeVar

from pydantic import ValidationError

from twinmq.broker.admin_client import (
    AdminError,
    AdminUnreachable,
    Call,
    MirrorNotDrained,
    mirror_demote_call,
    mirror_promote_call,
    mirror_reseed_call,
)
from twinmq.broker.api import DemotionToken, MirrorStatus, MirrorTargetStatus, MirrorUnmirrored
from twinmq.broker.api import MirrorDemoteRequest as DemoteCall
from twinmq.broker.api import MirrorPromoteRequest as PromoteCall
from twinmq.broker.names import MIRROR_PORT, setting_env
from twinmq.operator.models import (
    BrokerClusterSpec,
    FailbackPhase,
    HandledRequests,
    Mirror,
    MirrorFailback,
    MirrorState,
    MirrorStateName,
    MirrorTargetState,
    Requests,
)

T = TypeVar("T")
DEMOTE_WAIT = 2.0  # seconds a pass lets a switch wait (a drain, the token's last event)
# A failback demotes once the backlog's oldest event is younger than this: under traffic
# the queue is seldom empty at a pass, and what is left drains inside one DEMOTE_WAIT
# with clients off (the demotion waits for zero, so this bound costs no message).
SYNC_LAG = 1.0

Obj = dict[str, Any]
SOURCE_STATES: dict[str, MirrorStateName] = {
    "connected": "Connected",
    "needs-resync": "NeedsResync",
    "fenced": "Fenced",
}
INBOUND_TEXT: dict[str, str] = {
    "Connected": "the incoming direction is up: the site before this one is linked",
    "Listening": "the incoming direction is down: no site is linked to this one",
    "Unknown": "no active broker has reported the mirror",
}
TOKEN_KEY = "mirror-token"
PORT_NAME = "mirror"
TLS_DIR = "/etc/twinmq/mirror-tls"  # the site's mirror certificate (tls.crt, tls.key)
CA_DIR = "/etc/twinmq/mirror-ca"  # the other site's CA (ca.crt)


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
    # Every site listens on the mirror port and, with a target, can mirror to it: the
    # first role says which end runs; a switchover turns them around (docs/mirror.md).
    env += [
        {"name": setting_env("mirror_role"), "value": mirror.role},
        {"name": setting_env("mirror_port"), "value": str(MIRROR_PORT)},
    ]
    if targets := mirror.all_targets():
        # A mesh's targets comma-separated: the broker's environment form of a repeated
        # --mirror-to (one link and one journaled cursor each).
        addresses = ",".join(f"{target.host}:{target.port}" for target in targets)
        env += [
            {"name": setting_env("mirror_to"), "value": addresses},
            {"name": setting_env("mirror_max_lag"), "value": str(mirror.max_lag_seconds)},
        ]
    return env


def certificate_wanted(spec: BrokerClusterSpec) -> bool:
    """Whether this site has a mirror certificate: a mirror with TLS not turned off, and
    `spec.tls` on with certificates the operator issues (its CA) or asks cert-manager for
    (one Secret of your own cannot be a site's mirror identity)."""
    mirror, tls = spec.mirror, spec.tls
    return (
        mirror is not None
        and mirror.tls.enabled
        and tls.enabled
        and (tls.issuer_ref is not None or tls.secret_name is None)
    )


def tls_on(spec: BrokerClusterSpec) -> bool:
    """Whether the brokers run the mirror link over mutual TLS: a certificate, and the
    other site's CA to verify it with."""
    mirror = spec.mirror
    return certificate_wanted(spec) and mirror is not None and bool(mirror.tls.ca_config_map)


def secret_name(cluster_name: str) -> str:
    """The site's mirror certificate Secret."""
    return f"{cluster_name}-mirror-tls"


def certificate_names(spec: BrokerClusterSpec, namespace: str, vip: str) -> list[str]:
    """The DNS names of the site's mirror certificate: its virtual-IP Service (where the
    other site reaches its active's mirror port) and `serverNames`."""
    forms = [vip, f"{vip}.{namespace}", f"{vip}.{namespace}.svc",
             f"{vip}.{namespace}.svc.cluster.local"]  # fmt: skip
    extra = spec.mirror.tls.server_names if spec.mirror is not None else []
    return forms + [n for n in extra if n not in forms]


def tls_env(spec: BrokerClusterSpec) -> list[Obj]:
    """The broker container's mirror TLS settings (none while the link is plaintext)."""
    if not tls_on(spec):
        return []
    env = [
        {"name": setting_env("mirror_tls_cert"), "value": f"{TLS_DIR}/tls.crt"},
        {"name": setting_env("mirror_tls_key"), "value": f"{TLS_DIR}/tls.key"},
        {"name": setting_env("mirror_tls_ca"), "value": f"{CA_DIR}/ca.crt"},
    ]
    assert spec.mirror is not None
    if spec.mirror.tls.server_name is not None:
        env.append({"name": setting_env("mirror_tls_server_name"),
                    "value": spec.mirror.tls.server_name})  # fmt: skip
    return env


def tls_volumes(spec: BrokerClusterSpec, cluster_name: str) -> list[Obj]:
    """The site's mirror certificate and the other site's CA (whole volumes: the kubelet's
    updates reach the files, which the broker reloads)."""
    if not tls_on(spec):
        return []
    assert spec.mirror is not None and spec.mirror.tls.ca_config_map is not None
    return [
        {"name": "mirror-tls", "secret": {
            "secretName": secret_name(cluster_name),
            "items": [{"key": k, "path": k} for k in ("tls.crt", "tls.key")],
        }},
        {"name": "mirror-ca", "configMap": {
            "name": spec.mirror.tls.ca_config_map,
            "items": [{"key": spec.mirror.tls.ca_key, "path": "ca.crt"}],
        }},
    ]  # fmt: skip


def tls_mounts(spec: BrokerClusterSpec) -> list[Obj]:
    """Where the broker container sees them."""
    if not tls_on(spec):
        return []
    return [
        {"name": "mirror-tls", "mountPath": TLS_DIR, "readOnly": True},
        {"name": "mirror-ca", "mountPath": CA_DIR, "readOnly": True},
    ]


def container_ports(mirror: Mirror | None) -> list[Obj]:
    """The mirror port of a mirrored site's broker container."""
    if mirror is None:
        return []
    return [{"name": PORT_NAME, "containerPort": MIRROR_PORT}]


def service_ports(mirror: Mirror | None) -> list[Obj]:
    """The mirror port on a mirrored site's virtual-IP Service (a source reaches the
    replica's active there, whichever site is which after a switchover)."""
    if mirror is None:
        return []
    return [{"name": PORT_NAME, "port": MIRROR_PORT, "targetPort": PORT_NAME}]


def state_of(mirror: Mirror | None, seen: MirrorStatus | None) -> MirrorState | None:
    """`status.mirror` from the active broker's report of its mirror (`GET /status`,
    `mirror`; Unknown without one)."""
    if mirror is None:
        return None
    if seen is None:
        bidi = mirror.role == "bidirectional"
        return MirrorState(role=mirror.role, inbound="Unknown" if bidi else "")
    role = seen.role or mirror.role  # after a switchover, the site's recorded role
    linked: Literal["Connected", "Listening"] = (
        "Connected" if seen.sources_connected else "Listening"
    )
    # A bidirectional site runs a source's link: its outgoing direction reads the same.
    outgoing = SOURCE_STATES.get(seen.state, "Disconnected")
    state: MirrorStateName = linked if role == "replica" else outgoing
    return MirrorState(
        targets=[target_state(t) for t in seen.targets],
        role=role,
        state=state,
        inbound=linked if role == "bidirectional" else "",
        epoch=seen.epoch,
        message=seen.needs_resync or seen.link_error or "",
        target=seen.target or "",
        queue_events=seen.queue_events,
        queue_bytes=seen.queue_bytes,
        lag_seconds=round(seen.oldest_event_age_seconds, 3),
        flow_control=seen.flow_control,
        sources_connected=seen.sources_connected,
        tls=seen.tls,
        orphans=seen.orphans,
        unmirrored=unmirrored_text(seen.unmirrored),
        seed_pending=seen.seed_pending or "",
    )


def target_state(seen: MirrorTargetStatus) -> MirrorTargetState:
    """`status.mirror.targets[]`: one mesh target's link as the active reports it."""
    return MirrorTargetState(
        target=seen.target,
        peer=seen.peer or "",
        state=SOURCE_STATES.get(seen.state, "Disconnected"),
        connected=seen.connected,
        lag_seconds=round(seen.oldest_event_age_seconds, 3),
        queue_events=seen.queue_events,
        needs_resync=seen.needs_resync or "",
        message=seen.needs_resync or seen.link_error or seen.mirror_blocked or "",
    )


def unmirrored_text(lost: MirrorUnmirrored | None) -> str:
    """`status.mirror.unmirrored`: a forced failover's loss as the old source counted it."""
    if lost is None:
        return ""
    text = (
        f"{lost.messages} messages and {lost.settles} settles ({lost.events} events after "
        f"event {lost.applied_seq}) never reached {lost.promoted}, which took over by force"
    )
    if lost.unverified_messages:
        text += (f"; {lost.unverified_messages} more messages it claims to hold were not "
                 f"found in its seed and are kept here")  # fmt: skip
    return text


def condition(state: MirrorState | None) -> tuple[str, bool, str, str] | None:
    """The `Mirroring` condition (True while the link is up; a bidirectional site's, while
    both directions are), None without a mirror."""
    if state is None:
        return None
    if state.targets:
        return _mesh_condition(state)
    if state.role == "bidirectional" and state.state == "Connected" and state.inbound:
        if state.inbound != "Connected":
            return ("Mirroring", False, f"Inbound{state.inbound}", INBOUND_TEXT[state.inbound])
        return ("Mirroring", True, "Connected", "both directions are up")
    why = state.message or {
        "Connected": f"the {state.role}'s link is up",
        "Listening": "no source is linked to this replica",
        "Unknown": "no active broker has reported the mirror",
    }.get(state.state, "")
    return ("Mirroring", state.state == "Connected", state.state, why)


def _mesh_condition(state: MirrorState) -> tuple[str, bool, str, str]:
    """A full-mesh site's `Mirroring` condition: True while every target's link and the
    incoming direction are up; else the targets that are not, each with its state and why."""
    down = [t for t in state.targets if t.state != "Connected"]
    if down:
        why = "; ".join(f"{t.target} {t.state}" + (f": {t.message}" if t.message else "")
                        for t in down)  # fmt: skip
        return ("Mirroring", False, state.state,
                f"{len(down)} of {len(state.targets)} targets not connected: {why}")  # fmt: skip
    if state.inbound != "Connected":
        return ("Mirroring", False, f"Inbound{state.inbound or 'Unknown'}",
                INBOUND_TEXT[state.inbound or "Unknown"])  # fmt: skip
    return ("Mirroring", True, "Connected", f"all {len(state.targets)} targets are linked, "
            f"and {state.sources_connected} sites are linked in")  # fmt: skip


def target_events(old: MirrorState, new: MirrorState) -> list[tuple[str, str, str]]:
    """(type, reason, message) of the Events for a mesh target whose link changed state
    (`MirrorTarget<State>`, naming the target; a target new to the status has none: the
    site's own Event covers the first report)."""
    before = {t.target: t.state for t in old.targets}
    out: list[tuple[str, str, str]] = []
    for target in new.targets:
        was = before.get(target.target)
        if was is None or was == target.state or target.state == "Unknown":
            continue
        up = target.state == "Connected"
        text = f"mirror target {target.target}" + (f" ({target.peer})" if target.peer else "")
        text += f": {was} -> {target.state}"
        if not up:
            text += f": {target.message or 'no heartbeat came back'}"
        out.append(("Normal" if up else "Warning", f"MirrorTarget{target.state}", text))
    return out


def failback_condition(state: MirrorState | None) -> tuple[str, bool, str, str] | None:
    """The `FailingBack` condition: True while a mirrorFailback request is under way here
    (its reason the phase), False once it is Done or Refused; None if none was asked."""
    if state is None or not state.failback.id:
        return None
    fb = state.failback
    moving = fb.phase not in ("Done", "Refused")
    return ("FailingBack", moving, fb.phase or "Reattaching", f"{fb.id}: {fb.message}")


def events(old: MirrorState | None, new: MirrorState | None) -> list[tuple[str, str, str]]:
    """(type, reason, message) of the Events for a change of the link's state: a Warning
    when it goes down, resyncs or is fenced, a Normal one when it comes up; a Warning
    when messages were moved to the orphan queue, when an old source counted what a
    forced failover lost, and while a forced promotion's seed is not durable."""
    out: list[tuple[str, str, str]] = []
    if new is not None and old is not None and new.orphans > old.orphans:
        out.append(("Warning", "MirrorOrphans", f"{new.orphans - old.orphans} messages the "
                    f"source does not hold were kept in amq.twinmq.mirror-orphans ("
                    f"{new.orphans} now): read or purge them (docs/mirror.md)"))  # fmt: skip
    if new is not None and old is not None and new.unmirrored not in ("", old.unmirrored):
        out.append(("Warning", "MirrorUnmirrored", f"the forced failover's loss, counted by "
                    f"this old source: {new.unmirrored} (kept here in "
                    "amq.twinmq.mirror-orphans unless settled since)"))  # fmt: skip
    if new is not None and old is not None and new.seed_pending not in ("", old.seed_pending):
        out.append(("Warning", "MirrorSeedPending", f"{new.seed_pending}: clients are refused "
                    "until a seed for the old source is durable (docs/mirror.md)"))  # fmt: skip
    if new is not None and old is not None and old.seed_pending and not new.seed_pending:
        out.append(("Normal", "MirrorSeeded", "the seed for the old source is durable: "
                    "clients are served"))  # fmt: skip
    if new is not None and old is not None:
        out += target_events(old, new)
    unheard = ("", "Unknown")  # one-way, or nothing heard yet: no Event
    if (
        new is not None
        and old is not None
        and old.inbound not in unheard
        and new.inbound not in (*unheard, old.inbound)
    ):
        up = new.inbound == "Connected"
        out.append(("Normal" if up else "Warning", f"MirrorInbound{new.inbound}",
                    INBOUND_TEXT[new.inbound]))  # fmt: skip
    if new is None or new.state == "Unknown" or (old is not None and old.state == new.state):
        return out
    warning = new.state in ("Disconnected", "NeedsResync", "Fenced")
    text = {
        "Connected": f"the {new.role}'s mirror link is up"
        + (f" ({new.target})" if new.target else ""),
        "Listening": "no source is linked to this replica any more",
        "Disconnected": f"the mirror link is down: {new.message or 'no heartbeat came back'}",
        "NeedsResync": f"the mirror needs a re-seed: {new.message}",
        "Fenced": "a newer site took over: this source is fenced (read-only)",
    }[new.state]
    return [*out, ("Warning" if warning else "Normal", f"Mirror{new.state}", text)]


class SwitchClient(Protocol):
    """What a DR switch needs of the active broker's admin API."""

    def send(self, call: Call[T], timeout: float | None = None) -> T:
        """Make one call."""
        ...


def switch_requests(
    requests: Requests,
    handled: HandledRequests,
    state: MirrorState | None,
    active: SwitchClient | None,
    now: str,
) -> list[tuple[str, str, str]]:
    """Handle a pending `mirrorDemote` or `mirrorPromote` request on the active broker;
    the Events to post. A request is handled once (its id recorded in `handled`); a broker
    that cannot answer now, or a demotion still draining, is asked again at the next pass
    (the broker answers a repeated switch with the stored result)."""
    demote, promote = requests.mirror_demote, requests.mirror_promote
    reseed, failback = requests.mirror_reseed, requests.mirror_failback
    if reseed is not None and reseed.id != handled.mirror_reseed:
        return _reseed(reseed.id, handled, state, active)
    if demote is not None and demote.id != handled.mirror_demote:
        return _switch(demote.id, "demote", DemoteCall(timeout=DEMOTE_WAIT), handled, state,
                       active, now)  # fmt: skip
    if promote is not None and promote.id != handled.mirror_promote:
        try:
            token = DemotionToken.model_validate_json(promote.token) if promote.token else None
        except ValidationError as exc:
            handled.mirror_promote = promote.id
            return [("Warning", "MirrorPromoteRefused", f"{promote.id}: not a demotion token: "
                     f"{exc.errors()[0]['msg']}")]  # fmt: skip
        call = PromoteCall(token=token, force=promote.force, timeout=DEMOTE_WAIT)
        return _switch(promote.id, "promote", call, handled, state, active, now)
    if failback is not None and failback.id != handled.mirror_failback:
        return failback_step(failback.id, handled, state, active, now)
    return []


def failback_step(
    request_id: str,
    handled: HandledRequests,
    state: MirrorState | None,
    active: SwitchClient | None,
    now: str,
) -> list[tuple[str, str, str]]:
    """One pass of a mirrorFailback request on the site that is the source now; the Events.

    Its phases (`status.mirror.failback.phase`, kept across passes and operator restarts):
    Reattaching until this site's link is Connected (the other site accepts a source's link
    only as a replica: after a forced failover the old source fences itself on this site's
    REFUSE, is reversed and applies this site's seed, keeping what only it held in its
    orphan queue; a NeedsResync source is re-seeded), Syncing until the backlog is within
    SYNC_LAG, Demoting (the switchover's first half: clients refused, drained to zero, a
    demotion token), Promoting until the other site, promoted with that token, has linked
    back to this one. Both sites are never writable at once: the other site is a replica
    from Reattaching on, and becomes the source only with the token, which exists only
    once this site is fenced.
    """
    if state is None:
        handled.mirror_failback = request_id
        return [("Warning", "MirrorFailbackRefused", f"{request_id}: this BrokerCluster has "
                 "no spec.mirror")]  # fmt: skip
    fb = state.failback
    out: list[tuple[str, str, str]] = []
    if fb.id != request_id:
        fb = state.failback = MirrorFailback(id=request_id, phase="Reattaching", started=now,
                                             since=now)  # fmt: skip
        out.append(("Normal", "MirrorFailback", f"{request_id}: failing back to "
                    f"{state.target or 'the mirror'}"))  # fmt: skip

    def to(phase: FailbackPhase, message: str) -> None:
        if phase != fb.phase:
            fb.phase, fb.since = phase, now
            out.append(("Normal", f"MirrorFailback{phase}", f"{request_id}: {message}"))
        fb.message = message

    def refuse(why: str) -> list[tuple[str, str, str]]:
        fb.phase, fb.since, fb.message = "Refused", now, why
        handled.mirror_failback = request_id
        return [*out, ("Warning", "MirrorFailbackRefused", f"{request_id}: {why}")]

    if active is None or state.state == "Unknown":
        # No active broker answers now (the role shown is then the spec's first one, not
        # the site's): the next pass goes on.
        return out
    if fb.phase == "Reattaching" and state.role != "source":
        return refuse(f"this site is a DR {state.role}: a failback is asked of the site "
                      "that is the source now")  # fmt: skip
    if fb.phase in ("Reattaching", "Syncing") and state.role == "source":
        if state.state == "Fenced":
            return refuse("a newer site took over: this site is fenced")
        if state.state == "NeedsResync":
            try:
                seeded = active.send(mirror_reseed_call())
            except AdminUnreachable:
                return out
            except AdminError as exc:
                return refuse(f"the mirror needs a re-seed, refused: {exc}")
            to("Reattaching", f"re-seeding the other site ({seeded.messages} messages)")
            return out
        if state.state != "Connected":
            to("Reattaching", "waiting for the link to the other site (it takes this site's "
               f"link only as a replica): {state.message or 'not connected yet'}")  # fmt: skip
            return out
        if state.queue_events and state.lag_seconds > SYNC_LAG:
            to("Syncing", f"{state.queue_events} events ({state.queue_bytes} bytes) to "
               f"mirror, the oldest {state.lag_seconds:.1f} s old")  # fmt: skip
            return out
        to("Demoting", f"in sync ({state.queue_events} events to go): demoting, clients "
           "refused")  # fmt: skip
    if fb.phase in ("Syncing", "Demoting"):
        # (Syncing here: a restart lost the Demoting phase after the demotion; the broker
        # answers a repeated demotion with its token.)
        try:
            switch = active.send(mirror_demote_call(DemoteCall(timeout=DEMOTE_WAIT)))
        except (MirrorNotDrained, AdminUnreachable):
            return out  # still draining: asked again (replay-safe)
        except AdminError as exc:
            return refuse(f"demotion refused: {exc}")
        if switch.token is None:
            return refuse("the demotion gave no token")
        state.role, state.epoch = switch.role, switch.epoch
        fb.token = state.demotion_token = switch.token.model_dump_json()
        state.last_switch = (f"{now}: {request_id}: demoted to {switch.role} at DR epoch "
                             f"{switch.epoch} in {switch.seconds:.2f} s (failback)")  # fmt: skip
        to("Promoting", f"demoted in {switch.seconds:.2f} s: promote the other site with "
           "status.mirror.failback.token")  # fmt: skip
        return out
    if fb.phase == "Promoting":
        if state.role == "replica" and state.state == "Connected":
            fb.phase, fb.since, handled.mirror_failback = "Done", now, request_id
            took = _seconds_between(fb.started, now)
            fb.message = f"the other site is the source again, linked back to this one ({took})"
            out.append(("Normal", "MirrorFailedBack", f"{request_id}: {fb.message}"))
        elif state.role == "source":
            return refuse("this site is the source again (promoted by another request)")
        else:
            fb.message = "demoted: waiting for the other site's promotion and its link back"
    return out


def _seconds_between(start: str, end: str) -> str:
    """`end - start` of two RFC 3339 times, as text ("time unknown" when either does not
    parse)."""
    try:
        seconds = (datetime.fromisoformat(end) - datetime.fromisoformat(start)).total_seconds()
    except ValueError:
        return "time unknown"
    return f"{seconds:.1f} s in all"


def _reseed(
    request_id: str,
    handled: HandledRequests,
    state: MirrorState | None,
    active: SwitchClient | None,
) -> list[tuple[str, str, str]]:
    if state is None:
        handled.mirror_reseed = request_id
        return [("Warning", "MirrorReseedRefused", f"{request_id}: this BrokerCluster has no "
                 "spec.mirror")]  # fmt: skip
    if active is None:
        return []  # no active broker answers now: the next pass asks again
    try:
        seeded = active.send(mirror_reseed_call())
    except AdminUnreachable:
        return []
    except AdminError as exc:
        handled.mirror_reseed = request_id
        return [("Warning", "MirrorReseedRefused", f"{request_id}: {exc}")]
    handled.mirror_reseed = request_id
    return [("Normal", "MirrorReseeded", f"{request_id}: a seed of {seeded.messages} messages "
             f"queued for the mirror ({seeded.reason})")]  # fmt: skip


def _switch(
    request_id: str,
    kind: Literal["demote", "promote"],
    body: DemoteCall | PromoteCall,
    handled: HandledRequests,
    state: MirrorState | None,
    active: SwitchClient | None,
    now: str,
) -> list[tuple[str, str, str]]:
    reason = f"Mirror{kind.capitalize()}"

    def done() -> None:
        setattr(handled, f"mirror_{kind}", request_id)

    if state is None:
        done()
        return [("Warning", f"{reason}Refused", f"{request_id}: this BrokerCluster has no "
                 "spec.mirror")]  # fmt: skip
    if active is None:
        return []  # no active broker answers now: the next pass asks again
    call = mirror_demote_call(body) if isinstance(body, DemoteCall) else mirror_promote_call(body)
    try:
        switch = active.send(call)
    except (MirrorNotDrained, AdminUnreachable):
        return []  # still draining / not reachable now: asked again (replay-safe)
    except AdminError as exc:
        done()
        return [("Warning", f"{reason}Refused", f"{request_id}: {exc}")]
    done()
    state.role, state.epoch = switch.role, switch.epoch
    what = f"{kind}d to {switch.role} at DR epoch {switch.epoch} in {switch.seconds:.2f} s"
    if switch.token is not None:
        state.demotion_token = switch.token.model_dump_json()
    if switch.rpo is not None:
        rpo = switch.rpo
        what += (f", forced: last event applied {rpo.last_applied_seq}, the source's newest "
                 f"seen {rpo.source_last_seq_seen} with {rpo.source_unreplicated_seen} "
                 "unacknowledged (may be lost)")  # fmt: skip
    state.last_switch = f"{now}: {request_id}: {what}"
    return [("Warning" if switch.forced else "Normal", f"{reason}d", what)]
