"""`twinmq-operator`: the kopf handlers. Observe, `decide`, apply; nothing else.

Every second (throttled to the spec's probe interval), and at once when one of
its pods changes (a broker container stopped or restarted), each BrokerCluster is
reconciled: its children are ensured, both brokers are probed on their admin
API, the Lease is read, `failover.decide` picks the actions, and they are
applied in order (role changes over the admin API, pod labels for the virtual
IP, the Lease, status, Events). The state that matters lives in the status and
the Lease; what is kept in memory (consecutive probe failures) only delays a
failover after an operator restart, it never causes one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

import kopf
from prometheus_client import start_http_server

from twinmq.broker.admin_client import AdminError
from twinmq.broker.api import BrokerStatus as BrokerReport
from twinmq.broker.names import (
    ACTIVE,
    OPERATOR_METRICS_PORT_ENV,
    OPERATOR_NAMESPACES_ENV,
    PASSIVE,
    REPLICATION_PORT,
)
from twinmq.operator import builders, metrics
from twinmq.operator.audit_runner import AuditRunner
from twinmq.operator.builders import ClusterRef, pod_name
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
from twinmq.operator.kube import Kube
from twinmq.operator.models import (
    GROUP,
    PLURAL,
    VERSION,
    BrokerClusterSpec,
    BrokerClusterStatus,
    BrokerName,
    BrokerSummary,
    Condition,
    FailoverRecord,
    SwitchoverProgress,
    iso,
    parse_iso,
)
from twinmq.operator.probe import admin, passive_lag, probe, view_of
from twinmq.operator.processes import broker_process, process_gone

log = logging.getLogger(__name__)
NAMES: tuple[BrokerName, ...] = ("primary", "backup")
# Of each 1 s timer tick, how long a reconcile waits for a pod change before probing.
WAKE_WINDOW = 0.7


def now_iso() -> str:
    """Status timestamps."""
    return iso(datetime.now(UTC))


@dataclass
class Memory:
    """What one operator process remembers of a cluster between reconciles."""

    failures: dict[str, int] = field(default_factory=lambda: {n: 0 for n in NAMES})
    last_view: dict[str, BrokerView] = field(default_factory=dict)
    last_probe: float = 0.0
    trouble_since: float | None = None
    last_degraded: str | None = None
    audit_error: str | None = None
    # Per broker: the process (`processes.broker_process`) last seen serving as the active.
    serving: dict[str, str] = field(default_factory=dict)
    wake: asyncio.Event = field(default_factory=asyncio.Event)  # a broker pod changed


MEMORY: dict[str, Memory] = {}
DEGRADED_CLUSTERS: set[str] = set()
PROBES = ThreadPoolExecutor(max_workers=4, thread_name_prefix="twinmq-probe")
KUBE: Kube | None = None


def kube() -> Kube:
    """The process's API client."""
    global KUBE
    if KUBE is None:
        KUBE = Kube()
    return KUBE


# -- reconcile -------------------------------------------------------------------------------


def ensure_children(cluster: ClusterRef, spec: BrokerClusterSpec) -> None:
    """Create what is missing (and recreate what was deleted); never mutate pods."""
    k = kube()
    if spec.auth.secret_name is None:
        k.ensure(builders.build_secret(cluster))
    for obj in builders.build_broker_rbac(cluster):
        k.ensure(obj)
    k.ensure(builders.build_headless_service(cluster))
    k.ensure(builders.build_vip_service(cluster))
    for name in NAMES:
        k.ensure(builders.build_pvc(cluster, spec, name))
        k.ensure(builders.build_pod(cluster, spec, name))


def lease_state(cluster: ClusterRef) -> tuple[BrokerName | None, bool]:
    """(holder broker, expired) of the active role's Lease."""
    lease = kube().get_lease(cluster.namespace, builders.lease_name(cluster))
    if lease is None:
        return None, True
    lspec = lease.get("spec", {})
    holder = lspec.get("holderIdentity")
    renew = lspec.get("renewTime")
    duration = float(lspec.get("leaseDurationSeconds") or 0)
    expired = True
    if renew:
        renewed = parse_iso(renew).timestamp()
        expired = time.time() > renewed + duration
    broker = next((n for n in NAMES if pod_name(cluster, n) == holder), None)
    return broker, expired


def apply(
    decision: Decision,
    cluster: ClusterRef,
    spec: BrokerClusterSpec,
    status: BrokerClusterStatus,
    pods: dict[BrokerName, dict[str, Any] | None],
    token: str,
    body: Any,
    memory: Memory,
    views: dict[BrokerName, BrokerView],
) -> BrokerClusterStatus:
    """Apply the actions in order; return the new status. A role change a broker
    acknowledged is written into `views` too, so the status reports the brokers as they
    are now, consistent with the active broker and epoch it records."""
    k = kube()
    new = status.model_copy(deep=True)

    def ip(name: BrokerName) -> str | None:
        value = (pods.get(name) or {}).get("status", {}).get("podIP")
        return None if value is None else str(value)

    for action in decision.actions:
        if isinstance(action, SetRole):
            target_ip = ip(action.broker)
            peer_ip = ip(action.replicate_from) if action.replicate_from else None
            replicate_from = f"{peer_ip}:{REPLICATION_PORT}" if peer_ip else None
            if target_ip is None:
                break
            try:
                if action.role == ACTIVE:
                    # Whatever process answers now is learned once it is seen serving.
                    memory.serving.pop(action.broker, None)
                admin(target_ip, token).set_role(action.role, action.epoch, replicate_from)
                views[action.broker] = memory.last_view[action.broker] = replace(
                    views[action.broker], role=action.role, epoch=action.epoch,
                    ready=views[action.broker].ready and action.role == PASSIVE,
                )  # fmt: skip
                log.info(
                    "%s/%s: %s is now %s in epoch %d",
                    cluster.namespace,
                    cluster.name,
                    action.broker,
                    action.role,
                    action.epoch,
                )
            except AdminError as exc:
                # The rest depends on this role change (the virtual IP must not move to a
                # broker that did not become active): stop here, decide again next time.
                log.warning(
                    "POST /role to %s failed: %s; the next reconcile decides again",
                    action.broker, exc,
                )  # fmt: skip
                break
        elif isinstance(action, Route):
            for name in NAMES:
                if pods.get(name) is not None:
                    role = ACTIVE if name == action.broker else PASSIVE
                    k.label_pod(
                        cluster.namespace, pod_name(cluster, name), {builders.LABEL_ROLE: role}
                    )
            if action.broker is not None:
                k.put_lease(builders.build_lease(
                    cluster, pod_name(cluster, action.broker),
                    spec.failover.lease_duration_seconds,
                    datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
                ))  # fmt: skip
        elif isinstance(action, Record):
            new.active_broker, new.epoch = action.active, action.epoch
            sw = action.switchover
            new.switchover = None if sw is None else SwitchoverProgress(
                request_id=sw.request_id, kind=sw.kind, target=sw.target, epoch=sw.epoch,
                force=sw.force,
            )  # fmt: skip
            if action.handled_promote is not None:
                new.handled_requests.promote = action.handled_promote
            if action.handled_recover is not None:
                new.handled_requests.recover = action.handled_recover
            if action.handled_fence is not None:
                new.handled_requests.fence = action.handled_fence
            if action.fenced is not None:
                new.fenced_brokers = sorted(action.fenced)
            if action.failover_from is not None and action.active is not None:
                since = memory.trouble_since
                metrics.FAILOVERS.labels(action.reason.split(";")[0][:60]).inc()
                if since is not None:
                    metrics.FAILOVER_SECONDS.observe(time.time() - since)
                new.last_failover = FailoverRecord.model_validate({
                    "time": now_iso(), "from": action.failover_from, "to": action.active,
                    "reason": action.reason, "epoch": action.epoch,
                    "durationSeconds": None if since is None else round(time.time() - since, 3),
                })  # fmt: skip
                memory.trouble_since = None
        elif isinstance(action, Event):
            kopf.event(
                body,
                type="Warning" if action.warning else "Normal",
                reason=action.reason,
                message=action.message,
            )
    return new


def conditions(
    decision: Decision,
    status: BrokerClusterStatus,
    views: dict[BrokerName, BrokerView],
    generation: int,
) -> list[Condition]:
    """Ready / Replicating / FailingOver / Degraded, keeping transition times stable."""
    active = status.active_broker
    serving = active is not None and views[active].reachable and views[active].role == ACTIVE
    passive = views[OTHER[active]] if active else None
    replicating = passive is not None and passive.ready and passive.link_connected
    wanted = [
        ("Ready", serving, "ActiveServing" if serving else "NoActive",
         f"{active} is active in epoch {status.epoch}" if serving else "no broker is serving"),
        ("Replicating", replicating, "PassiveInSync" if replicating else "PassiveNotInSync",
         "the passive holds every confirmed message" if replicating
         else "the passive is not caught up or not connected"),
        ("FailingOver", decision.failing_over, "FailingOver" if decision.failing_over else "Stable",
         "the active role is moving" if decision.failing_over else ""),
        ("Degraded", decision.degraded is not None,
         "Degraded" if decision.degraded else "Protected", decision.degraded or ""),
    ]  # fmt: skip
    previous = {c.type: c for c in status.conditions}
    out = []
    for ctype, value, reason, message in wanted:
        text = "True" if value else "False"
        old = previous.get(ctype)  # type: ignore[call-overload]
        since = old.last_transition_time if old is not None and old.status == text else now_iso()
        out.append(
            Condition(
                type=ctype,
                status=text,
                reason=reason,
                message=message,
                last_transition_time=since,
                observed_generation=generation,
            )
        )
    audit = previous.get("AuditPassed")
    if audit is not None:
        out.append(audit)
    return out


def reconcile(
    body: Any, spec_raw: Any, status_raw: Any, meta: Any, woken: bool = False
) -> dict[str, Any] | None:
    """One reconcile of one cluster; returns the status patch (None: nothing changed).
    `woken`: a pod changed, reconcile now rather than at the next probe interval."""
    if meta.get("deletionTimestamp"):
        return None  # going away: garbage collection removes what it owns
    cluster = ClusterRef(meta["name"], meta["namespace"], meta["uid"])
    spec = BrokerClusterSpec.model_validate(dict(spec_raw or {}))
    status = BrokerClusterStatus.model_validate(
        {k: v for k, v in dict(status_raw or {}).items() if k != "kopf"}
    )
    memory = MEMORY.setdefault(cluster.uid, Memory())
    now = time.monotonic()
    if not woken and now - memory.last_probe < spec.failover.probe_interval_seconds - 0.05:
        return None
    memory.last_probe = now
    if not woken:  # a pod changed: the failover first; children at the next regular tick
        ensure_children(cluster, spec)
    k = kube()
    token = k.get_secret_data(cluster.namespace, builders.secret_name(cluster, spec))["admin-token"]
    pods = {n: k.get_pod(cluster.namespace, pod_name(cluster, n)) for n in NAMES}
    active_ip = (pods.get(status.active_broker) or {}).get("status", {}).get("podIP") if (
        status.active_broker) else None  # fmt: skip
    views: dict[BrokerName, BrokerView] = {}
    reports: dict[BrokerName, BrokerReport | None] = dict(zip(NAMES, PROBES.map(
        lambda n: probe(pods[n], token), NAMES), strict=True))  # fmt: skip
    for name in NAMES:
        report = reports[name]
        view = None if report is None else view_of(report, name, active_ip)
        if view is None and pods[name] is not None:
            metrics.PROBE_FAILURES.labels(name).inc()
        if name != status.active_broker:
            memory.serving.pop(name, None)
        elif view is not None and view.role == ACTIVE and view.epoch >= status.epoch:
            # The pods were read before the probe, and a restarted broker starts passive:
            # the process answering "active" is the one Kubernetes reported.
            process = broker_process(pods[name])
            if process is not None:
                memory.serving[name] = process
        stopped = process_gone(pods[name], memory.serving.get(name))
        if view is not None:
            memory.failures[name] = 0
            memory.last_view[name] = view
        else:
            memory.failures[name] += 1
            last = memory.last_view.get(name)
            still = memory.failures[name] < spec.failover.failure_threshold and not stopped
            view = last if still and last is not None else BrokerView(name, reachable=False)
        views[name] = replace(view, stopped=stopped)
    holder, expired = lease_state(cluster)
    handled = status.handled_requests
    requests = spec.requests
    promote = requests.promote
    sw = status.switchover
    observation = Observation(
        brokers=views,
        active=status.active_broker,
        epoch=status.epoch,
        lease_holder=holder,
        lease_expired=expired,
        allow_data_loss=spec.failover.allow_data_loss,
        switchover=None if sw is None else Switchover(sw.request_id, sw.kind, sw.target,
                                                      sw.epoch, sw.force),
        promote_request=(promote.id, promote.broker, promote.force)
        if promote is not None and promote.id != handled.promote else None,
        routed=next((n for n in NAMES if ((pods[n] or {}).get("metadata", {}).get("labels")
                     or {}).get(builders.LABEL_ROLE) == ACTIVE), None),
        fenced=frozenset(status.fenced_brokers),
        fence_request=(requests.fence.id, requests.fence.broker, requests.fence.fenced)
        if requests.fence is not None and requests.fence.id != handled.fence
        else None,
        recover_request=requests.recover.id
        if requests.recover is not None and requests.recover.id != handled.recover else None,
    )  # fmt: skip
    decision = decide(observation)
    metrics.RECONCILIATIONS.labels("failing-over" if decision.failing_over else "ok").inc()
    if decision.degraded != memory.last_degraded:
        log.info(
            "%s/%s: %s",
            cluster.namespace,
            cluster.name,
            decision.degraded or "protected: the passive is in sync",
        )
        memory.last_degraded = decision.degraded
        DEGRADED_CLUSTERS.discard(cluster.uid)
        if decision.degraded is not None:
            DEGRADED_CLUSTERS.add(cluster.uid)
        metrics.DEGRADED.set(len(DEGRADED_CLUSTERS))
    if any(isinstance(a, SetRole) and a.role == ACTIVE for a in decision.actions):
        log.info("%s/%s: activating on %s", cluster.namespace, cluster.name, observation)
    if not decision.failing_over:
        memory.trouble_since = None
    elif memory.trouble_since is None:
        memory.trouble_since = time.time()
    new = apply(decision, cluster, spec, status, pods, token, body, memory, views)
    lags = {n: passive_lag(n, new.active_broker, reports) for n in NAMES}
    new.brokers = [
        BrokerSummary(
            name=n, pod=pod_name(cluster, n), role=v.role if v.reachable else "unknown",
            reachable=v.reachable, ready=v.ready, epoch=v.epoch,
            link_connected=v.link_connected, fenced=n in new.fenced_brokers,
            lag_messages=lags[n][0], lag_seconds=lags[n][1],
        )
        for n, v in views.items()
    ]  # fmt: skip
    generation = int(meta.get("generation") or 0)
    new.conditions = conditions(decision, new, views, generation)
    new.observed_generation = generation
    created = parse_iso(meta.get("creationTimestamp") or now_iso())
    memory.audit_error = AuditRunner(k, cluster, spec, new, body, generation).reconcile_guarded(
        created, datetime.now(UTC), memory.audit_error
    )
    new.phase = (
        "FailingOver" if decision.failing_over else "Pending" if new.epoch == 0
        else "Degraded" if decision.degraded else "Ready"
    )  # fmt: skip
    patch = new.model_dump(by_alias=True, mode="json", exclude_none=False)
    before = status.model_dump(by_alias=True, mode="json", exclude_none=False)
    return None if patch == before else patch


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    """Events and progress as a production operator wants them."""
    settings.posting.level = logging.INFO
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="twinmq.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="twinmq.io")
    settings.watching.server_timeout = 60


@kopf.timer(GROUP, VERSION, PLURAL, interval=1.0, sharp=True)
async def tick(body: Any, spec: Any, status: Any, meta: Any, patch: Any, **_: Any) -> None:
    """The reconcile loop: waits up to `WAKE_WINDOW` for a pod change (then reconciles at
    once), else reconciles when the probe interval is due. `body` and its views are live."""
    memory = MEMORY.setdefault(meta["uid"], Memory())
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(memory.wake.wait(), WAKE_WINDOW)
    woken = memory.wake.is_set()
    memory.wake.clear()
    new = await asyncio.to_thread(reconcile, body, spec, status, meta, woken)
    if new is not None:
        for key, value in new.items():
            patch.status[key] = value


@kopf.on.event("", "v1", "pods", labels={builders.LABEL_CLUSTER: kopf.PRESENT})
async def pod_changed(body: Any, **_: Any) -> None:
    """A broker pod changed (its container stopped, restarted, the pod went away): wake its
    cluster's reconcile instead of waiting for the Lease or the next probe."""
    for owner in body.get("metadata", {}).get("ownerReferences") or []:
        memory = MEMORY.get(owner.get("uid"))
        if memory is not None:
            memory.wake.set()


def watched_namespaces(argv: list[str] | None = None) -> list[str]:
    """The namespaces to watch: `--namespace NS` (repeatable), else $TWINMQ_OPERATOR_NAMESPACES
    (comma-separated); empty means every namespace."""
    import argparse
    import os

    parser = argparse.ArgumentParser(prog="twinmq-operator", description="The TwinMQ operator.")
    parser.add_argument(
        "-n", "--namespace", action="append", default=[], dest="namespaces",
        help=f"watch only this namespace (repeatable; default: ${OPERATOR_NAMESPACES_ENV}, "
        "else all)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    names = args.namespaces or os.environ.get(OPERATOR_NAMESPACES_ENV, "").split(",")
    return [n.strip() for n in names if n.strip()]


def main(argv: list[str] | None = None) -> None:
    """Run the operator (all namespaces, or only those given; liveness on :8080/healthz).

    Watching given namespaces needs only namespaced RBAC (a Role): kopf then runs with
    resource scanning disabled, so it neither lists namespaces nor watches CRDs.
    """
    namespaces = watched_namespaces(argv)
    port = int(os.environ.get(OPERATOR_METRICS_PORT_ENV, "8081"))
    try:
        start_http_server(port)
    except OSError as exc:  # metrics are not worth refusing to run the operator
        log.warning("cannot serve metrics on :%d: %s", port, exc)
    kopf.configure(verbose=False)
    settings = kopf.OperatorSettings()
    settings.scanning.disabled = bool(namespaces)
    kopf.run(
        clusterwide=not namespaces,
        namespaces=namespaces,
        settings=settings,
        standalone=True,
        liveness_endpoint="http://0.0.0.0:8080/healthz",
    )


if __name__ == "__main__":
    main()
