"""`twinmq-operator`: the kopf handlers. Observe, `decide`, apply; nothing else.

Every second (throttled to the spec's probe interval), and at once when one of
its pods changes (a broker container stopped or restarted), each BrokerCluster is
reconciled: both brokers are probed on their admin API, the Lease is read,
`rollout.plan` picks the next step of a pod template change and `failover.decide`
the role changes, and they are applied in order (role changes over the admin API,
pod labels for the virtual IP, the Lease); only then are its children applied in
their desired state (server-side apply: a deleted or edited child is restored),
then a rollout's pod deletions, the status and Events. The state that matters lives in the
status and the Lease; what is kept in kopf's per-resource memo (consecutive probe
failures, the generated credentials, the Lease as last seen) only delays a failover after
an operator restart, it never causes one.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

import kopf
from kubernetes.dynamic.exceptions import ForbiddenError, ResourceNotFoundError
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
from twinmq.operator import (
    builders,
    carotation,
    certs,
    drift,
    federation,
    federationtls,
    leader,
    metrics,
    mirroring,
    netpolicy,
    peerca,
    peertls,
    rollout,
)
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
from twinmq.operator.kube import FIELD_MANAGER, Foreign, Kube, Refused, owned
from twinmq.operator.leasewatch import LeaseWatch
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
    PeerTlsPhase,
    RolloutProgress,
    SwitchoverProgress,
    iso,
    parse_iso,
)
from twinmq.operator.ownership import Owner, owns
from twinmq.operator.probe import admin_of, damage_text, passive_lag, probe, view_of
from twinmq.operator.processes import broker_process, process_gone

log = logging.getLogger(__name__)
NAMES: tuple[BrokerName, ...] = ("primary", "backup")
# Seconds between two passes of a cluster's loop (kopf's timer). Each pass waits for a pod
# change until its probe is due, so a change is seen at once, not at the next tick: a
# `sharp` 1 s timer slept to its grid after a pass and let a crash wait up to ~1 s.
TICK = 0.05
# The longest a pass waits for the watch to bring back the status the previous pass wrote.
SETTLE_TIMEOUT = 2.0
# Passes in a row that may leave the children to the next pass (a pod changed meanwhile).
MAX_DEFERRED = 3
ROLLOUT_REQUEST = "rollout-"
"""Prefix of the promote request a rollout's switchover runs as (never recorded as handled:
`status.handledRequests.promote` keeps the user's own request id)."""


def now_iso() -> str:
    """Status timestamps."""
    return iso(datetime.now(UTC))


@dataclass
class Memory:
    """What one operator process remembers of a cluster between reconciles (kept in the
    cluster's kopf memo, so it goes when the cluster goes)."""

    failures: dict[str, int] = field(default_factory=lambda: {n: 0 for n in NAMES})
    last_view: dict[str, BrokerView] = field(default_factory=dict)
    last_probe: float = 0.0
    trouble_since: float | None = None
    last_degraded: str | None = None
    audit_error: str | None = None
    # Per broker: the process (`processes.broker_process`) last seen serving as the active.
    serving: dict[str, str] = field(default_factory=dict)
    wake: asyncio.Event = field(default_factory=asyncio.Event)  # a broker pod changed
    probe_interval: float = 1.0  # the spec's, as of the last pass
    # The resourceVersion a status patch was decided on: the next pass waits until the
    # watch has brought a newer body (kopf does not update it from the patch's answer).
    patched_from: str | None = None
    deferred: int = 0  # passes in a row that left the children to the next (woken) pass
    # The generated Secret's data: a deleted Secret is restored with the credentials the
    # running brokers were started with (new ones would lock the operator out of them).
    credentials: dict[str, str] | None = None
    storage_refusal: str | None = None
    # Someone else's object under a name the operator generates, as last met (the children
    # wait for it to go: `Stalled`, reason ForeignObject; an Event once per message).
    foreign: str | None = None
    applied: dict[str, drift.Applied] = field(default_factory=dict)  # by `drift.key`
    # The NetworkPolicy's state as last reconciled: applied, absent (deleted or never
    # made), or refused (RBAC of an older chart); changes are logged once.
    network_policy: str | None = None
    # The federation file's ConfigMap is gone (deleted, or found gone, by this process)
    # since `spec.federation` went.
    federation_config_gone: bool = False
    tls: certs.TlsMemory = field(default_factory=certs.TlsMemory)
    peer_ca: peerca.PeerCaMemory = field(default_factory=peerca.PeerCaMemory)
    federation_tls: federationtls.FederationTlsMemory = field(
        default_factory=federationtls.FederationTlsMemory
    )
    # The active role's Lease as last read, and since when (monotonic): its expiry and
    # its replication guard are judged by how long this process has seen it unchanged.
    lease: LeaseWatch = field(default_factory=LeaseWatch)


@dataclass
class OperatorState:
    """What the operator shares between clusters (kopf's global memo; each cluster's memo is
    a shallow copy of it, so they all see this one object)."""

    degraded: set[str] = field(default_factory=set)  # uids of the degraded clusters
    # Each cluster's memory by uid, for the pod watch to wake its cluster's reconcile.
    clusters: dict[str, Memory] = field(default_factory=dict)
    # The federated clusters' server ids, to warn of a duplicate before the handshake does.
    server_ids: federation.ServerIds = field(default_factory=federation.ServerIds)


def memory_of(memo: Any) -> tuple[Memory, OperatorState]:
    """The cluster's own memory and the shared state, from its kopf memo."""
    if memo.get("cluster") is None:
        memo["cluster"] = Memory()
    if memo.get("operator") is None:  # run without `main()` (kopf run): one per cluster
        memo["operator"] = OperatorState()
    return memo["cluster"], memo["operator"]


PROBES = ThreadPoolExecutor(max_workers=4, thread_name_prefix="twinmq-probe")
KUBE: Kube | None = None


def kube() -> Kube:
    """The process's API client."""
    global KUBE
    if KUBE is None:
        KUBE = Kube()
    return KUBE


# -- reconcile -------------------------------------------------------------------------------


ADOPTED_UNOWNED = frozenset({"PersistentVolumeClaim"})
"""The one kind of child the operator applies over an object under its name that this
BrokerCluster does not own: a PVC of a BrokerCluster deleted with `--cascade=orphan` and
created again holds its data. Every other kind (Secrets, ConfigMaps, Certificates, the
Services, the PodDisruptionBudget, the brokers' ServiceAccount, Role and RoleBinding, the
NetworkPolicy) is applied only over an object this BrokerCluster owns (the first apply of
a process reads it: `kube.owned`): a Service someone else made could route the virtual
IP to their pod (an EndpointSlice of their own survives the operator's selector), a
RoleBinding or ServiceAccount of theirs keep what they granted or hold."""


def reconcile_children(
    cluster: ClusterRef,
    spec: BrokerClusterSpec,
    memory: Memory,
    pods: dict[BrokerName, Any],
    peer_tls: PeerTlsPhase = "Plaintext",
    peer_ca: dict[str, Any] | None = None,
    federation_cas: list[dict[str, Any]] | None = None,
    loaded: carotation.Loaded | None = None,
) -> list[drift.Repaired]:
    """Apply every owned object in its desired state (a deleted one is recreated, an edited
    one set back); create the pods that are missing and set their labels back. Pods are
    never changed in place: a rollout replaces them (`rollout.plan`). A volume resize the
    API server refuses is kept in `memory.storage_refusal`. `loaded`: what each broker
    reports it loaded of its TLS files (a CA rotation's phase waits for it). Returns the
    drift repaired (`drift.repair`)."""
    k = kube()
    repaired: list[drift.Repaired] = []

    def apply(obj: dict[str, Any]) -> None:
        obj, name = drift.stamped(obj), drift.key(obj)
        before = memory.applied.get(name)
        if before is None:  # this process's first pass: what the previous one left
            try:
                live = k.get(
                    obj["apiVersion"], obj["kind"], cluster.namespace, obj["metadata"]["name"]
                )
            except ForbiddenError:  # RBAC of an older chart: no `get`; report no drift
                log.warning("%s/%s: cannot read %s (no get permission): drift made while no "
                            "operator ran goes unreported", cluster.namespace, cluster.name,
                            name)  # fmt: skip
                live = None
            if obj["kind"] not in ADOPTED_UNOWNED:  # never rewrite (and own) someone else's
                owned(live, Owner(cluster.uid))
            before = drift.remembered(live, FIELD_MANAGER)
        now = drift.applied(obj, k.apply(obj), FIELD_MANAGER)
        found = drift.repair(before, now)
        memory.applied[name] = now
        if found is not None:
            deleted_or_edited = "deleted" if found == "recreated" else "edited"
            repaired.append(
                drift.Repaired(obj["kind"], f"{drift.key(obj)} was {deleted_or_edited}: {found}")
            )

    if spec.auth.secret_name is None:
        found = generated_secret(k, cluster, spec)
        if found is None and memory.credentials is None:
            memory.credentials = builders.generate_credentials()
        elif found is not None:
            memory.credentials = builders.upgrade_credentials(found)
        assert memory.credentials is not None
        apply(builders.build_secret(cluster, memory.credentials))
    for obj in builders.build_broker_rbac(cluster):
        apply(obj)
    # Before the pods: a new pod mounts the server certificate's Secret.
    try:
        certs.reconcile_tls(cluster, spec, memory.tls, k, apply, clock=time.monotonic(),
                            loaded=loaded)  # fmt: skip
    except ResourceNotFoundError:  # spec.tls.issuerRef without cert-manager installed
        if not memory.tls.no_cert_manager:
            log.warning("%s/%s: spec.tls.issuerRef names cert-manager, whose Certificate "
                        "kind this API server does not serve: install cert-manager",
                        cluster.namespace, cluster.name)  # fmt: skip
        memory.tls.no_cert_manager = True
    if peer_ca is not None:  # before the pods too: they mount it (operator/peerca.py)
        apply(peer_ca)
    for copy in federation_cas or []:  # likewise (operator/federationtls.py)
        apply(copy)
    apply(builders.build_headless_service(cluster, amqps=spec.tls.enabled))
    apply(builders.build_vip_service(cluster, spec.mirror, amqps=spec.tls.enabled))
    apply(builders.build_disruption_budget(cluster))
    reconcile_network_policy(cluster, spec, memory, apply)
    # Before the pods: a pod created now reads the federation file its template hashes.
    if (fed_config := builders.build_federation_config_map(cluster, spec)) is not None:
        apply(fed_config)
        memory.federation_config_gone = False
    else:
        remove_federation_config(cluster, memory, pods)
    memory.storage_refusal = None
    for name in NAMES:
        try:
            apply(builders.build_pvc(cluster, spec, name))
        except Refused as exc:
            # Shrinking, or a StorageClass that cannot expand: nothing the operator can do.
            memory.storage_refusal = f"{pod_name(cluster, name)}: {exc}"
        pod = pods.get(name)
        if pod is None:
            k.ensure(builders.build_pod(
                cluster, spec, name, builders.broker_token_seconds(), peer_tls
            ))  # fmt: skip
            continue
        have = pod.get("metadata", {}).get("labels") or {}
        want = builders.labels(cluster, name)
        if any(have.get(key) != value for key, value in want.items()):
            k.label_pod(cluster.namespace, pod_name(cluster, name), want)
            repaired.append(drift.Repaired(
                "Pod", f"Pod/{pod_name(cluster, name)}'s labels were edited: set back"
            ))  # fmt: skip
    return repaired


def reconcile_network_policy(
    cluster: ClusterRef,
    spec: BrokerClusterSpec,
    memory: Memory,
    apply: Callable[[dict[str, Any]], None],
) -> None:
    """Keep the brokers' NetworkPolicy (`operator/netpolicy.py`), or remove it when the spec
    opts out or the operator does not know its own pods (it would shut itself out)."""
    operator_pods = netpolicy.OperatorPods.from_env()
    if spec.network_policy.enabled and operator_pods is not None:
        try:
            apply(netpolicy.build_network_policy(cluster, spec, operator_pods))
        except Refused as exc:
            if memory.network_policy != "refused":
                log.warning("%s/%s: NetworkPolicy not applied: %s (the chart's RBAC grants "
                            "networkpolicies)", cluster.namespace, cluster.name, exc)  # fmt: skip
            memory.network_policy = "refused"
            return
        memory.network_policy = "applied"
        return
    if memory.network_policy != "absent":
        if spec.network_policy.enabled:
            log.info("%s/%s: no NetworkPolicy: the operator does not know its own pods (%s and "
                     "%s, set by the chart)", cluster.namespace, cluster.name,
                     netpolicy.OPERATOR_NAMESPACE_ENV, netpolicy.OPERATOR_SELECTOR_ENV)  # fmt: skip
        name, k = netpolicy.policy_name(cluster), kube()
        try:
            found = k.get("networking.k8s.io/v1", "NetworkPolicy", cluster.namespace, name)
            if found is not None and owns(found, cluster.uid):  # never someone else's
                k.delete("networking.k8s.io/v1", "NetworkPolicy", cluster.namespace, name)
        except ForbiddenError:  # RBAC of an older chart: it never made one either
            log.info("%s/%s: cannot check for a NetworkPolicy to remove (no permission)",
                     cluster.namespace, cluster.name)  # fmt: skip
        memory.network_policy = "absent"


def remove_federation_config(
    cluster: ClusterRef, memory: Memory, pods: dict[BrokerName, Any]
) -> None:
    """Delete the federation file's ConfigMap once `spec.federation` is gone and no pod
    mounts it any more (the rollout replaces them first: a pod of the old template
    restarted in place still needs it)."""
    if memory.federation_config_gone:
        return
    name = federation.config_map_name(cluster.name)
    for pod in pods.values():
        volumes = ((pod or {}).get("spec") or {}).get("volumes") or []
        if any((v.get("configMap") or {}).get("name") == name for v in volumes):
            return
    k = kube()
    try:
        found = k.get("v1", "ConfigMap", cluster.namespace, name)
        if found is not None and owns(found, cluster.uid):  # never someone else's
            k.delete("v1", "ConfigMap", cluster.namespace, name)
    except ForbiddenError:  # RBAC of an older chart: no delete; the cluster's deletion does it
        log.info("%s/%s: cannot delete ConfigMap %s (no permission)", cluster.namespace,
                 cluster.name, name)  # fmt: skip
    memory.federation_config_gone = True


def credentials_of(
    cluster: ClusterRef, spec: BrokerClusterSpec, memory: Memory
) -> dict[str, str] | None:
    """The brokers' credentials (None: the given Secret does not exist). Generated ones are
    read from their Secret once per operator process, or generated when it does not exist
    yet; `reconcile_children` keeps that Secret in place."""
    k = kube()
    name = builders.secret_name(cluster, spec)
    if spec.auth.secret_name is not None:
        return k.get_secret_data(cluster.namespace, name)
    if memory.credentials is None:
        found = generated_secret(k, cluster, spec)
        memory.credentials = found if found is not None else builders.generate_credentials()
    return memory.credentials


def generated_secret(
    k: Kube, cluster: ClusterRef, spec: BrokerClusterSpec
) -> dict[str, str] | None:
    """The generated credentials Secret's data (None: not made yet). A Secret of that name
    this cluster does not own is someone else's: never read, rewritten nor owned (its
    garbage collector would delete it with the cluster): the reconcile waits, saying so."""
    name = builders.secret_name(cluster, spec)
    try:  # read once: its owner and its data
        return k.get_secret_data(cluster.namespace, name, Owner(cluster.uid))
    except Foreign as exc:
        hint = ", or name your own credentials in spec.auth.secretName"
        raise Foreign(exc.kind, exc.name, exc.why, hint) from None


def repair_routing(
    cluster: ClusterRef,
    spec: BrokerClusterSpec,
    active: BrokerName,
    pods: dict[BrokerName, Any],
    holder: BrokerName | None,
) -> list[drift.Repaired]:
    """In the steady state (the recorded active serving, no role moving): the virtual IP
    selects the active and only it, and the active holds the Lease. Sets back an edited
    role label, takes the virtual IP's labels off a pod that is not this cluster's (one
    that copied them would receive clients' connections) and restores a deleted or
    edited Lease; returns what it repaired."""
    k = kube()
    repaired = strip_foreign_endpoints(cluster)
    for name in NAMES:
        labels = ((pods.get(name) or {}).get("metadata") or {}).get("labels") or {}
        want = "active" if name == active else "passive"
        if pods.get(name) is not None and labels.get(builders.LABEL_ROLE) != want:
            log.warning("%s/%s: %s's role label was %r: set back to %s", cluster.namespace,
                        cluster.name, name, labels.get(builders.LABEL_ROLE), want)  # fmt: skip
            k.label_pod(cluster.namespace, pod_name(cluster, name), {builders.LABEL_ROLE: want})
            repaired.append(drift.Repaired(
                "Pod", f"Pod/{pod_name(cluster, name)}'s role label was edited: set back"
            ))  # fmt: skip
    if holder != active:
        log.warning("%s/%s: the Lease is not held by the active %s: restored",
                    cluster.namespace, cluster.name, active)  # fmt: skip
        k.put_lease(builders.build_lease(
            cluster, pod_name(cluster, active), spec.failover.lease_duration_seconds,
            datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
        ))  # fmt: skip
        repaired.append(drift.Repaired("Lease", f"Lease/{builders.lease_name(cluster)} was "
                                       f"not held by the active {active}: restored"))  # fmt: skip
    return repaired


def strip_foreign_endpoints(cluster: ClusterRef) -> list[drift.Repaired]:
    """Remove the role label from every pod that carries the virtual IP's selector but is
    not one of this cluster's brokers, so the Service stops routing clients to it; each
    one is reported (a DriftRepaired Event names the pod).

    A broker is told by its name alone, as the reconcile reads its pods: a broker pod
    without this cluster's owner reference (its BrokerCluster deleted with
    `--cascade=orphan` and created again, a new uid) is still the one probed, rolled and
    labelled active, and stripping it here would take the active off the virtual IP
    every other pass (the role repair puts the label back the next)."""
    k = kube()
    selector = f"{builders.LABEL_CLUSTER}={cluster.name},{builders.LABEL_ROLE}={ACTIVE}"
    ours = {pod_name(cluster, n) for n in NAMES}
    repaired: list[drift.Repaired] = []
    for pod in k.list("v1", "Pod", cluster.namespace, selector):
        meta = pod.get("metadata") or {}
        if meta.get("name") in ours:
            continue
        name = str(meta.get("name"))
        log.warning("%s/%s: pod %s is not a broker of this cluster but carried the virtual "
                    "IP's labels: role label removed", cluster.namespace, cluster.name,
                    name)  # fmt: skip
        k.label_pod(cluster.namespace, name, {builders.LABEL_ROLE: None})
        repaired.append(drift.Repaired("ForeignPod", (
            f"Pod/{name} is not a broker of this cluster but carried the virtual IP's labels "
            f"({selector}): its role label was removed so clients are not routed to it; "
            "find out who created it"
        )))  # fmt: skip
    return repaired


def report_drift(body: Any, repaired: list[drift.Repaired]) -> None:
    """An Event (DriftRepaired) and the metric for each repair."""
    for repair in repaired:
        metrics.DRIFT_REPAIRS.labels(repair.kind).inc()
        kopf.event(body, type="Warning", reason="DriftRepaired", message=repair.message)


def lease_state(
    cluster: ClusterRef, watch: LeaseWatch, clock: Callable[[], float] = time.monotonic
) -> tuple[BrokerName | None, bool, tuple[int, bool] | None]:
    """(holder broker, expired, replication guard) of the active role's Lease, judged by
    how long `watch` has seen its record unchanged on this process's monotonic `clock`,
    never by its `renewTime` (`operator/leasewatch.py`)."""
    lease = kube().get_lease(cluster.namespace, builders.lease_name(cluster))
    # Read after the answer: the record was written before it, so a duration counted
    # from here never starts before the broker's own deadline does.
    seen = watch.judge(lease, clock())
    broker = next((n for n in NAMES if pod_name(cluster, n) == seen.holder), None)
    return broker, seen.expired, seen.guard


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
    ca_pem: str | None = None,
) -> BrokerClusterStatus:
    """Apply the actions in order; return the new status. A role change a broker
    acknowledged is written into `views` too, so the status reports the brokers as they
    are now, consistent with the active broker and epoch it records."""
    k = kube()
    new = status.model_copy(deep=True)
    routed = {
        n: ((pods.get(n) or {}).get("metadata", {}).get("labels") or {}).get(builders.LABEL_ROLE)
        for n in NAMES
    }  # each pod's role label, as this pass leaves it
    activated: dict[BrokerName, int] = {}  # the epoch each broker was made active in here

    def ip(name: BrokerName) -> str | None:
        value = (pods.get(name) or {}).get("status", {}).get("podIP")
        return None if value is None else str(value)

    for action in decision.actions:
        if isinstance(action, SetRole):
            target = admin_of(pods.get(action.broker), token, ca_pem)
            peer_ip = ip(action.replicate_from) if action.replicate_from else None
            replicate_from = f"{peer_ip}:{REPLICATION_PORT}" if peer_ip else None
            if target is None:
                break
            try:
                if action.role == ACTIVE:
                    # Whatever process answers now is learned once it is seen serving.
                    memory.serving.pop(action.broker, None)
                target.set_role(action.role, action.epoch, replicate_from, force=action.force)
                if action.role == ACTIVE:
                    activated[action.broker] = action.epoch
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
                role = ACTIVE if name == action.broker else PASSIVE
                # Only the labels that change: each request delays the new active's turn.
                if pods.get(name) is not None and routed.get(name) != role:
                    k.label_pod(
                        cluster.namespace, pod_name(cluster, name), {builders.LABEL_ROLE: role}
                    )
                    routed[name] = role
            if action.broker is not None:
                # Every Route to a broker follows its SetRole to active in the same decision.
                k.put_lease(builders.build_lease(
                    cluster, pod_name(cluster, action.broker),
                    spec.failover.lease_duration_seconds,
                    datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
                ), handover_epoch=activated.get(action.broker))  # fmt: skip
        elif isinstance(action, Record):
            new.active_broker, new.epoch = action.active, action.epoch
            sw = action.switchover
            new.switchover = None if sw is None else SwitchoverProgress(
                request_id=sw.request_id, kind=sw.kind, target=sw.target, epoch=sw.epoch,
                force=sw.force,
            )  # fmt: skip
            if action.handled_promote is not None and not action.handled_promote.startswith(
                ROLLOUT_REQUEST
            ):
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


def damage_of(
    status: BrokerClusterStatus,
    views: dict[BrokerName, BrokerView],
    reports: dict[BrokerName, BrokerReport | None],
) -> dict[BrokerName, str]:
    """The damaged brokers and their `damage` text: as this probe's report says, else (no
    answer) as the last view or, for an unreachable broker, the status said."""
    before = {b.name: b for b in status.brokers}
    out: dict[BrokerName, str] = {}
    for name, view in views.items():
        report, old = reports.get(name), before.get(name)
        if report is not None:
            if report.journal.damaged:
                out[name] = damage_text(report)
        elif (view.reachable and view.damaged) or (not view.reachable and old and old.damaged):
            out[name] = (old.damage if old else "") or "journal damaged"
    return out


def damage_events(body: Any, old: BrokerClusterStatus, new: BrokerClusterStatus) -> None:
    """A Warning Event when a broker is found damaged, a Normal one when it is healed (once
    each: the status remembers what was reported)."""
    was = {b.name: b.damaged for b in old.brokers}
    for broker in new.brokers:
        if broker.damaged and not was.get(broker.name, False):
            kopf.event(body, type="Warning", reason="BrokerDamaged",
                       message=f"{broker.name}: {broker.damage}")  # fmt: skip
        elif not broker.damaged and was.get(broker.name, False):
            kopf.event(body, type="Normal", reason="BrokerHealed",
                       message=f"{broker.name}: its journal is whole again (a complete "
                       "catch-up from the active, or a repair)")  # fmt: skip


def damaged_condition(status: BrokerClusterStatus) -> tuple[str, bool, str, str]:
    """BrokerDamaged (abnormal-true): a broker's journal is damaged; which, since when, where
    its damaged files were moved."""
    damaged = [b for b in status.brokers if b.damaged]
    if not damaged:
        return ("BrokerDamaged", False, "JournalsWhole", "")
    return ("BrokerDamaged", True, "JournalDamaged",
            "; ".join(f"{b.name}: {b.damage}" for b in damaged))  # fmt: skip


def rollout_conditions(
    progress: RolloutProgress | None, storage_refusal: str | None, foreign: str | None = None
) -> list[tuple[str, bool, str, str]]:
    """Reconciling (a rollout under way) and Stalled (it cannot go on: someone else's
    object under a generated name, an updated broker failing, a fenced broker, a volume
    resize refused), as kstatus reads them."""
    step = progress.step if progress is not None else "Complete"
    moving = step not in ("Complete", "Stalled")
    stalled = step == "Stalled" or storage_refusal is not None or foreign is not None
    why = (
        foreign if foreign is not None
        else progress.message if progress is not None and step == "Stalled"
        else f"volume resize refused: {storage_refusal}" if storage_refusal else ""
    )  # fmt: skip
    reason = (
        "ForeignObject" if foreign is not None
        else "RolloutStalled" if step == "Stalled"
        else "StorageResizeRefused" if stalled else "NotStalled"
    )  # fmt: skip
    return [
        ("Reconciling", moving, step if moving else "Converged",
         f"{progress.message}" if moving and progress is not None else ""),
        ("Stalled", stalled, reason, why),
    ]  # fmt: skip


def report_foreign(body: Any, cluster: ClusterRef, memory: Memory, exc: Foreign) -> None:
    """Someone else's object under a name the operator generates: logged, a Warning Event
    `ForeignObject` once per message, kept for the `Stalled` condition."""
    message = str(exc)
    if memory.foreign != message:
        log.warning("%s/%s: %s", cluster.namespace, cluster.name, message)
        kopf.event(body, type="Warning", reason="ForeignObject", message=message)
    memory.foreign = message


def conditions(
    decision: Decision,
    status: BrokerClusterStatus,
    views: dict[BrokerName, BrokerView],
    generation: int,
    extra: list[tuple[str, bool, str, str]],
) -> list[Condition]:
    """Ready / Replicating / FailingOver / Degraded and `extra`, keeping transition times
    stable. Ready, Replicating, AuditPassed and Mirroring are True when all is well; the others
    (kstatus's abnormal-true polarity) are True when something is wrong or moving."""
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
        *extra,
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


def observe_rollout(
    cluster: ClusterRef,
    spec: BrokerClusterSpec,
    status: BrokerClusterStatus,
    pods: dict[BrokerName, dict[str, Any] | None],
    views: dict[BrokerName, BrokerView],
    peer_tls: PeerTlsPhase = "Plaintext",
) -> rollout.RolloutObservation:
    """What `rollout.plan` looks at: which pod runs the desired template, who serves."""
    desired: dict[str, Any] = {
        n: builders.pod_revision(
            builders.build_pod(cluster, spec, n, builders.broker_token_seconds(), peer_tls)
        )
        for n in NAMES
    }
    revision = builders.template_hash(desired)
    pod_views = {
        n: rollout.PodView(
            present=pods[n] is not None,
            current=builders.pod_revision(pods[n]) == desired[n],
            terminating=bool((pods[n] or {}).get("metadata", {}).get("deletionTimestamp")),
            failing=rollout.pod_failure(pods[n]),
        )
        for n in NAMES
    }
    requests, handled, sw = spec.requests, status.handled_requests, status.switchover
    pending = [
        kind for kind, request, done in (
            ("promote", requests.promote, handled.promote),
            ("recover", requests.recover, handled.recover),
            ("fence", requests.fence, handled.fence),
        ) if request is not None and request.id != done
    ]  # fmt: skip
    busy = (
        f"waiting for the {sw.kind} to {sw.target} to finish" if sw is not None
        else f"waiting for the {pending[0]} request to be handled" if pending else None
    )  # fmt: skip
    progress = status.rollout
    update = spec.update_strategy
    return rollout.RolloutObservation(
        revision=revision,
        pods=pod_views,
        brokers=views,
        active=status.active_broker,
        epoch=status.epoch,
        busy=busy,
        fenced=frozenset(status.fenced_brokers),
        method=update.method,
        supervised=update.active_update == "Supervised",
        ready_timeout=update.ready_timeout_seconds,
        progress=None if progress is None else rollout.Progress(
            progress.revision, progress.step, progress.broker,
            parse_iso(progress.since).timestamp(), progress.message,
        ),
        now=time.time(),
    )  # fmt: skip


def reconcile(
    body: Any, spec_raw: Any, status_raw: Any, meta: Any, memo: Any, woken: bool = False
) -> dict[str, Any] | None:
    """One reconcile of one cluster; returns the status patch (None: nothing changed).
    `woken`: a pod changed, reconcile now rather than at the next probe interval."""
    if meta.get("deletionTimestamp"):
        return None  # going away: garbage collection removes what it owns
    cluster = ClusterRef(meta["name"], meta["namespace"], meta["uid"])
    # Read together, now: kopf updates the body under a running (threaded) handler, and a
    # generation read later could claim a spec this reconcile never saw as observed.
    generation = int(meta.get("generation") or 0)
    spec = BrokerClusterSpec.model_validate(dict(spec_raw or {}))
    status = BrokerClusterStatus.model_validate(
        {k: v for k, v in dict(status_raw or {}).items() if k != "kopf"}
    )
    memory, shared = memory_of(memo)
    memory.probe_interval = spec.failover.probe_interval_seconds
    now = time.monotonic()
    if not woken and now - memory.last_probe < memory.probe_interval - 0.05:
        return None
    memory.last_probe = now
    if woken:
        # A step of a crash failover's timeline (bench/failover_time.py reads it).
        log.info("%s/%s: woken by a pod change", cluster.namespace, cluster.name)
    k = kube()
    # The other DR site's CA, copied when the operator can read it: from here on the spec
    # is the one the pods are built from (`caConfigMap` naming the copy).
    trust = peerca.reconcile(
        cluster, spec, memory.peer_ca, k, now,
        lambda kind, reason, message: kopf.event(body, type=kind, reason=reason,
                                                 message=message),
    )  # fmt: skip
    spec = peerca.effective(spec, trust)
    # Likewise the CAs of federation upstreams and downstreams (amqps between clusters).
    fed_trust = federationtls.reconcile(
        cluster, spec, memory.federation_tls, k, now,
        lambda kind, reason, message: kopf.event(body, type=kind, reason=reason,
                                                 message=message),
    )  # fmt: skip
    spec = federationtls.effective(cluster, spec, fed_trust)
    pods = {n: k.get_pod(cluster.namespace, pod_name(cluster, n)) for n in NAMES}
    credentials = credentials_of(cluster, spec, memory)
    if credentials is None:
        raise kopf.TemporaryError(f"secret {spec.auth.secret_name} not found", delay=5)
    token = credentials["admin-token"]
    # The step towards mutual TLS the pods are built for (operator/peertls.py).
    peer_tls = peertls.current(status.peer_tls, spec, pods.values(), status.epoch > 0)
    # The CA the brokers' admin HTTPS is verified against, wherever a pod serves it (on the
    # way back to Plaintext, the pod not yet rolled still does).
    https = peer_tls != "Plaintext" or any(
        ((p or {}).get("metadata", {}).get("annotations") or {}).get(builders.ADMIN_SCHEME)
        == "https" for p in pods.values()
    )  # fmt: skip
    ca_pem = certs.brokers_ca(cluster, spec.tls, memory.tls, k) if https else None
    active_ip = (pods.get(status.active_broker) or {}).get("status", {}).get("podIP") if (
        status.active_broker) else None  # fmt: skip
    views: dict[BrokerName, BrokerView] = {}
    reports: dict[BrokerName, BrokerReport | None] = dict(zip(NAMES, PROBES.map(
        lambda n: probe(pods[n], token, ca_pem), NAMES), strict=True))  # fmt: skip
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
            # A remembered view is not news of a catch-up: it may have been overtaken (the
            # active went on alone since, and a new catch-up is not over). The Lease's guard
            # is trusted only with what the passive says now.
            view = replace(view, caught_up_epoch=None)
        views[name] = replace(view, stopped=stopped)
    holder, expired, guard = lease_state(cluster, memory.lease)
    handled = status.handled_requests
    requests = spec.requests
    promote = requests.promote
    sw = status.switchover
    # The rollout reads this probe's answers only: `views` keeps a broker's last view for
    # up to failureThreshold probes, and a recreated pod's broker must not look ready on
    # the strength of its predecessor's last answer (the e2e caught a switchover to a
    # broker whose new image could not even be pulled).
    fresh = {
        n: BrokerView(n, reachable=False) if report is None else view_of(report, n, active_ip)
        for n, report in reports.items()
    }
    plan = rollout.plan(observe_rollout(cluster, spec, status, pods, fresh, peer_tls))
    promote_request = (promote.id, promote.broker, promote.force) if (
        promote is not None and promote.id != handled.promote) else None  # fmt: skip
    for step in plan.actions:
        if isinstance(step, rollout.RequestSwitchover) and promote_request is None:
            assert plan.progress is not None
            promote_request = (ROLLOUT_REQUEST + plan.progress.revision, step.target, False)
    observation = Observation(
        brokers=views,
        active=status.active_broker,
        epoch=status.epoch,
        lease_holder=holder,
        lease_expired=expired,
        lease_guard=guard,
        allow_data_loss=spec.failover.allow_data_loss,
        switchover=None if sw is None else Switchover(sw.request_id, sw.kind, sw.target,
                                                      sw.epoch, sw.force),
        promote_request=promote_request,
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
        shared.degraded.discard(cluster.uid)
        if decision.degraded is not None:
            shared.degraded.add(cluster.uid)
        metrics.DEGRADED.set(len(shared.degraded))
    if any(isinstance(a, SetRole) and a.role == ACTIVE for a in decision.actions):
        log.info("%s/%s: activating on %s", cluster.namespace, cluster.name, observation)
    if not decision.failing_over:
        memory.trouble_since = None
    elif memory.trouble_since is None:
        memory.trouble_since = time.time()
    new = apply(decision, cluster, spec, status, pods, token, body, memory, views, ca_pem)
    active = new.active_broker
    if (
        active is not None
        and not decision.failing_over
        and new.switchover is None
        and not any(isinstance(a, Route) for a in decision.actions)
        and views[active].reachable
        and views[active].role == ACTIVE
    ):
        report_drift(body, repair_routing(cluster, spec, active, pods, holder))
    # The children after the decision: a failover waits for no server-side apply (under
    # load, the ten or so requests took seconds; bench/failover_time.py). On every pass,
    # woken or not: observedGeneration and the storage refusal are judged from what this
    # pass applied (a woken pass that skipped them marked a refused resize as observed).
    # A missing pod is created here and seen by the next pass. When a pod changed during
    # this pass, the next pass runs at once and applies them: it need not wait for this
    # pass's ten or so requests (a crash reported meanwhile waited ~1 s for them under
    # load), and this pass then claims no generation as observed. Never more than a few
    # passes in a row: pods that keep changing must not starve the children.
    deferred = memory.wake.is_set() and memory.deferred < MAX_DEFERRED
    memory.deferred = memory.deferred + 1 if deferred else 0
    if not deferred:
        peer_ca = None if trust is None else peerca.build_config_map(cluster, trust)
        loaded: carotation.Loaded = {n: None if r is None else r.tls for n, r in reports.items()}
        try:
            report_drift(body, reconcile_children(
                cluster, spec, memory, pods, peer_tls, peer_ca,
                federationtls.build_config_maps(cluster, fed_trust), loaded,
            ))  # fmt: skip
            memory.foreign = None
        except Foreign as exc:
            # The pass goes on (failover, status) without the children after it: no pod is
            # made to mount what someone else wrote.
            report_foreign(body, cluster, memory, exc)
        for rotated in memory.tls.events:
            kopf.event(body, type="Normal", reason="CaRotation", message=rotated)
        memory.tls.events.clear()
        for broker, files in carotation.load_errors(loaded):
            key = f"{broker}/{files.listener}"
            if memory.tls.load_errors.get(key) != files.load_error_at:  # once per failure
                memory.tls.load_errors[key] = files.load_error_at
                kopf.event(body, type="Warning", reason="TlsLoadFailed", message=(
                    f"{broker}'s {files.listener} TLS files do not load ({files.load_error}): it "
                    "keeps the ones it loaded before"))  # fmt: skip
    if memory.tls.rotation is not None:
        waiting = memory.tls.rotation.waiting
        if waiting is not None and waiting != (status.ca_rotation and status.ca_rotation.waiting):
            log.info("%s/%s: CA rotation waits: %s", cluster.namespace, cluster.name, waiting)
            kopf.event(body, type="Normal", reason="CaRotationWaiting", message=waiting)
        new.ca_rotation = memory.tls.rotation
        new.handled_requests.rotate_ca = memory.tls.rotation.request
    for step in plan.actions:
        if isinstance(step, rollout.DeletePod):
            pod = pods[step.broker] or {}
            log.info("%s/%s: rollout: deleting %s's pod", cluster.namespace, cluster.name,
                     step.broker)  # fmt: skip
            k.delete_pod(cluster.namespace, pod_name(cluster, step.broker),
                         pod.get("metadata", {}).get("uid", ""))  # fmt: skip
    for event in plan.events:
        kopf.event(body, type="Warning" if event.warning else "Normal", reason=event.reason,
                   message=event.message)  # fmt: skip
    if memory.storage_refusal is not None and memory.storage_refusal != status_refusal(status):
        kopf.event(body, type="Warning", reason="StorageResizeRefused",
                   message=memory.storage_refusal)  # fmt: skip
    progress = plan.progress
    new.rollout = None if progress is None else RolloutProgress(
        revision=progress.revision, step=progress.step, broker=progress.broker,
        since=iso(datetime.fromtimestamp(progress.since, UTC)), message=progress.message,
    )  # fmt: skip
    active_report = reports[new.active_broker] if new.active_broker is not None else None
    new.mirror = mirroring.state_of(
        spec.mirror, active_report.mirror if active_report is not None else None
    )
    if new.mirror is not None and status.mirror is not None:
        # What only the operator knows: kept until the next switch replaces it.
        new.mirror.demotion_token = status.mirror.demotion_token
        new.mirror.last_switch = status.mirror.last_switch
        new.mirror.failback = status.mirror.failback
    new.federation = federation.state_of(
        spec.federation, cluster.namespace, cluster.name,
        active_report.federation if active_report is not None else None,
    )  # fmt: skip
    federation.check_server_id(
        shared.server_ids, spec.federation, new.federation, cluster.uid, cluster.namespace,
        cluster.name, str(meta.get("creationTimestamp") or ""),
    )  # fmt: skip
    serving = admin_of(pods.get(new.active_broker), token, ca_pem) if (
        active_report is not None and new.active_broker is not None) else None  # fmt: skip
    for kind, reason, message in mirroring.switch_requests(
        spec.requests, new.handled_requests, new.mirror, serving, now_iso(),
    ):  # fmt: skip
        log.info("%s/%s: %s: %s", cluster.namespace, cluster.name, reason, message)
        kopf.event(body, type=kind, reason=reason, message=message)
    lags = {n: passive_lag(n, new.active_broker, reports) for n in NAMES}
    damage = damage_of(status, views, reports)
    new.brokers = [
        BrokerSummary(
            name=n, pod=pod_name(cluster, n), role=v.role if v.reachable else "unknown",
            reachable=v.reachable, ready=v.ready, epoch=v.epoch,
            link_connected=v.link_connected, fenced=n in new.fenced_brokers,
            link_tls=(r := reports.get(n)) is not None and r.replication.link_tls,
            lag_messages=lags[n][0], lag_seconds=lags[n][1],
            damaged=n in damage, damage=damage.get(n, ""),
        )
        for n, v in views.items()
    ]  # fmt: skip
    damage_events(body, status, new)
    for kind, reason, message in mirroring.events(status.mirror, new.mirror):
        kopf.event(body, type=kind, reason=reason, message=message)
    for kind, reason, message in federation.events(status.federation, new.federation):
        log.info("%s/%s: %s: %s", cluster.namespace, cluster.name, reason, message)
        kopf.event(body, type=kind, reason=reason, message=message)
    extra = [
        *rollout_conditions(new.rollout, memory.storage_refusal, memory.foreign),
        damaged_condition(new),
    ]
    if (mirrored := mirroring.condition(new.mirror)) is not None:
        extra.append(mirrored)
    if (failing_back := mirroring.failback_condition(new.mirror)) is not None:
        extra.append(failing_back)
    if (mirror_tls := peerca.condition(trust)) is not None:
        extra.append(mirror_tls)
    if (federated := federation.condition(new.federation)) is not None:
        extra.append(federated)
    if (federated_tls := federationtls.condition(fed_trust)) is not None:
        extra.append(federated_tls)
    new.conditions = conditions(decision, new, views, generation, extra)
    # The next step towards mutual TLS only from a pair running this one, in sync: its
    # rolling update then never leaves the pair unreplicated (operator/peertls.py).
    goal = peertls.target(spec)
    new.peer_tls = peertls.advance(
        peer_tls, goal, converged=plan.converged and not deferred,
        in_sync=decision.degraded is None and not decision.failing_over,
    )  # fmt: skip
    if new.peer_tls != peer_tls:
        message = (f"mutual TLS between the brokers: {peer_tls} -> {new.peer_tls} (target "
                   f"{goal}); the pods roll for it")  # fmt: skip
        log.info("%s/%s: %s", cluster.namespace, cluster.name, message)
        if status.peer_tls is not None:
            kopf.event(body, type="Normal", reason="PeerTlsStep", message=message)
    if plan.converged and memory.storage_refusal is None and not deferred and peer_tls == goal:
        # Observed only once the pods run this generation's spec (Argo CD, Flux, kstatus
        # read a spec change as done when observedGeneration reaches it), the steps
        # towards mutual TLS it asks for included.
        new.observed_generation = generation
    if not deferred:  # the audits too wait for the next pass
        created = parse_iso(meta.get("creationTimestamp") or now_iso())
        memory.audit_error = AuditRunner(k, cluster, spec, new, body, generation).reconcile_guarded(
            created, datetime.now(UTC), memory.audit_error
        )
    updating = new.rollout is not None and new.rollout.step not in ("Complete", "Stalled")
    new.phase = (
        "FailingOver" if decision.failing_over else "Pending" if new.epoch == 0
        else "Updating" if updating else "Degraded" if decision.degraded else "Ready"
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
    # A deleted BrokerCluster's timer is nearly always mid-pass when kopf stops it; kopf then
    # looks again only after this long (60 s by default) before it lets the deletion go on:
    # the pods and Services stayed a minute after the BrokerCluster went (the e2e test
    # of deletion failed on it). A pass lasts about a probe interval.
    settings.background.cancellation_polling = 0.5


def status_refusal(status: BrokerClusterStatus) -> str | None:
    """The volume resize refusal the status reports (so its Event is posted once)."""
    stalled = next((c for c in status.conditions if c.type == "Stalled"), None)
    if stalled is None or stalled.reason != "StorageResizeRefused":
        return None
    return stalled.message.removeprefix("volume resize refused: ")


async def settled(meta: Any, memory: Memory) -> None:
    """Wait until the live body is newer than the one the last status patch was decided
    on: deciding again on the status from before that patch would act twice (a recorded
    failover taken for an epoch to learn, a handled request handled again)."""
    if memory.patched_from is None:
        return
    deadline = time.monotonic() + SETTLE_TIMEOUT
    while meta.get("resourceVersion") == memory.patched_from:
        if time.monotonic() > deadline:
            log.warning("%s/%s: the status written %.1f s ago has not come back through the "
                        "watch; reconciling on the body as it is", meta.get("namespace"),
                        meta.get("name"), SETTLE_TIMEOUT)  # fmt: skip
            break
        await asyncio.sleep(0.01)
    memory.patched_from = None


@kopf.timer(GROUP, VERSION, PLURAL, interval=TICK)
async def tick(
    body: Any, spec: Any, status: Any, meta: Any, patch: Any, memo: Any, **_: Any
) -> None:
    """One pass of the reconcile loop: waits for a pod change (then reconciles at once)
    until the probe interval is due. `body` and its views are live (kopf updates them
    from the watch)."""
    memory, shared = memory_of(memo)
    shared.clusters[meta["uid"]] = memory
    await settled(meta, memory)
    due = memory.last_probe + memory.probe_interval - 0.05 - time.monotonic()
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(max(due, 0.0)):
            await memory.wake.wait()
    woken = memory.wake.is_set()
    memory.wake.clear()
    version = meta.get("resourceVersion")
    new = await asyncio.to_thread(reconcile, body, spec, status, meta, memo, woken)
    if new is not None:
        memory.patched_from = version
        for key, value in new.items():
            patch.status[key] = value


@kopf.on.event("", "v1", "pods", labels={builders.LABEL_CLUSTER: kopf.PRESENT})
async def pod_changed(body: Any, memo: Any, **_: Any) -> None:
    """A broker pod changed (its container stopped, restarted, the pod went away): wake its
    cluster's reconcile instead of waiting for the Lease or the next probe."""
    shared = memo.get("operator")
    if shared is None:  # run without `main()`: no shared state, the Lease path still holds
        return
    for owner in body.get("metadata", {}).get("ownerReferences") or []:
        memory = shared.clusters.get(owner.get("uid"))
        if memory is not None:
            memory.wake.set()


@kopf.on.delete(GROUP, VERSION, PLURAL, optional=True)
def forget(meta: Any, memo: Any, **_: Any) -> None:
    """A deleted cluster leaves nothing behind in the operator (its memo goes with it).
    Optional: it adds no finalizer (the timer's already makes kopf see the deletion)."""
    shared = memory_of(memo)[1]
    shared.degraded.discard(meta.get("uid", ""))
    shared.clusters.pop(meta.get("uid", ""), None)
    shared.server_ids.forget(meta.get("uid", ""))
    metrics.DEGRADED.set(len(shared.degraded))


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
    """Run the operator (all namespaces, or only those given; liveness on :8080/healthz),
    as the elected leader when leader election is configured (`operator/leader.py`).

    Watching given namespaces needs only namespaced RBAC (a Role): kopf then runs with
    resource scanning disabled, so it neither lists namespaces nor watches CRDs.
    """
    namespaces = watched_namespaces(argv)
    builders.broker_token_seconds()  # a bad value stops the start, not every reconcile
    certs.cert_seconds()
    carotation.grace_seconds()
    port = int(os.environ.get(OPERATOR_METRICS_PORT_ENV, metrics.DEFAULT_PORT))
    try:
        start_http_server(port)
    except OSError as exc:  # metrics are not worth refusing to run the operator
        log.warning("cannot serve metrics on :%d: %s", port, exc)
    kopf.configure(verbose=False)
    settings = kopf.OperatorSettings()
    settings.scanning.disabled = bool(namespaces)
    operator = functools.partial(
        kopf.operator,
        memo=kopf.Memo(operator=OperatorState()),
        clusterwide=not namespaces,
        namespaces=namespaces,
        settings=settings,
        standalone=True,  # one operator at a time: `leader` elects it, not kopf's peering
        liveness_endpoint=leader.health_endpoint(),
    )
    leader.run(operator)


if __name__ == "__main__":
    main()
