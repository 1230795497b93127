"""Drift detection (operator/drift.py): a repair is told from a no-op apply, a first apply
and a spec change, by the API server's answers alone; a restarted operator reads what the
previous process applied from the children themselves (real API server)."""

from __future__ import annotations

import itertools
import time
from typing import Any

import pytest

from twinmq.operator import main as operator_main
from twinmq.operator.builders import LABEL_BROKER, LABEL_CLUSTER, LABEL_ROLE, ClusterRef, pod_name
from twinmq.operator.drift import (
    DIGEST_ANNOTATION,
    Applied,
    applied,
    digest,
    key,
    remembered,
    repair,
    stamped,
)
from twinmq.operator.kube import Kube, Obj
from twinmq.operator.main import NAMES
from twinmq.operator.models import BrokerClusterSpec, BrokerName

MANAGER = "twinmq-operator"
DESIRED = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "orders"}, "spec": {}}


def answer(uid: str, ours: str, others: str = "2026-01-01T00:00:00Z") -> dict[str, Any]:
    """An apply's answer: the operator's entry changed at `ours`, kubectl's at `others`."""
    return {
        "metadata": {
            "uid": uid,
            "managedFields": [
                {"manager": "kubectl-edit", "operation": "Update", "time": others},
                {"manager": MANAGER, "operation": "Update", "time": "2026-01-01T00:00:09Z"},
                {"manager": MANAGER, "operation": "Apply", "time": ours},
            ],
        }
    }


def test_the_operators_apply_entry_is_read_not_its_update_or_anothers() -> None:
    state = applied(DESIRED, answer("u1", "2026-01-01T00:00:05Z"), MANAGER)
    assert state.uid == "u1" and state.changed == "2026-01-01T00:00:05Z"
    assert key(DESIRED) == "Service/orders"


def test_a_no_op_apply_is_no_repair_even_when_someone_else_wrote_meanwhile() -> None:
    before = applied(DESIRED, answer("u1", "2026-01-01T00:00:05Z"), MANAGER)
    after = applied(DESIRED, answer("u1", "2026-01-01T00:00:05Z", others="2026-01-01T00:01Z"),
                    MANAGER)  # fmt: skip
    assert repair(before, after) is None


def test_a_deleted_object_recreated_is_a_repair() -> None:
    before = applied(DESIRED, answer("u1", "2026-01-01T00:00:05Z"), MANAGER)
    after = applied(DESIRED, answer("u2", "2026-01-01T00:02:00Z"), MANAGER)
    assert repair(before, after) == "recreated"


def test_an_edited_object_set_back_is_a_repair() -> None:
    before = applied(DESIRED, answer("u1", "2026-01-01T00:00:05Z"), MANAGER)
    after = applied(DESIRED, answer("u1", "2026-01-01T00:02:00Z"), MANAGER)
    assert repair(before, after) == "restored"


def test_a_first_apply_and_a_changed_desired_state_are_no_repair() -> None:
    first = applied(DESIRED, answer("u1", "2026-01-01T00:00:05Z"), MANAGER)
    assert repair(None, first) is None
    grown = {**DESIRED, "spec": {"ports": [{"port": 5672}]}}
    updated = applied(grown, answer("u1", "2026-01-01T00:02:00Z"), MANAGER)
    assert repair(first, updated) is None
    assert repair(first, Applied("u1", first.changed, first.desired)) is None


def test_the_digest_ignores_its_own_annotation_and_no_other() -> None:
    stamp = stamped(DESIRED)
    assert stamp["metadata"]["annotations"] == {DIGEST_ANNOTATION: digest(DESIRED)}
    assert digest(stamp) == digest(DESIRED)
    assert DESIRED["metadata"] == {"name": "orders"}  # not modified in place
    annotated = {**DESIRED, "metadata": {"name": "orders", "annotations": {"a": "1"}}}
    assert digest(annotated) != digest(DESIRED)


def test_an_unstamped_or_foreign_child_remembers_nothing() -> None:
    live = answer("u1", "2026-01-01T00:00:05Z")
    assert remembered(None, MANAGER) is None
    assert remembered(live, MANAGER) is None  # applied by an operator before the stamps
    live["metadata"]["annotations"] = {DIGEST_ANNOTATION: digest(DESIRED)}
    assert remembered(live, "someone-else") is None
    assert remembered(live, MANAGER) == Applied("u1", "2026-01-01T00:00:05Z", digest(DESIRED))


SERVICES = (f"drift-{n}" for n in itertools.count())


def service(name: str) -> dict[str, Any]:
    """A child as the operator builds it."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": "default", "labels": {"app": name}},
        "spec": {"selector": {"app": name}, "ports": [{"name": "amqp", "port": 5672}]},
    }


def first_apply_of_a_new_process(kube: Kube, desired: dict[str, Any]) -> str | None:
    """What a restarted operator's first pass reports for one child (`reconcile_children`)."""
    name = desired["metadata"]["name"]
    before = remembered(kube.get("v1", "Service", "default", name), MANAGER)
    return repair(before, applied(desired, kube.apply(stamped(desired)), MANAGER))


def next_second() -> None:
    """Sleep into the next wall-clock second: managedFields times have one-second
    resolution, and a repair within the second of the previous write is not seen (the
    documented limit)."""
    time.sleep(1.05 - time.time() % 1)


def test_an_edit_made_while_no_operator_ran_is_reported_by_the_next_one(kube: Kube) -> None:
    desired = service(next(SERVICES))
    name = desired["metadata"]["name"]
    kube.apply(stamped(desired))  # the previous operator process
    next_second()
    kube.dynamic.resources.get(api_version="v1", kind="Service").patch(
        name=name, namespace="default", body={"metadata": {"labels": {"app": "hijacked"}}},
        content_type="application/merge-patch+json", field_manager="kubectl-edit",
    )  # fmt: skip
    assert first_apply_of_a_new_process(kube, desired) == "restored"
    live = kube.get("v1", "Service", "default", name)
    assert live is not None and live["metadata"]["labels"]["app"] == name


def test_a_restart_with_nothing_edited_reports_nothing(kube: Kube) -> None:
    desired = service(next(SERVICES))
    kube.apply(stamped(desired))
    assert first_apply_of_a_new_process(kube, desired) is None
    changed = {**desired, "spec": {**desired["spec"], "ports": [{"name": "amqp", "port": 5673}]}}
    assert first_apply_of_a_new_process(kube, changed) is None  # an upgrade's new spec


# -- the virtual IP's labels on a pod the operator serves by name ----------------------------
def broker_pod(cluster: ClusterRef, broker: BrokerName, role: str, owner_uid: str | None) -> Obj:
    """A broker pod as the API server stores it (no node runs it here); `owner_uid`
    None: no owner, as the garbage collector leaves a pod whose BrokerCluster was deleted
    with `--cascade=orphan`."""
    meta: Obj = {
        "name": pod_name(cluster, broker),
        "namespace": cluster.namespace,
        "labels": {LABEL_CLUSTER: cluster.name, LABEL_BROKER: broker, LABEL_ROLE: role},
    }
    if owner_uid is not None:
        meta["ownerReferences"] = [{
            "apiVersion": "twinmq.io/v1alpha1", "kind": "BrokerCluster", "name": cluster.name,
            "uid": owner_uid, "controller": True,
        }]  # fmt: skip
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {"automountServiceAccountToken": False,
                 "containers": [{"name": "broker", "image": "twinmq:test"}]},
    }  # fmt: skip


def test_the_active_a_re_created_cluster_serves_keeps_the_virtual_ips_label(
    kube: Kube, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A BrokerCluster deleted with `--cascade=orphan` and created again (new uid): its
    # pods run on without owner, and the operator serves them by name (probes, rollout,
    # role labels). The foreign-pod repair must not take the active off the virtual IP
    # each pass while the role repair puts it back the next.
    cluster = ClusterRef("recreated", "default", "uid-of-the-new-one")
    monkeypatch.setattr(operator_main, "KUBE", kube)
    # No controller manager here creates the namespace's default service account.
    kube.ensure({"apiVersion": "v1", "kind": "ServiceAccount",
                 "metadata": {"name": "default", "namespace": cluster.namespace}})  # fmt: skip
    kube.ensure(broker_pod(cluster, "primary", "active", owner_uid=None))
    kube.ensure(broker_pod(cluster, "backup", "passive", owner_uid="uid-of-the-old-one"))
    for _ in range(3):  # three steady-state reconcile passes
        pods = {n: kube.get_pod(cluster.namespace, pod_name(cluster, n)) for n in NAMES}
        repaired = operator_main.repair_routing(
            cluster, BrokerClusterSpec(), "primary", pods, "primary"
        )
        assert [r.kind for r in repaired] == []
        live = kube.get_pod(cluster.namespace, pod_name(cluster, "primary")) or {}
        assert live["metadata"]["labels"].get(LABEL_ROLE) == "active"


# -- the federation file after spec.federation is removed -----------------------------------
def test_the_federation_file_goes_once_no_pod_mounts_it_and_only_if_the_cluster_owns_it(
    kube: Kube, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(operator_main, "KUBE", kube)
    kube.ensure({"apiVersion": "v1", "kind": "ServiceAccount",
                 "metadata": {"name": "default", "namespace": "default"}})  # fmt: skip
    cluster = ClusterRef("unfederated", "default", "uid-unfederated")
    name = f"{cluster.name}-federation"

    def config_map(owner_uid: str) -> Obj:
        return {
            "apiVersion": "v1", "kind": "ConfigMap", "data": {"federation.yaml": "{}"},
            "metadata": {"name": name, "namespace": "default", "ownerReferences": [{
                "apiVersion": "twinmq.io/v1alpha1", "kind": "BrokerCluster",
                "name": cluster.name, "uid": owner_uid, "controller": True,
            }]},
        }  # fmt: skip

    kube.ensure(config_map(cluster.uid))
    old = broker_pod(cluster, "primary", "active", owner_uid=cluster.uid)
    old["spec"]["volumes"] = [{"name": "federation", "configMap": {"name": name}}]
    pods: dict[BrokerName, Any] = {"primary": old, "backup": None}
    memory = operator_main.Memory()
    operator_main.remove_federation_config(cluster, memory, pods)
    assert kube.get("v1", "ConfigMap", "default", name) is not None, "a pod still mounts it"
    pods["primary"] = broker_pod(cluster, "primary", "active", owner_uid=cluster.uid)
    operator_main.remove_federation_config(cluster, memory, pods)
    assert kube.get("v1", "ConfigMap", "default", name) is None, "rolled out: deleted"
    assert memory.federation_config_gone

    other = ClusterRef("unfederated", "default", "uid-of-another")
    kube.ensure(config_map("uid-of-someone-else"))
    operator_main.remove_federation_config(other, operator_main.Memory(), pods)
    assert kube.get("v1", "ConfigMap", "default", name) is not None, "not this cluster's"
