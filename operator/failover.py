"""The failover algorithm: observations in, decisions out, no Kubernetes and no clock.

The OpenAMQ rules, Kubernetes style (docs/operator.md):

1. At creation the primary becomes active in epoch 1; the backup passive.
2. Automatic failover when the active is not serving and either Kubernetes
   reports its process gone since it was seen serving (pod deleted, container
   terminated or restarted: a restarted broker starts passive, so it cannot
   serve) or its Lease has expired and the backup has lost its replication
   link too (what Kubernetes cannot see: partitions, a hung process). Only a
   ready backup is promoted unless the spec allows data loss. The old broker
   leaves the virtual IP before the new one joins.
3. (The active renews its Lease and fences itself when it cannot: broker side.)
4. A returning broker comes back passive and re-syncs.
5. Recovery (failback) is manual: demote the active backup, wait until it
   *reports* passive, only then activate the primary.
6. A manual promote (switchover) needs a ready target unless forced.
7. A damaged broker (its journal recovered with corruption and not yet made
   whole by a complete catch-up: it may lack messages it confirmed) is never
   activated automatically: not by a failover, a re-activation, a recovery or
   `allowDataLoss`; only a forced promote activates it (the broker's own
   `force`).

Every role change to active carries a new epoch, above every epoch a broker
reports: a status restored without its epoch, or behind the brokers', is
corrected from them rather than trusted (a stale epoch is refused for ever).
`decide` returns the actions in the order they must be applied; the adapter
applies them and records the new state, so a restarted operator resumes from
what the status says.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from twinmq.operator.models import BrokerName

Role = Literal["active", "passive", "unknown"]
OTHER: dict[BrokerName, BrokerName] = {"primary": "backup", "backup": "primary"}


@dataclass(frozen=True)
class BrokerView:
    """One broker as probed just now."""

    name: BrokerName
    reachable: bool  # the admin API answered within the failure threshold
    role: Role = "unknown"
    epoch: int = 0
    ready: bool = False  # passive: caught up, promotable without loss
    # passive: the epoch of the active it caught up with, kept after the link's loss
    # (promotable without loss if that active's Lease shows it never went on alone)
    caught_up_epoch: int | None = None
    link_connected: bool = False  # passive: replicating right now
    replicating_from_active: bool = False  # passive: its link points at the active
    # Kubernetes reports the process last seen serving gone: the pod deleted, the broker
    # container not running, or restarted since. It cannot serve (a broker starts passive).
    stopped: bool = False
    # Its journal is damaged (rule 7): it refuses activation without force.
    damaged: bool = False


@dataclass(frozen=True)
class Switchover:
    """A move of the active role in progress (manual promote or recovery)."""

    request_id: str
    kind: Literal["promote", "recover"]
    target: BrokerName
    epoch: int  # the source is demoted in this epoch; the target activated in the next
    force: bool = False


@dataclass(frozen=True)
class Observation:
    """Everything `decide` may look at."""

    brokers: dict[BrokerName, BrokerView]
    active: BrokerName | None  # who the status says is active
    epoch: int  # the status's epoch (0: never initialised)
    lease_holder: BrokerName | None
    # The operator has seen the Lease's record unchanged for its duration, on its own
    # monotonic clock (operator/leasewatch.py), or there is none
    lease_expired: bool
    # The replication guard the active's Lease carries: (epoch, alone) (broker/lease.py);
    # `alone` at once, `<epoch>:0` only once the record has been seen unchanged for two
    # durations
    lease_guard: tuple[int, bool] | None = None
    allow_data_loss: bool = False
    switchover: Switchover | None = None  # in progress, from the status
    promote_request: tuple[str, BrokerName, bool] | None = None  # (id, target, force), unhandled
    recover_request: str | None = None  # id, unhandled
    fence_request: tuple[str, BrokerName, bool] | None = None  # (id, broker, fenced), unhandled
    fenced: frozenset[BrokerName] = frozenset()
    routed: BrokerName | None = None  # the broker the virtual IP selects right now


@dataclass(frozen=True)
class SetRole:
    """POST /role to a broker."""

    broker: BrokerName
    role: Literal["active", "passive"]
    epoch: int
    replicate_from: BrokerName | None = None
    force: bool = False  # activate a damaged broker anyway (a forced promote only)


@dataclass(frozen=True)
class Route:
    """Point the virtual IP at a broker (None: at nobody)."""

    broker: BrokerName | None


@dataclass(frozen=True)
class Record:
    """New status facts."""

    active: BrokerName | None
    epoch: int
    switchover: Switchover | None = None
    failover_from: BrokerName | None = None  # set: a failover/switchover happened now
    reason: str = ""
    handled_promote: str | None = None
    handled_recover: str | None = None
    handled_fence: str | None = None
    fenced: frozenset[BrokerName] | None = None  # the new fenced set, when it changes


@dataclass(frozen=True)
class Event:
    """A Kubernetes Event: why, from, to."""

    reason: str
    message: str
    warning: bool = False


Action = SetRole | Route | Record | Event


@dataclass
class Decision:
    """The ordered actions, and the condition they leave the cluster in."""

    actions: list[Action] = field(default_factory=list)
    degraded: str | None = None  # reason the pair is not fully protected
    failing_over: bool = False

    def add(self, *actions: Action) -> Decision:
        """Append actions; returns self."""
        self.actions.extend(actions)
        return self


def _serving(view: BrokerView, epoch: int) -> bool:
    return view.reachable and view.role == "active" and view.epoch >= epoch


def decide(obs: Observation) -> Decision:
    """What to do now."""
    learned = _learn_epoch(obs)
    if learned is not None:
        record, event = learned.actions
        assert isinstance(record, Record)
        rest = decide(replace(obs, active=record.active, epoch=record.epoch))
        rest.actions[:0] = [record, event]
        return rest
    if obs.epoch == 0:
        return _initialise(obs)
    if obs.switchover is not None:
        return _continue_switchover(obs, obs.switchover)
    request = Decision()
    if obs.fence_request is not None:
        request = _fence(obs, *obs.fence_request)
    elif obs.recover_request is not None:
        request = _start_recovery(obs, obs.recover_request)
    elif obs.promote_request is not None:
        request = _start_promote(obs, *obs.promote_request)
    if any(isinstance(a, SetRole | Route) for a in request.actions):
        active = obs.active
        if (
            obs.routed is not None
            and active is not None
            and not _serving(obs.brokers[active], obs.epoch)
            and not any(isinstance(a, Route) for a in request.actions)
        ):
            # The request goes first, but a broker that does not serve leaves the virtual
            # IP now (it may come back passive before the next reconcile). Found by the
            # property test.
            request.actions.insert(0, Route(None))
        return request
    # A request that was only acknowledged (ignored, refused) or cannot start yet must
    # not hold up anything else: a crash of the active meanwhile is still a failover.
    # Found by the property test.
    steady = _steady(obs)
    steady.actions[:0] = request.actions
    steady.degraded = steady.degraded or request.degraded
    return steady


def _learn_epoch(obs: Observation) -> Decision | None:
    """The status's epoch behind a broker's (restored without status, or stale): take the
    highest epoch a broker reports, and the broker active in it, as the truth. None: the
    status is current. A switchover in progress manages its own epochs."""
    reported = [v for v in obs.brokers.values() if v.reachable]
    known = max((v.epoch for v in reported), default=0)
    if known <= obs.epoch or obs.switchover is not None:
        return None
    serving = [v.name for v in reported if v.role == "active" and v.epoch == known]
    active = serving[0] if serving else None if obs.epoch == 0 else obs.active
    return Decision().add(
        Record(active, known, reason=f"epoch {known} learned from the brokers"),
        Event(
            "EpochLearned",
            f"the status said epoch {obs.epoch}, a broker reports {known}; active: {active}",
            warning=True,
        ),
    )


def _initialise(obs: Observation) -> Decision:
    primary = obs.brokers["primary"]
    if not primary.reachable:
        return Decision(degraded="waiting for the primary broker to start")
    if primary.damaged:
        return Decision(degraded="the primary's journal is damaged: not activating it")
    return Decision().add(
        SetRole("primary", "active", 1),
        Route("primary"),
        Record("primary", 1, reason="created"),
        Event("Initialised", "primary is active in epoch 1; backup follows as passive"),
    )


def _steady(obs: Observation) -> Decision:
    decision = Decision()
    active = obs.active
    if active is None:
        return _no_active(obs)
    other = OTHER[active]
    a, b = obs.brokers[active], obs.brokers[other]
    if _serving(a, obs.epoch):
        # Rule 4: whoever is not the active comes back passive, replicating from it.
        if (
            b.reachable
            and other not in obs.fenced
            and (b.role != "passive" or not b.replicating_from_active or b.epoch < obs.epoch)
        ):
            decision.add(SetRole(other, "passive", obs.epoch, active))
        if not (b.reachable and b.ready and b.link_connected):
            decision.degraded = f"{other} is not in sync with the active {active}"
        return decision
    return _failover(obs, active, other)


def _failover(obs: Observation, active: BrokerName, other: BrokerName) -> Decision:
    """Rule 2: the active is not serving. Promote the other broker when that is safe."""
    decision = Decision(failing_over=True)
    if obs.routed is not None:
        # A broker that does not serve leaves the virtual IP at once: clients retry
        # against no endpoint rather than reach a broker that refuses them.
        decision.add(Route(None))
    a, b = obs.brokers[active], obs.brokers[other]
    if not a.stopped and not obs.lease_expired and obs.lease_holder == active:
        # It may be cut off but alive: only its Lease bounds how long it may still serve.
        decision.degraded = f"{active} is unreachable; waiting for its Lease to expire"
        return decision
    blocked = _promotion_blocked(obs, active, other)
    if blocked is None:
        epoch = obs.epoch + 1
        reason = (
            "active's process gone (Kubernetes)" if a.stopped
            else "active unreachable and its Lease expired"
        ) + (
            "" if b.ready
            else "; backup caught up, and the Lease shows the active never went on alone"
            if _kept_everything(obs, active, other)
            else "; backup NOT ready (allowDataLoss)"
        )  # fmt: skip
        return decision.add(
            Route(None),
            SetRole(other, "active", epoch),
            Route(other),
            Record(other, epoch, failover_from=active, reason=reason),
            Event("FailedOver", f"{other} promoted in epoch {epoch}: {active} {reason}", True),
        )
    if (
        a.reachable
        and a.role == "passive"
        and a.epoch >= obs.epoch
        and active not in obs.fenced
        and not a.damaged
        and obs.lease_holder in (None, active)
    ):
        # The old active restarted in place and came back passive (rule 4) while the
        # other broker cannot take over without loss: it holds everything it confirmed,
        # so it is re-activated, in a new epoch. Not when the Lease names the other: the
        # status is then behind (restored), and the other may have confirmed more since.
        # Found by the property test.
        epoch = obs.epoch + 1
        return decision.add(
            SetRole(active, "active", epoch),
            Route(active),
            Record(active, epoch, reason=f"restarted active re-activated ({blocked})"),
            Event("Reactivated", f"{active} re-activated in epoch {epoch}: {blocked}", True),
        )
    decision.degraded = blocked
    if not b.ready and b.reachable and not b.link_connected and other not in obs.fenced:
        decision.add(
            Event(
                "FailoverBlocked",
                f"{active} is unreachable but {other} had not caught up; promoting it would "
                "lose confirmed messages (spec.failover.allowDataLoss is false)",
                warning=True,
            )
        )
    return decision


def _promotion_blocked(obs: Observation, active: BrokerName, other: BrokerName) -> str | None:
    """Why the other broker cannot be promoted now (None: it can)."""
    b = obs.brokers[other]
    if not b.reachable:
        return f"neither broker is serving: {active} down, {other} unreachable"
    if b.link_connected and not obs.brokers[active].stopped:
        # The other still hears the active: the operator's view is what is cut, not the
        # active. Promoting now would make two actives. (A stopped active's link is
        # gone; the other just has not noticed yet.)
        return f"{active} is unreachable from the operator but not from {other}"
    if other in obs.fenced:
        return f"{active} is down and {other} is fenced"
    if b.damaged:
        return f"{active} is down and {other}'s journal is damaged: promote it with force"
    if not b.ready and not obs.allow_data_loss and not _kept_everything(obs, active, other):
        return f"{active} is down and {other} is not ready: not promoting it"
    if b.ready and not obs.allow_data_loss and obs.lease_guard == (obs.epoch, True):
        # Its readiness is measured on its own monotonic clock; one that did not count a
        # freeze (a suspended VM) comes back "ready" though the active went on alone
        # meanwhile. The mark precedes the first confirm alone whatever the clocks say
        # (tests/test_guard_skew.py); a catch-up since is written as 0 at once.
        return f"{active} is down and its Lease shows it went on alone since {other} caught up"
    return None


def _went_alone_during(obs: Observation, sw: Switchover, source: BrokerName) -> Decision | None:
    """The source's Lease says it went on alone (a mark of the epoch it was active in)
    since the target caught up: the target, ready when the switchover began, lacks what
    the source then confirmed. A source the operator could not reach never took the
    demotion; cut from its passive too, it marked, went on alone and confirmed, then died
    or let its Lease lapse (tests/test_attack_leasewatch.py). The target is not activated
    (unless forced or `allowDataLoss`); a source back as a passive, which holds what it
    confirmed, is re-activated in a new epoch, the request handled as aborted. None: no
    mark, the switchover goes on."""
    guard = obs.lease_guard
    if (
        sw.force
        or obs.allow_data_loss
        or obs.lease_holder != source
        or guard is None
        or not guard[1]
        or guard[0] < sw.epoch - 1  # the demotion is in `sw.epoch`: the source's is before
    ):
        return None
    why = f"{source}'s Lease shows it went on alone since {sw.target} caught up"
    view = obs.brokers[source]
    if not (
        view.reachable
        and view.role == "passive"
        and view.epoch >= sw.epoch
        and source not in obs.fenced
        and not view.damaged
    ):
        return Decision(degraded=f"{why}: not activating {sw.target}", failing_over=True)
    epoch = sw.epoch + 1
    return Decision(failing_over=True).add(
        SetRole(source, "active", epoch),
        Route(source),
        Record(
            source,
            epoch,
            reason=f"{sw.kind} aborted ({why}); {source} re-activated",
            handled_promote=sw.request_id if sw.kind == "promote" else None,
            handled_recover=sw.request_id if sw.kind == "recover" else None,
        ),
        Event("SwitchoverAborted", f"{sw.kind} to {sw.target} aborted: {why}", warning=True),
    )


def _kept_everything(obs: Observation, active: BrokerName, other: BrokerName) -> bool:
    """The other broker holds every message the active confirmed, though its readiness
    window (the active's last echo + the replication timeout) has passed: it had caught
    up in this epoch, and the active's Lease, lapsed or left by a process that is gone,
    says the active never confirmed alone since (it writes that before it does:
    broker/lease.py). A slow or restarted operator may look long after the link's loss."""
    b = obs.brokers[other]
    return (
        b.caught_up_epoch == obs.epoch
        and b.role == "passive"
        and obs.lease_holder == active
        and (obs.lease_expired or obs.brokers[active].stopped)
        and obs.lease_guard == (obs.epoch, False)
    )


def _marked_against(obs: Observation, name: BrokerName, view: BrokerView) -> bool:
    """The Lease's holder, another broker, marked that it went on alone since `view`
    caught up (a mark of the epoch it caught up in, or later): `view` lacks what the
    holder then confirmed, whatever its readiness says (a freeze its clock missed,
    tests/test_guard_skew.py). Not with `allowDataLoss`."""
    guard = obs.lease_guard
    return (
        not obs.allow_data_loss
        and guard is not None
        and guard[1]
        and obs.lease_holder not in (None, name)
        and guard[0] >= (view.caught_up_epoch or 0)
    )


def _no_active(obs: Observation) -> Decision:
    """No active recorded (fenced, a failed switchover, a lost status): activate a ready
    broker, once the Lease's holder is known not to serve."""
    names: tuple[BrokerName, ...] = ("primary", "backup")
    holder = obs.brokers[obs.lease_holder] if obs.lease_holder is not None else None
    if (
        holder is not None
        and not obs.lease_expired
        and not holder.stopped
        and not (holder.reachable and holder.role == "passive")
    ):
        # A status lost or restored while the holder is cut off: it may still serve.
        return Decision(degraded=f"no active recorded; waiting for {holder.name}'s Lease")
    for name in names:
        view = obs.brokers[name]
        if (
            name not in obs.fenced
            and view.reachable
            and not (view.damaged and view.role != "active")
            and (view.ready or view.role == "active")
            and not (view.role != "active" and _marked_against(obs, name, view))
        ):
            epoch = obs.epoch + 1
            return Decision().add(
                SetRole(name, "active", epoch),
                Route(name),
                Record(name, epoch, reason="no active broker"),
                Event("Activated", f"{name} activated in epoch {epoch}: there was no active"),
            )
    return Decision(degraded="no broker can be activated without loss")


def _fence(obs: Observation, request_id: str, broker: BrokerName, fence: bool) -> Decision:
    """Fence (stop serving and replicating) or unfence a broker.

    A fenced active is demoted (the virtual IP leaves it first); the other broker is
    then activated by the steady state if it is ready, in a newer epoch. A fenced
    broker is never promoted and not told to replicate; unfencing lets rule 4 bring
    it back as a passive.
    """
    fenced = obs.fenced | {broker} if fence else obs.fenced - {broker}
    if not fence:
        return Decision().add(
            Record(obs.active, obs.epoch, handled_fence=request_id, fenced=fenced),
            Event("Unfenced", f"{broker} unfenced (request {request_id})"),
        )
    if obs.active == broker:
        epoch = obs.epoch + 1
        return Decision(failing_over=True).add(
            Route(None),
            SetRole(broker, "passive", epoch),
            Record(None, epoch, handled_fence=request_id, fenced=fenced, reason=f"{broker} fenced"),
            Event(
                "Fenced",
                f"{broker} fenced: demoted in epoch {epoch} (request {request_id})",
                warning=True,
            ),
        )
    actions: list[Action] = []
    if obs.brokers[broker].reachable:
        actions.append(SetRole(broker, "passive", obs.epoch))  # stops its replication
    return Decision().add(
        *actions,
        Record(obs.active, obs.epoch, handled_fence=request_id, fenced=fenced),
        Event(
            "Fenced", f"{broker} fenced: no longer replicating (request {request_id})", warning=True
        ),
    )


def _start_promote(obs: Observation, request_id: str, target: BrokerName, force: bool) -> Decision:
    """Rule 6: switchover to `target`; it must be ready unless forced."""
    if obs.active == target:
        return Decision().add(
            Record(obs.active, obs.epoch, handled_promote=request_id),
            Event("PromoteIgnored", f"{target} is already active (request {request_id})"),
        )
    view = obs.brokers[target]
    refusal = (
        f"{target} is fenced" if target in obs.fenced
        else f"{target}'s journal is damaged (it may lack messages it confirmed); use force "
        "to promote it anyway" if view.damaged and not force
        else f"{target} is {'unreachable' if not view.reachable else 'not ready'}; use force "
        "to promote anyway" if not view.reachable or (not view.ready and not force)
        else None
    )  # fmt: skip
    if refusal is not None:
        return Decision().add(
            Record(obs.active, obs.epoch, handled_promote=request_id),
            Event("PromoteRefused", f"{refusal} (request {request_id})", warning=True),
        )
    switchover = Switchover(request_id, "promote", target, obs.epoch + 1, force)
    return _continue_switchover(obs, switchover, starting=True)


def _start_recovery(obs: Observation, request_id: str) -> Decision:
    """Rule 5: fail back to the primary, once it has caught up."""
    if obs.active == "primary":
        return Decision().add(
            Record(obs.active, obs.epoch, handled_recover=request_id),
            Event("RecoverIgnored", f"the primary is already active (request {request_id})"),
        )
    primary = obs.brokers["primary"]
    if "primary" in obs.fenced:
        return Decision().add(
            Record(obs.active, obs.epoch, handled_recover=request_id),
            Event("RecoverRefused", f"the primary is fenced (request {request_id})", True),
        )
    if not (primary.reachable and primary.ready) or primary.damaged:
        # Not handled yet: the request waits until the primary has caught up (which also
        # heals a damaged journal).
        return Decision(degraded="recovery requested: waiting for the primary to catch up")
    switchover = Switchover(request_id, "recover", "primary", obs.epoch + 1)
    return _continue_switchover(obs, switchover, starting=True)


def _continue_switchover(obs: Observation, sw: Switchover, starting: bool = False) -> Decision:
    """Demote the current active, wait until it reports passive, then activate the target."""
    decision = Decision(failing_over=True)
    source = OTHER[sw.target]
    view = obs.brokers[source]
    why = (
        "fenced" if sw.target in obs.fenced
        else "damaged (journal)" if obs.brokers[sw.target].damaged and not sw.force
        else None
    )  # fmt: skip
    if why is not None and not starting:
        # Fenced, or restarted on a damaged journal, half-way: the switchover stops; the
        # steady state activates whoever can.
        return decision.add(
            Record(None, sw.epoch, reason=f"{sw.kind} aborted: {sw.target} {why}",
                   handled_promote=sw.request_id if sw.kind == "promote" else None,
                   handled_recover=sw.request_id if sw.kind == "recover" else None),
            Event("SwitchoverAborted", f"{sw.target} was {why} during the {sw.kind}", True),
        )  # fmt: skip
    if starting:
        decision.add(
            Route(None),
            SetRole(source, "passive", sw.epoch),
            Record(None, sw.epoch, switchover=sw, reason=f"{sw.kind} to {sw.target}"),
            Event("SwitchoverStarted", f"demoting {source} before activating {sw.target}"),
        )
        return decision
    if view.reachable and not (view.role == "passive" and view.epoch >= sw.epoch):
        # The demotion did not take (lost request, restarted broker): ask again.
        return decision.add(SetRole(source, "passive", sw.epoch))
    if (
        not view.reachable
        and not view.stopped
        and obs.lease_holder == source
        and not obs.lease_expired
    ):
        # Unreachable is not stopped: it may still serve until its Lease lapses and it
        # fences itself. Found by the property test (two actives otherwise).
        decision.degraded = f"{source} is unreachable; waiting for its Lease to expire"
        return decision
    marked = _went_alone_during(obs, sw, source)
    if marked is not None:
        return marked
    target = obs.brokers[sw.target]
    if not target.reachable:
        decision.degraded = f"waiting for {sw.target} to become reachable to activate it"
        return decision
    # Activated in a newer epoch than the demotion's: the target may have learned the
    # demotion epoch through its replication link, and activation needs a new epoch.
    epoch = sw.epoch + 1
    record = Record(
        sw.target,
        epoch,
        failover_from=source,
        reason=sw.kind,
        handled_promote=sw.request_id if sw.kind == "promote" else None,
        handled_recover=sw.request_id if sw.kind == "recover" else None,
    )
    # The source is pointed at the new active by the steady state (rule 4) next time;
    # a request to it here could fail (it may be down) and must not hold up the record.
    return decision.add(
        SetRole(sw.target, "active", epoch, force=sw.force and target.damaged),
        Route(sw.target),
        record,
        Event("SwitchedOver", f"{sw.target} active in epoch {epoch} ({sw.kind})"),
    )
