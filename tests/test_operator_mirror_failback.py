"""DR failback as one command (docs/mirror.md, "Failback"): `kubectl twinmq mirror failback`
against a real API server, each site's operator pass (operator/mirroring.py, as
operator/main.py runs it) reading and writing its BrokerCluster there, and two real
brokers. After a forced failover the old source is fenced, reversed and re-seeded (what
only it held goes to its orphan queue), the mirror catches up, the site that took over is
demoted and the old source promoted with its token; after a switchover, the same with
only the delta. Both sites are probed with a real publish at every pass: never both
writable.
"""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pika
import pytest
from mirrorsites import Sites, channel, demote, mirror_status, publish
from test_mirror_reseed import ORPHANS, bodies, orphans

from twinmq.broker.api import MirrorStatus
from twinmq.cli import kubectl
from twinmq.operator.kube import Kube
from twinmq.operator.main import now_iso
from twinmq.operator.mirroring import (
    failback_condition,
    failback_step,
    state_of,
    switch_requests,
)
from twinmq.operator.models import (
    GROUP,
    KIND,
    VERSION,
    BrokerClusterSpec,
    HandledRequests,
    MirrorState,
)
from twinmq.testing.launcher import BrokerProcess
from twinmq.testing.queues import drain
from twinmq.testing.waiting import wait_for

API_VERSION = f"{GROUP}/{VERSION}"
NS = "default"


def writable(broker: BrokerProcess) -> bool:
    """Whether the site takes a client's write now: a confirmed publish (unroutable, so it
    leaves nothing behind) is acknowledged. A replica closes the channel (403), a site
    being demoted the connection (320), a stopped one refuses it."""
    try:
        connection, ch = channel(broker)
    except pika.exceptions.AMQPError:
        return False
    try:
        ch.confirm_delivery()
        ch.basic_publish("", "nowhere.probe", b"probe")
        return True
    except pika.exceptions.AMQPError:
        return False
    finally:
        if connection.is_open:
            connection.close()


class SiteOperator:
    """One site's operator, pass by pass as operator/main.py runs it: `status.mirror`
    rebuilt from the active broker's `/status`, what only the operator knows (the token,
    the last switch, the failback's progress) carried over from the BrokerCluster's status,
    the requests handled, Events posted, the status written back through the API server's
    status subresource (so every field must survive the CRD's schema)."""

    def __init__(self, api: Kube, name: str, broker: BrokerProcess, mirror: dict[str, Any]):
        self.api, self.name, self.broker = api, name, broker
        api.apply({"apiVersion": API_VERSION, "kind": KIND,
                   "metadata": {"name": name, "namespace": NS},
                   "spec": {"mirror": mirror}})  # fmt: skip
        self.clusters = api.dynamic.resources.get(api_version=API_VERSION, kind=KIND)
        self.events: list[tuple[str, str, str]] = []

    def reconcile(self) -> MirrorState | None:
        obj = self.api.get(API_VERSION, KIND, NS, self.name)
        assert obj is not None
        spec = BrokerClusterSpec.model_validate(obj["spec"])
        status = obj.get("status") or {}
        seen = mirror_status(self.broker)
        new = state_of(spec.mirror, MirrorStatus.model_validate(seen) if seen else None)
        assert new is not None
        if status.get("mirror"):
            old = MirrorState.model_validate(status["mirror"])
            new.demotion_token, new.last_switch = old.demotion_token, old.last_switch
            new.failback = old.failback
        handled = HandledRequests.model_validate(status.get("handledRequests") or {})
        active = self.broker.admin if seen is not None else None
        events = switch_requests(spec.requests, handled, new, active, now_iso())
        for kind, reason, message in events:
            self.api.record_event(obj, reason, message, 10, warning=kind == "Warning")
        self.events += events
        self.clusters.status.patch(
            body={"status": {"mirror": new.model_dump(by_alias=True),
                             "handledRequests": handled.model_dump(by_alias=True)}},
            name=self.name, namespace=NS, content_type="application/merge-patch+json",
        )  # fmt: skip
        return new


class Operators:
    """Both sites' operators, a pass each every 0.2 s in a thread (as the operator's timer
    does, faster), probing after each pass whether both sites take writes."""

    def __init__(self, a: SiteOperator, b: SiteOperator) -> None:
        self.sites = (a, b)
        self.both_writable: list[str] = []
        self.phases: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.error: BaseException | None = None

    def __enter__(self) -> Operators:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                for site in self.sites:
                    state = site.reconcile()
                    if (
                        state is not None
                        and state.failback.phase
                        and (not self.phases or self.phases[-1] != state.failback.phase)
                    ):
                        self.phases.append(state.failback.phase)
                a, b = self.sites
                if writable(a.broker) and writable(b.broker):
                    self.both_writable.append(f"{self.phases[-1:]}: both sites took a write")
                self._stop.wait(0.2)
        except BaseException as exc:  # surfaced by __exit__
            self.error = exc


@pytest.fixture
def kubeconfig(kube_apiserver: Any) -> str:
    return str(kube_apiserver.kubeconfig)


def operators(api: Kube, sites: Sites, a_name: str, b_name: str) -> tuple[SiteOperator, ...]:
    """Site A (the first source) and site B (its mirror, which names A as its target:
    switchable), as BrokerClusters in the API server."""
    a = SiteOperator(api, a_name, sites.source, {"role": "source", "secretName": "dr",
                     "target": {"host": f"{b_name}.{NS}.svc"}})  # fmt: skip
    b = SiteOperator(api, b_name, sites.mirror, {"role": "replica", "secretName": "dr",
                     "target": {"host": f"{a_name}.{NS}.svc"}})  # fmt: skip
    return a, b


def failback(kubeconfig: str, site: str) -> tuple[int, str, str, float]:
    """`kubectl twinmq mirror failback SITE`: exit code, output, errors, seconds."""
    out, err = io.StringIO(), io.StringIO()
    started = time.monotonic()
    code = kubectl.run(["mirror", "failback", site, "--kubeconfig", kubeconfig, "-n", NS,
                        "--timeout", "120"], out, err)  # fmt: skip
    return code, out.getvalue(), err.getvalue(), time.monotonic() - started


@pytest.fixture
def sites(tmp_path: Path) -> Iterator[Sites]:
    with Sites(tmp_path, reversible=True) as both:
        both.caught_up()
        yield both


def test_failback_after_a_forced_failover_reattaches_reseeds_and_hands_back_never_two_writers(
    api: Kube, kubeconfig: str, sites: Sites
) -> None:
    a, b = operators(api, sites, "fo-a", "fo-b")
    publish(sites.source, "orders", bodies("a", 10))
    sites.caught_up()
    sites.mirror.stop()  # a partition: B never sees what follows
    publish(sites.source, "orders", bodies("lost", 5))
    sites.source.kill()  # site A is gone with 5 confirmed, unmirrored messages
    sites.mirror.start()
    sites.promote_mirror(force=True)  # DR failover: B is the source
    publish(sites.mirror, "orders", bodies("b", 300))  # a backlog for A while it is away
    sites.source.start()  # A returns, still a source in its journal until B's epoch fences it
    wait_for("A fenced", lambda: (mirror_status(sites.source) or {}).get("role") == "replica")
    with Operators(a, b) as ops:
        code, out, err, seconds = failback(kubeconfig, "fo-a")
        wait_for("both operators saw the end", lambda: ops.phases[-1:] == ["Done"])
    assert (code, err) == (0, ""), out
    print(f"failback after a forced failover, 300-message backlog: {seconds:.2f} s\n{out}")
    assert ops.both_writable == []
    assert ops.phases[-2:] == ["Promoting", "Done"]
    assert set(ops.phases) <= {"Reattaching", "Syncing", "Demoting", "Promoting", "Done"}
    assert [line.split(": ")[1] for line in out.splitlines()
            if line.startswith(f"{NS}/fo-b")][-2:] == ["Promoting", "Done"]  # fmt: skip
    assert "failed back to default/fo-a" in out
    # A is the source again, holding everything B had; what only A had is kept aside.
    assert writable(sites.source) and not writable(sites.mirror)
    assert orphans(sites.source) == 5
    assert sorted(drain(sites.source.url, ORPHANS)) == sorted(bodies("lost", 5))
    assert drain(sites.source.url, "orders") == [*bodies("a", 10), *bodies("b", 300)]
    # B is A's mirror again: A's next change reaches it.
    publish(sites.source, "orders", [b"after"])
    sites.caught_up()
    found = api.get(API_VERSION, KIND, NS, "fo-b")
    assert found is not None
    assert found["status"]["handledRequests"]["mirrorFailback"].startswith("mirror-failback")
    assert found["status"]["mirror"]["failback"]["phase"] == "Done"
    assert found["status"]["mirror"]["role"] == "replica"
    assert ("Normal", "MirrorFailedBack") in [e[:2] for e in b.events]


def test_failback_after_a_switchover_moves_only_the_delta_and_is_handled_once(
    api: Kube, kubeconfig: str, sites: Sites
) -> None:
    a, b = operators(api, sites, "sw-a", "sw-b")
    publish(sites.source, "orders", bodies("a", 20))
    token = demote(sites.source).token
    sites.promote_mirror(token)
    publish(sites.mirror, "orders", bodies("b", 20))
    with Operators(a, b) as ops:
        code, out, err, seconds = failback(kubeconfig, "sw-a")
        wait_for("both operators saw the end", lambda: ops.phases[-1:] == ["Done"])
        print(f"failback after a switchover: {seconds:.2f} s\n{out}")
        assert (code, err) == (0, ""), out
        done = len(b.events)
        time.sleep(1)  # a few more passes: the handled request is not replayed
        assert len(b.events) == done
    assert ops.both_writable == []
    assert orphans(sites.source) == 0  # a switchover leaves nothing behind
    assert drain(sites.source.url, "orders") == [*bodies("a", 20), *bodies("b", 20)]


def test_a_failback_asked_of_a_replica_or_a_site_without_a_mirror_is_refused_once(
    sites: Sites,
) -> None:
    state, handled = MirrorState(role="replica", state="Connected"), HandledRequests()
    events = failback_step("fb-1", handled, state, sites.mirror.admin, now_iso())
    assert [e[:2] for e in events] == [("Normal", "MirrorFailback"),
                                       ("Warning", "MirrorFailbackRefused")]  # fmt: skip
    assert handled.mirror_failback == "fb-1" and state.failback.phase == "Refused"
    assert "a failback is asked of the site that is the source now" in state.failback.message
    assert failback_condition(state)[:3] == ("FailingBack", False, "Refused")  # type: ignore[index]
    assert failback_condition(MirrorState(role="source")) is None  # none asked
    assert writable(sites.source) and not writable(sites.mirror)  # nothing changed
    # Before any broker answers, the role shown is the spec's first one: wait, not refuse.
    unheard, handled = MirrorState(role="replica"), HandledRequests()
    assert [e[:2] for e in failback_step("fb-3", handled, unheard, None, now_iso())] == [
        ("Normal", "MirrorFailback")
    ]
    assert handled.mirror_failback is None and unheard.failback.phase == "Reattaching"
    handled = HandledRequests()
    ((kind, reason, _),) = failback_step("fb-2", handled, None, sites.source.admin, now_iso())
    assert (kind, reason, handled.mirror_failback) == ("Warning", "MirrorFailbackRefused", "fb-2")


def test_a_failback_waits_while_the_other_site_is_away_and_goes_on_when_it_returns(
    sites: Sites,
) -> None:
    """Nothing is demoted while the other site cannot take over: the source stays writable
    and the request stays in Reattaching (not handled) until the link is back."""
    token = demote(sites.source).token
    sites.promote_mirror(token)
    sites.source.stop()  # the old source, to be the new replica, is away
    handled = HandledRequests()

    def step(state: MirrorState) -> str:
        seen = MirrorStatus.model_validate(mirror_status(sites.mirror))
        fresh = state_of(BrokerClusterSpec.model_validate({"mirror": {
            "role": "replica", "secretName": "dr", "target": {"host": "a.default.svc"}}}).mirror,
            seen)  # fmt: skip
        assert fresh is not None
        fresh.failback, fresh.demotion_token = state.failback, state.demotion_token
        failback_step("fb-1", handled, fresh, sites.mirror.admin, now_iso())
        state.failback, state.role = fresh.failback, fresh.role
        return fresh.failback.phase

    state = MirrorState(role="source")
    for _ in range(3):
        assert step(state) == "Reattaching"
    assert handled.mirror_failback is None and writable(sites.mirror)
    assert "waiting for the link" in state.failback.message
    assert failback_condition(state)[:3] == ("FailingBack", True, "Reattaching")  # type: ignore[index]
    sites.source.start()
    wait_for("demoted", lambda: step(state) == "Promoting", 60)
    assert state.failback.token and not writable(sites.mirror) and not writable(sites.source)
