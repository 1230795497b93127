"""The failover algorithm against random event sequences (hypothesis), and worked cases.

A small simulated pair stands in for the brokers: it follows the brokers' own
rules for `POST /role` (stale epochs refused, activation needs a new epoch) and
knows the ground truth `decide` cannot see: which broker holds every confirmed
message. After every step the invariants are checked:

- never two active brokers in one epoch (nor two live actives at all here);
- never a promotion that loses confirmed messages unless the spec allows it
  (or a forced promote asked for it);
- during recovery, the primary is activated only once the backup reports passive;
- a damaged broker (journal corruption found at restart, not healed by a catch-up)
  is never asked to become active unless a forced promote asked for it.

Kubernetes' report of a broker's process (pod, container state, restart count) may
lag behind the truth but never runs ahead of it: `stopped` is only ever true for a
broker whose activated process is really gone. The status may be lost or go back
to an older version (a restore): the epoch is then learned from the brokers.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from hypothesis import given, settings
from hypothesis import strategies as st

from twinmq.operator.failover import (
    OTHER,
    BrokerView,
    Decision,
    Event,
    Observation,
    Record,
    Route,
    SetRole,
    Switchover,
    decide,
)
from twinmq.operator.models import BrokerName

NAMES: tuple[BrokerName, ...] = ("primary", "backup")


@dataclass
class SimBroker:
    """A broker process as the simulation knows it."""

    name: BrokerName
    alive: bool = True
    isolated: bool = False  # alive, but the operator cannot reach it
    role: str = "passive"
    epoch: int = 0
    linked: bool = False  # replicating from the active right now
    has_all: bool = True  # holds every confirmed message (ground truth)
    incarnation: int = 0  # bumped by every restart of its process
    activated: int | None = None  # the incarnation last activated
    reported: tuple[int, bool] = (0, True)  # Kubernetes' (lagging) view: incarnation, running
    damaged: bool = False  # its journal recovered with corruption; healed by a catch-up
    caught_up_epoch: int | None = None  # the epoch of the active it last caught up with
    fresh: bool = True  # passive: within its readiness window (the active's last echo)

    @property
    def stopped(self) -> bool:
        """What the operator learns from Kubernetes: the activated process is gone."""
        return self.activated is not None and self.reported != (self.activated, True)


@dataclass
class World:
    """Two brokers, the operator's status, the Lease, pending requests."""

    brokers: dict[BrokerName, SimBroker] = field(
        default_factory=lambda: {n: SimBroker(n) for n in NAMES}
    )
    active: BrokerName | None = None
    epoch: int = 0
    switchover: Switchover | None = None
    lease_holder: BrokerName | None = None  # the broker that renews the active Lease
    lease_expired: bool = False
    # The replication guard the active writes into its Lease: (epoch, alone). A broker
    # marks `alone` before confirming what its caught-up passive lacks (broker/lease.py).
    lease_guard: tuple[int, bool] | None = None
    allow_data_loss: bool = False
    promote: tuple[str, BrokerName, bool] | None = None
    recover: str | None = None
    vip: BrokerName | None = None
    next_id: int = 0
    lost_requests: set[BrokerName] = field(default_factory=set)
    fence: tuple[str, BrokerName, bool] | None = None
    fenced: frozenset[BrokerName] = frozenset()
    violations: list[str] = field(default_factory=list)
    history: list[tuple[BrokerName | None, int]] = field(default_factory=list)  # statuses

    # -- what the operator sees ------------------------------------------------------------

    def observe(self) -> Observation:
        views = {}
        for name, b in self.brokers.items():
            seen = b.alive and not b.isolated
            views[name] = BrokerView(
                name, seen, b.role if seen else "unknown", b.epoch,  # type: ignore[arg-type]
                ready=b.alive and b.role == "passive" and b.has_all and b.fresh,
                caught_up_epoch=b.caught_up_epoch if seen and b.role == "passive" else None,
                link_connected=b.alive and b.linked,
                replicating_from_active=b.linked, stopped=b.stopped,
                damaged=seen and b.damaged,
            )  # fmt: skip
        return Observation(
            brokers=views, active=self.active, epoch=self.epoch,
            lease_holder=self.lease_holder, lease_expired=self.lease_expired,
            lease_guard=self.lease_guard,
            allow_data_loss=self.allow_data_loss, switchover=self.switchover,
            promote_request=self.promote, recover_request=self.recover, routed=self.vip,
            fence_request=self.fence, fenced=self.fenced,
        )  # fmt: skip

    def serving_active(self) -> SimBroker | None:
        live = [b for b in self.brokers.values() if b.alive and b.role == "active"]
        return live[0] if live else None

    # -- applying decisions, as the adapter and the brokers would -------------------------------

    def apply(self, decision: Decision) -> None:
        for action in decision.actions:
            if isinstance(action, SetRole):
                if not self._set_role(action):
                    break  # as the adapter does: the rest depended on it
            elif isinstance(action, Route):
                self.vip = action.broker
            elif isinstance(action, Record):
                self.active, self.epoch = action.active, action.epoch
                self.history.append((self.active, self.epoch))
                self.switchover = action.switchover
                # The spec may hold a newer request than the one handled: only an equal
                # id counts as handled (as status.handledRequests does).
                if self.promote is not None and action.handled_promote == self.promote[0]:
                    self.promote = None
                if action.handled_recover is not None and action.handled_recover == self.recover:
                    self.recover = None
                if self.fence is not None and action.handled_fence == self.fence[0]:
                    self.fence = None
                if action.fenced is not None:
                    self.fenced = action.fenced
            else:
                assert isinstance(action, Event)

    def _set_role(self, action: SetRole) -> bool:
        b = self.brokers[action.broker]
        if not b.alive or b.isolated:
            return False  # the request fails; the next reconcile sees it
        if action.broker in self.lost_requests:
            self.lost_requests.discard(action.broker)
            return False  # timed out on the way: the broker never saw it
        if action.epoch < b.epoch or (
            action.epoch == b.epoch and action.role == "active" and b.role != "active"
        ):
            return False  # 409 stale epoch
        if action.role == "active":
            if b.name in self.fenced:
                self.violations.append(f"fenced {b.name} promoted")
            other = self.brokers[OTHER[action.broker]]
            # A switchover in progress carries the force of the request that began it.
            sw = self.switchover
            forced = sw.force if sw is not None else (self.promote is not None and self.promote[2])
            if b.damaged:
                if not forced:
                    self.violations.append(f"damaged {b.name} activated without a forced promote")
                if not action.force:
                    return False  # 409 broker damaged
            if not b.has_all and not (self.allow_data_loss or forced):
                self.violations.append(f"{b.name} promoted without every confirmed message")
            if other.alive and other.role == "active":
                self.violations.append(f"{b.name} activated while {other.name} is active")
            sw = self.switchover
            if sw is not None and sw.kind == "recover" and other.alive and other.role != "passive":
                self.violations.append("primary activated before the backup reported passive")
            b.role, b.epoch, b.linked, b.has_all = "active", action.epoch, False, True
            # Kubernetes has reported a restart long before a restarted process can be
            # activated (it must boot, be probed, be activated, be seen serving).
            b.activated, b.reported = b.incarnation, (b.incarnation, True)
            self.lease_holder, self.lease_expired = b.name, False
            self.lease_guard = (action.epoch, False)  # its first renewal
            b.caught_up_epoch = None
            # From now on only the new active holds what it confirms.
            other.linked = False
            other.has_all = False if other.role == "passive" else other.has_all
            return True
        other = self.brokers[OTHER[action.broker]]
        if b.role == "active" and other.alive and other.linked:
            # Its passive reconnects and learns the new epoch over the link's handshake.
            other.epoch = max(other.epoch, action.epoch)
        b.role, b.epoch = "passive", max(b.epoch, action.epoch)
        active = self.serving_active()
        b.linked = False
        if action.replicate_from is not None and active is not None:
            b.linked = active.name == action.replicate_from and active.epoch <= b.epoch
        return True

    # -- the world's events --------------------------------------------------------------------

    def step(self, event: tuple[str, BrokerName, bool]) -> None:
        kind, name, flag = event
        b = self.brokers[name]
        if kind == "crash":
            b.alive, b.linked = False, False
            if flag:  # Kubernetes reports it at once (else later: kubelet_reports)
                b.reported = (b.incarnation, False)
            if b.role == "active":
                self.brokers[OTHER[name]].linked = False  # its passive loses the link
        elif kind == "isolate":
            b.isolated = flag  # a partition between the operator and this broker, or healed
        elif kind == "restart" and not b.alive:
            # Rule 4: a broker always starts passive (its journal keeps what it had).
            b.alive, b.role, b.linked, b.caught_up_epoch = True, "passive", False, None
            b.incarnation += 1
            if flag:
                b.reported = (b.incarnation, True)
        elif kind == "kubelet_reports":
            b.reported = (b.incarnation, b.alive)
        elif kind == "lose_status":
            # A restore: without status (Velero's default), or an older version of it.
            old = self.history[len(self.history) // 2] if self.history else (None, 0)
            self.active, self.epoch = (None, 0) if flag else old
            self.switchover = None
        elif kind == "catch_up" and b.alive and b.role == "passive" and b.linked:
            b.has_all, b.damaged = True, False  # a complete catch-up heals a damaged journal
            b.fresh = True
            active = self.serving_active()
            if active is not None:
                b.caught_up_epoch = active.epoch
                self.lease_guard = (active.epoch, False)  # written at once
        elif kind == "stale" and not b.linked:
            b.fresh = False  # a silent link: its readiness window ran out
        elif kind == "corrupt" and not b.alive:
            # Its journal is found corrupt when it restarts: it may lack what it confirmed.
            b.damaged, b.has_all = True, False
        elif kind == "cut_link":
            b.linked = False
        elif kind == "publish":
            # Confirms wait for a linked passive; an active alone (degraded) goes on.
            active = self.serving_active()
            if active is not None:
                for other in self.brokers.values():
                    if other is not active and not (other.linked and other.has_all):
                        if other.caught_up_epoch == active.epoch:
                            # It goes on alone after its passive caught up: marked first.
                            self.lease_guard = (active.epoch, True)
                        other.has_all = False
        elif kind == "lease_expires":
            # The active renews its Lease while it lives (an isolated one still reaches the
            # API server here); only a dead or demoted active lets it lapse.
            holder = self.brokers[self.lease_holder] if self.lease_holder else None
            if holder is None or not (holder.alive and holder.role == "active"):
                self.lease_expired = True
        elif kind == "promote":
            self.next_id += 1
            self.promote = (f"p{self.next_id}", name, flag)
        elif kind == "recover":
            self.next_id += 1
            self.recover = f"r{self.next_id}"
        elif kind == "fence":
            self.next_id += 1
            self.fence = (f"f{self.next_id}", name, flag)
        elif kind == "lose_request":
            self.lost_requests.add(name)
        elif kind == "reconcile":
            self.apply(decide(self.observe()))
        self.check()

    def check(self) -> None:
        if self.vip is not None:
            routed = self.brokers[self.vip]
            if routed.alive and not routed.isolated and routed.role != "active":
                self.violations.append(f"virtual IP on {self.vip}, which is not active")
        actives = [b for b in self.brokers.values() if b.alive and b.role == "active"]
        if len(actives) > 1:
            self.violations.append(f"two live actives: {[(b.name, b.epoch) for b in actives]}")
        epochs = [b.epoch for b in actives]
        if len(epochs) != len(set(epochs)):
            self.violations.append("two actives in one epoch")


EVENTS = st.tuples(
    st.sampled_from(
        ["crash", "restart", "catch_up", "cut_link", "publish", "lease_expires", "promote",
         "recover", "lose_request", "isolate", "fence", "kubelet_reports", "lose_status",
         "corrupt", "stale"]
    ),
    st.sampled_from(NAMES),
    st.booleans(),
)  # fmt: skip


def _started(allow_data_loss: bool = False) -> World:
    world = World(allow_data_loss=allow_data_loss)
    world.step(("reconcile", "primary", False))
    world.step(("reconcile", "primary", False))
    world.step(("catch_up", "backup", False))
    return world


def _run(world: World, events: list[tuple[str, BrokerName, bool]]) -> World:
    # The operator reconciles after every change it is told of (and on a timer).
    for event in events:
        world.step(event)
        world.step(("reconcile", "primary", False))
    return world


@settings(max_examples=1000, deadline=None, database=None)
@given(st.lists(EVENTS, min_size=3, max_size=60), st.booleans())
def test_random_event_sequences_keep_every_invariant(
    events: list[tuple[str, BrokerName, bool]], allow_data_loss: bool
) -> None:
    world = _run(_started(allow_data_loss), events)
    assert not world.violations, world.violations


REQUEST_EVENTS = st.tuples(
    st.sampled_from(["promote", "recover", "lose_request", "catch_up", "crash", "restart",
                     "isolate", "lease_expires", "fence", "kubelet_reports", "lose_status",
                     "corrupt"]),
    st.sampled_from(NAMES),
    st.booleans(),
)  # fmt: skip


@settings(max_examples=500, deadline=None, database=None)
@given(st.lists(REQUEST_EVENTS, min_size=3, max_size=40))
def test_switchovers_under_lost_requests_keep_every_invariant(
    events: list[tuple[str, BrokerName, bool]],
) -> None:
    world = _run(_started(), events)
    assert not world.violations, world.violations


DAMAGE_EVENTS = st.tuples(
    st.sampled_from(["crash", "corrupt", "restart", "kubelet_reports", "publish", "cut_link",
                     "catch_up", "lease_expires", "promote", "recover"]),
    st.sampled_from(NAMES),
    st.booleans(),
)  # fmt: skip


@settings(max_examples=500, deadline=None, database=None)
@given(st.lists(DAMAGE_EVENTS, min_size=3, max_size=30), st.booleans())
def test_a_damaged_broker_is_never_activated_without_a_forced_promote(
    events: list[tuple[str, BrokerName, bool]], allow_data_loss: bool
) -> None:
    world = _run(_started(allow_data_loss), events)
    assert not world.violations, world.violations


def test_creation_makes_the_primary_active_in_epoch_1_and_the_backup_passive() -> None:
    world = _started()
    assert (world.active, world.epoch, world.vip) == ("primary", 1, "primary")
    backup = world.brokers["backup"]
    assert (backup.role, backup.linked, backup.epoch) == ("passive", True, 1)


def test_ready_backup_is_promoted_once_the_lease_expired_and_the_vip_moves_first() -> None:
    world = _started()
    world.step(("crash", "primary", False))
    world.step(("cut_link", "backup", False))
    assert not any(isinstance(a, SetRole) for a in decide(world.observe()).actions)
    world.step(("lease_expires", "primary", False))
    actions = decide(world.observe()).actions
    routes = [a for a in actions if isinstance(a, Route)]
    assert routes[0] == Route(None) and routes[-1] == Route("backup")
    assert actions.index(routes[0]) < actions.index(SetRole("backup", "active", 2))
    world.apply(decide(world.observe()))
    assert (world.active, world.epoch) == ("backup", 2)


def test_unready_backup_is_not_promoted_without_allow_data_loss() -> None:
    world = _started()
    world.step(("cut_link", "backup", False))
    world.step(("publish", "primary", False))  # the active went on alone
    world.step(("crash", "primary", False))
    world.step(("lease_expires", "primary", False))
    decision = decide(world.observe())
    assert not any(isinstance(a, SetRole) for a in decision.actions)
    assert any(isinstance(a, Event) and a.reason == "FailoverBlocked" for a in decision.actions)


def test_backup_that_still_hears_the_active_is_not_promoted() -> None:
    world = _started()
    obs = world.observe()
    cut_off = Observation(
        brokers={**obs.brokers, "primary": BrokerView("primary", reachable=False)},
        active="primary", epoch=1, lease_holder="primary", lease_expired=True,
    )  # fmt: skip
    decision = decide(cut_off)
    assert not any(isinstance(a, SetRole) and a.role == "active" for a in decision.actions)


def test_recovery_demotes_the_backup_then_activates_the_primary() -> None:
    world = _started()
    for event in ("crash", "lease_expires"):
        world.step((event, "primary", False))
    world.step(("cut_link", "backup", False))
    world.step(("reconcile", "primary", False))
    world.step(("restart", "primary", False))
    world.step(("reconcile", "primary", False))  # the primary rejoins as passive
    world.step(("catch_up", "primary", False))
    world.step(("recover", "primary", False))
    first = decide(world.observe())
    assert [a for a in first.actions if isinstance(a, SetRole)] == [SetRole("backup", "passive", 3)]
    world.apply(first)
    world.step(("reconcile", "primary", False))
    assert (world.active, world.epoch, world.recover) == ("primary", 4, None)  # after 3
    assert world.brokers["backup"].role == "passive" and not world.violations


def test_a_handled_request_is_not_replayed() -> None:
    world = _started()
    world.step(("promote", "backup", False))
    world.step(("reconcile", "primary", False))
    world.step(("reconcile", "primary", False))
    assert world.active == "backup" and world.promote is None
    world.step(("reconcile", "primary", False))
    assert world.active == "backup"


def _in_switchover(source: BrokerView, lease_expired: bool) -> Observation:
    target = BrokerView("backup", True, "passive", 2, ready=True)
    return Observation(
        brokers={"primary": source, "backup": target}, active=None, epoch=2,
        lease_holder="primary", lease_expired=lease_expired,
        switchover=Switchover("p1", "promote", "backup", 2),
    )  # fmt: skip


def test_a_switchover_asks_again_when_the_source_still_reports_active() -> None:
    still_active = BrokerView("primary", True, "active", 1)
    actions = decide(_in_switchover(still_active, lease_expired=False)).actions
    assert [a for a in actions if isinstance(a, SetRole)] == [SetRole("primary", "passive", 2)]


def test_a_switchover_waits_for_the_lease_of_an_unreachable_source() -> None:
    unreachable = BrokerView("primary", reachable=False)
    waiting = decide(_in_switchover(unreachable, lease_expired=False))
    assert not any(isinstance(a, SetRole) for a in waiting.actions)
    lapsed = decide(_in_switchover(unreachable, lease_expired=True))
    assert SetRole("backup", "active", 3) in lapsed.actions


def test_fencing_the_active_demotes_it_and_the_ready_backup_takes_over() -> None:
    world = _started()
    world.step(("fence", "primary", True))
    world.step(("reconcile", "primary", False))
    assert world.brokers["primary"].role == "passive" and world.fenced == {"primary"}
    world.step(("reconcile", "primary", False))
    assert (world.active, world.vip) == ("backup", "backup")
    # A fenced broker is left alone: not told to replicate, never promoted.
    world.step(("reconcile", "primary", False))
    assert not world.brokers["primary"].linked and not world.violations


def test_unfencing_brings_the_broker_back_as_a_passive() -> None:
    world = _started()
    world.step(("fence", "backup", True))
    world.step(("reconcile", "primary", False))
    assert not world.brokers["backup"].linked and world.fenced == {"backup"}
    world.step(("fence", "backup", False))
    world.step(("reconcile", "primary", False))
    world.step(("reconcile", "primary", False))
    assert world.fenced == frozenset() and world.brokers["backup"].linked


# -- a stopped active (Kubernetes reports its process gone) -------------------------------


def _promoted(decision: Decision) -> list[SetRole]:
    return [a for a in decision.actions if isinstance(a, SetRole) and a.role == "active"]


def test_an_active_reported_killed_is_replaced_at_once_without_waiting_for_its_lease() -> None:
    world = _started()
    world.step(("crash", "primary", True))  # kill -9; the kubelet reports it
    assert not world.lease_expired
    world.apply(decide(world.observe()))
    assert (world.active, world.epoch, world.vip) == ("backup", 2, "backup")
    assert not world.violations


def test_an_active_restarted_in_place_is_replaced_at_once() -> None:
    world = _started()
    world.step(("crash", "primary", False))  # not reported yet: the Lease path, VIP off
    world.step(("reconcile", "primary", False))
    assert (world.active, world.vip) == ("primary", None)
    world.step(("restart", "primary", True))  # restartCount + 1; it answers passive
    world.apply(decide(world.observe()))
    assert (world.active, world.epoch) == ("backup", 2)
    world.step(("reconcile", "primary", False))
    assert world.brokers["primary"].role == "passive" and not world.violations


def test_a_crash_kubernetes_has_not_reported_waits_for_the_lease() -> None:
    world = _started()
    world.step(("crash", "primary", False))
    assert _promoted(decide(world.observe())) == []
    world.step(("kubelet_reports", "primary", False))
    assert _promoted(decide(world.observe())) == [SetRole("backup", "active", 2)]


def test_a_partitioned_active_is_never_taken_for_stopped() -> None:
    world = _started()
    world.step(("isolate", "primary", True))
    world.step(("cut_link", "backup", False))
    assert not world.observe().brokers["primary"].stopped
    assert _promoted(decide(world.observe())) == []


def test_a_stopped_active_is_not_replaced_by_a_backup_that_had_not_caught_up() -> None:
    world = _started()
    world.step(("cut_link", "backup", False))
    world.step(("publish", "primary", False))  # confirmed by the primary alone
    world.step(("crash", "primary", True))
    decision = decide(world.observe())
    assert _promoted(decision) == []
    assert any(isinstance(a, Event) and a.reason == "FailoverBlocked" for a in decision.actions)


def test_a_stopped_active_is_replaced_even_before_the_backup_noticed_its_link_drop() -> None:
    world = _started()
    obs = world.observe()
    stopped = Observation(
        brokers={"primary": BrokerView("primary", reachable=False, stopped=True),
                 "backup": replace(obs.brokers["backup"], link_connected=True)},
        active="primary", epoch=1, lease_holder="primary", lease_expired=False, routed="primary",
    )  # fmt: skip
    assert _promoted(decide(stopped)) == [SetRole("backup", "active", 2)]


# -- the replication guard in the Lease: a slow operator still fails over ---------------


def test_a_caught_up_backup_is_promoted_after_its_window_when_the_lease_shows_no_alone() -> None:
    # A hung active (not reported stopped) and an operator that looks only after the
    # backup's readiness window ran out (restarted, or slow): the Lease says the active
    # never confirmed alone in epoch 1, and the backup caught up in epoch 1.
    world = _started()
    world.step(("crash", "primary", False))
    world.step(("stale", "backup", False))
    world.step(("lease_expires", "primary", False))
    obs = world.observe()
    assert not obs.brokers["backup"].ready and obs.lease_guard == (1, False)
    decision = decide(obs)
    assert _promoted(decision) == [SetRole("backup", "active", 2)]
    record = next(a for a in decision.actions if isinstance(a, Record))
    assert "never went on alone" in record.reason
    world.apply(decision)
    assert not world.violations


def test_a_backup_whose_active_went_on_alone_waits_however_caught_up_it_was() -> None:
    world = _started()
    world.step(("cut_link", "backup", False))
    world.step(("publish", "primary", False))  # marked alone in the Lease, then confirmed
    world.step(("crash", "primary", False))
    world.step(("lease_expires", "primary", False))
    obs = world.observe()
    assert obs.brokers["backup"].caught_up_epoch == 1 and obs.lease_guard == (1, True)
    assert _promoted(decide(obs)) == []


def test_the_lease_guard_counts_only_for_the_epoch_the_backup_caught_up_in() -> None:
    world = _started()
    world.step(("crash", "primary", False))
    world.step(("stale", "backup", False))
    world.step(("lease_expires", "primary", False))
    obs = world.observe()
    older = replace(obs.brokers["backup"], caught_up_epoch=0)
    for stale in (
        replace(obs, brokers={**obs.brokers, "backup": older}),  # caught up with another
        replace(obs, lease_guard=(0, False)),  # the Lease's guard of an older active
        replace(obs, lease_guard=None),  # a broker that writes none (an older version)
        replace(obs, lease_expired=False),  # the active may still serve
    ):
        assert _promoted(decide(stale)) == []


# -- a damaged broker (journal corruption found at restart) -------------------------------


def _damaged_backup(allow_data_loss: bool = False) -> World:
    """Started; then the backup crashed, restarted on a corrupt journal, unreported."""
    world = _started(allow_data_loss)
    world.step(("crash", "backup", True))
    world.step(("corrupt", "backup", False))
    world.step(("restart", "backup", True))
    return world


def test_a_damaged_backup_is_not_promoted_when_the_active_crashes() -> None:
    for allow_data_loss in (False, True):
        world = _damaged_backup(allow_data_loss)
        world.step(("crash", "primary", True))
        decision = decide(world.observe())
        assert _promoted(decision) == []
        assert decision.degraded is not None and "damaged" in decision.degraded
        world.apply(decision)
        assert not world.violations


def test_a_restarted_active_with_a_damaged_journal_is_not_reactivated() -> None:
    world = _run(_started(), [
        ("cut_link", "backup", False),
        ("publish", "primary", False),  # the backup cannot take over without loss
        ("crash", "primary", True),
        ("corrupt", "primary", False),
        ("restart", "primary", True),  # back passive, on a damaged journal
    ])  # fmt: skip
    assert _promoted(decide(world.observe())) == []
    assert world.brokers["primary"].role == "passive" and not world.violations


def test_a_damaged_broker_is_promoted_only_by_a_forced_promote_and_with_force() -> None:
    world = _damaged_backup()
    world.step(("promote", "backup", False))
    refused = decide(world.observe())
    assert _promoted(refused) == []
    assert any(isinstance(a, Event) and a.reason == "PromoteRefused" and "damaged" in a.message
               for a in refused.actions)  # fmt: skip
    world.apply(refused)
    world.step(("promote", "backup", True))  # forced: the user accepts the loss
    for _ in range(3):
        world.step(("reconcile", "primary", False))
    assert (world.active, world.brokers["backup"].role) == ("backup", "active")
    assert not world.violations


def test_a_damaged_broker_healed_by_a_catch_up_is_promotable_again() -> None:
    world = _damaged_backup()
    world.step(("reconcile", "primary", False))  # pointed at the active again
    world.step(("catch_up", "backup", False))
    assert not world.observe().brokers["backup"].damaged
    world.step(("crash", "primary", True))
    world.step(("reconcile", "primary", False))
    assert (world.active, world.epoch) == ("backup", 2) and not world.violations


# -- the epoch, learned from the brokers ---------------------------------------------------


def test_a_status_restored_without_its_epoch_learns_it_from_the_brokers() -> None:
    restored = Observation(
        brokers={"primary": BrokerView("primary", True, "active", 5),
                 "backup": BrokerView("backup", True, "passive", 5, ready=True,
                                      link_connected=True, replicating_from_active=True)},
        active=None, epoch=0, lease_holder="primary", lease_expired=False,
    )  # fmt: skip
    decision = decide(restored)
    assert decision.actions[0] == Record("primary", 5, reason="epoch 5 learned from the brokers")
    assert not any(isinstance(a, SetRole) for a in decision.actions)  # not epoch 1: 409


def test_a_status_behind_the_brokers_follows_the_broker_active_in_the_newest_epoch() -> None:
    behind = Observation(
        brokers={"primary": BrokerView("primary", True, "passive", 4),
                 "backup": BrokerView("backup", True, "active", 4)},
        active="primary", epoch=2, lease_holder="backup", lease_expired=False,
    )  # fmt: skip
    actions = decide(behind).actions
    assert actions[0] == Record("backup", 4, reason="epoch 4 learned from the brokers")
    assert SetRole("primary", "passive", 4, "backup") in actions
    assert not any(isinstance(a, SetRole) and a.role == "active" for a in actions)


def test_after_a_lost_status_the_next_failover_uses_an_epoch_the_brokers_accept() -> None:
    world = _started()
    world.step(("promote", "backup", False))
    for _ in range(3):
        world.step(("reconcile", "primary", False))
    world.step(("catch_up", "primary", False))
    assert (world.active, world.epoch) == ("backup", 3)
    world.step(("lose_status", "primary", True))  # restored without status
    world.step(("reconcile", "primary", False))
    assert (world.active, world.epoch) == ("backup", 3)
    world.step(("crash", "backup", True))
    world.step(("reconcile", "primary", False))
    assert (world.active, world.epoch) == ("primary", 4) and not world.violations
    assert world.brokers["primary"].role == "active"
