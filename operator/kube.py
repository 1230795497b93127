"""The operator's only Kubernetes I/O: server-side apply, create, get, patch, delete.

Everything else in the operator is pure (builders, `decide`); handlers call
this module and nothing else that talks to the API server.
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any, TypeVar

import kopf
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.dynamic import DynamicClient

from twinmq.broker.lease import GUARD_ANNOTATION, ReplicationGuard
from twinmq.operator.ownership import Owner, foreign_reason, owns

log = logging.getLogger(__name__)
Obj = dict[str, Any]
FIELD_MANAGER = "twinmq-operator"
"""The operator's field manager: it owns the fields it applies and takes them back from
anyone who edits them (force), which is how drift is repaired."""
T = TypeVar("T")


def absent_as_none(call: Callable[[], T]) -> T | None:
    """The result of an API read, or None when the object does not exist (404)."""
    try:
        return call()
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


class Refused(Exception):
    """The API server refused a write as invalid or forbidden (422, 403): retrying the same
    write cannot help. The message is the API server's."""


def refusal(exc: ApiException) -> str:
    """The API server's reason for refusing a write."""
    try:
        return str(json.loads(exc.body or "{}").get("message") or exc.reason)
    except ValueError:
        return str(exc.reason)


class Conflict(Exception):
    """A write lost a race: the object changed (409) since it was read, or was created by
    someone else first."""


FOREIGN_RETRY = 30.0
"""Seconds before a reconcile that met someone else's object under a generated name tries
again (someone must delete or rename it first)."""


class Foreign(kopf.TemporaryError):
    """An object exists under a name the operator generates and is not this
    BrokerCluster's: someone else made it (before the cluster, or after deleting the
    operator's). The operator neither uses its data nor rewrites it (its owner reference
    would have the garbage collector delete it with the cluster): the reconcile waits,
    saying which object and why (docs/security.md, "Names the operator generates")."""

    def __init__(self, kind: str, name: str, why: str, hint: str = "") -> None:
        self.kind, self.name, self.why = kind, name, why
        super().__init__(
            f"{kind} {name} exists and is not this BrokerCluster's ({why}): the operator "
            f"neither uses nor rewrites it; delete or rename it and the operator makes its "
            f"own{hint}",
            delay=FOREIGN_RETRY,
        )


def owned(found: Obj | None, owner: Owner, certificate: Obj | None = None) -> Obj | None:
    """`found`, an object read under a name the operator generates, if `owner` owns it
    (None: there is none); raises `Foreign` otherwise. Every read of such an object goes
    through here."""
    if found is None:
        return None
    why = foreign_reason(found, owner, certificate)
    if why is not None:
        meta = found.get("metadata") or {}
        raise Foreign(str(found.get("kind") or "object"), str(meta.get("name")), why)
    return found


class Kube:
    """A thin wrapper over the dynamic client (in-cluster config, or $KUBECONFIG, or the
    kubeconfig file given)."""

    def __init__(self, kubeconfig: str | None = None) -> None:
        if kubeconfig is not None:
            config.load_kube_config(config_file=kubeconfig)
        else:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
        self.api = client.ApiClient()
        self.dynamic = DynamicClient(self.api)
        self.core = client.CoreV1Api(self.api)
        self.coordination = client.CoordinationV1Api(self.api)

    def _resource(self, obj: Obj) -> Any:
        return self.dynamic.resources.get(api_version=obj["apiVersion"], kind=obj["kind"])

    def apply(self, obj: Obj) -> Obj:
        """Server-side apply `obj` as the operator's field manager, taking over conflicting
        fields: a deleted object is recreated, an edited field set back. A no-op when the
        object already is as desired (no write, no new resourceVersion). Raises `Refused`
        when the API server refuses the change (a PVC shrunk, an immutable field)."""
        meta = obj["metadata"]
        try:
            applied = self._resource(obj).server_side_apply(
                body=obj,
                name=meta["name"],
                namespace=meta.get("namespace"),
                field_manager=FIELD_MANAGER,
                force_conflicts=True,
            )
        except ApiException as exc:
            if exc.status in (403, 422):
                raise Refused(refusal(exc)) from exc
            raise
        return dict(applied.to_dict())

    def ensure(self, obj: Obj) -> bool:
        """Create the object unless it exists; returns whether it was created (for what is
        made once and never changed: audit runs, and pods, whose spec is immutable)."""
        try:
            self._resource(obj).create(
                body=obj, namespace=obj["metadata"].get("namespace"), field_manager=FIELD_MANAGER
            )
        except ApiException as exc:
            if exc.status == 409:
                return False
            raise
        log.info("created %s %s", obj["kind"], obj["metadata"]["name"])
        return True

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> Obj | None:
        """Any namespaced object as a dict, or None."""
        resource = self.dynamic.resources.get(api_version=api_version, kind=kind)
        found = absent_as_none(lambda: resource.get(name=name, namespace=namespace))
        return None if found is None else dict(found.to_dict())

    def list(self, api_version: str, kind: str, namespace: str, selector: str) -> list[Obj]:
        """The namespaced objects of a kind matching a label selector."""
        resource = self.dynamic.resources.get(api_version=api_version, kind=kind)
        items: list[Obj] = resource.get(namespace=namespace, label_selector=selector).to_dict()[
            "items"
        ]
        return items

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        """Delete an object and, in the background, what it owns (a Job's pods); logged
        when there was one."""
        resource = self.dynamic.resources.get(api_version=api_version, kind=kind)
        found = absent_as_none(
            lambda: resource.delete(name=name, namespace=namespace, propagation_policy="Background")
        )
        if found is not None:
            log.info("deleted %s %s/%s", kind, namespace, name)

    def get_pod(self, namespace: str, name: str) -> Obj | None:
        """A pod as a dict, or None."""
        pod = absent_as_none(lambda: self.core.read_namespaced_pod(name, namespace))
        return None if pod is None else dict(self.api.sanitize_for_serialization(pod))

    def delete_pod(self, namespace: str, name: str, uid: str) -> None:
        """Delete the pod with this uid (not a newer one of the same name), gracefully."""
        absent_as_none(
            lambda: self.core.delete_namespaced_pod(
                name,
                namespace,
                body=client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=uid)),
            )
        )
        log.info("deleted pod %s/%s", namespace, name)

    def get_owned(
        self, api_version: str, kind: str, namespace: str, name: str, owner: Owner
    ) -> Obj | None:
        """An object under a name the operator generates, or None; raises `Foreign` when
        `owner` does not own it (`owned`)."""
        found = self.get(api_version, kind, namespace, name)
        certificate = None
        if found is not None and owner.certificate is not None and not owns(found, owner.uid):
            certificate = self.get("cert-manager.io/v1", "Certificate", namespace,
                                   owner.certificate)  # fmt: skip
        return owned(found, owner, certificate)

    def get_secret_data(
        self, namespace: str, name: str, owner: Owner | None = None
    ) -> dict[str, str] | None:
        """A Secret's data, decoded (None: no such Secret). With `owner`, a Secret under a
        name the operator generates: raises `Foreign` unless `owner` owns it."""
        if owner is not None:
            found = self.get_owned("v1", "Secret", namespace, name, owner)
            return None if found is None else decoded_secret_data(found.get("data"))
        secret = absent_as_none(lambda: self.core.read_namespaced_secret(name, namespace))
        return None if secret is None else decoded_secret_data(secret.data)

    def label_pod(self, namespace: str, name: str, labels: Mapping[str, str | None]) -> None:
        """Merge labels into a pod, None removing one (the Service selectors follow at
        once)."""
        self.core.patch_namespaced_pod(name, namespace, {"metadata": {"labels": labels}})

    def get_lease(self, namespace: str, name: str, timeout: float | None = None) -> Obj | None:
        """A Lease as a dict, or None (a request of at most `timeout` seconds, if given)."""
        lease = absent_as_none(
            lambda: self.coordination.read_namespaced_lease(
                name, namespace, _request_timeout=timeout
            )
        )
        return None if lease is None else dict(self.api.sanitize_for_serialization(lease))

    def put_lease(self, lease: Obj, handover_epoch: int | None = None) -> None:
        """Create or replace the Lease (the operator hands it to the broker it activates).

        `handover_epoch`: the epoch the holder was just activated in. The Lease then says
        `<epoch>:0` (the replication guard), as the new active's first renewal would: it
        cannot have gone on alone yet, since it marks the Lease first and may write it only
        once it holds it. Without this, an active frozen before its first renewal (a third
        of a duration after its activation) left no guard, and an operator that restarted
        meanwhile, which trusts only a guard once the passive's readiness window has
        passed, never promoted the caught-up passive. A guard of that epoch or later is the
        broker's own and stays; the replace carries the read resourceVersion, so a
        broker's write in between wins (409)."""
        namespace, name = lease["metadata"]["namespace"], lease["metadata"]["name"]
        current = self.get_lease(namespace, name)
        if handover_epoch is not None:
            found = None if current is None else ReplicationGuard.of_lease(current)
            if found is None or found.epoch < handover_epoch:
                meta = lease["metadata"] if current is None else current["metadata"]
                meta["annotations"] = {
                    **(meta.get("annotations") or {}),
                    GUARD_ANNOTATION: ReplicationGuard(handover_epoch, False).encode(),
                }
        if current is None:
            self.coordination.create_namespaced_lease(namespace, lease)  # type: ignore[arg-type]
            return
        current["spec"] = lease["spec"]
        # The client takes plain dicts as bodies; its signatures name the model classes.
        self.coordination.replace_namespaced_lease(name, namespace, current)  # type: ignore[arg-type]

    def write_lease(self, lease: Obj, timeout: float) -> Obj:
        """Create the Lease, or replace it if `lease` carries the resourceVersion it was read
        at; raises `Conflict` when another writer got there first (optimistic concurrency:
        the operator's leader election). A request takes at most `timeout` seconds."""
        namespace, name = lease["metadata"]["namespace"], lease["metadata"]["name"]
        body: Any = lease  # the client takes plain dicts; its signatures name model classes
        try:
            if lease["metadata"].get("resourceVersion") is None:
                written = self.coordination.create_namespaced_lease(
                    namespace, body, _request_timeout=timeout
                )
            else:
                written = self.coordination.replace_namespaced_lease(
                    name, namespace, body, _request_timeout=timeout
                )
        except ApiException as exc:
            if exc.status == 409:
                raise Conflict(refusal(exc)) from exc
            raise
        return dict(self.api.sanitize_for_serialization(written))

    def record_event(
        self, involved: Obj, reason: str, message: str, timeout: float, warning: bool = False
    ) -> None:
        """Post a core/v1 Event about `involved` (any namespaced object as the API serves
        it), for what happens outside kopf's handlers (leader election)."""
        meta = involved["metadata"]
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        body: Any = {
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": involved["apiVersion"], "kind": involved["kind"],
                "name": meta["name"], "namespace": meta["namespace"], "uid": meta.get("uid"),
                "resourceVersion": meta.get("resourceVersion"),
            },
            "reason": reason, "message": message, "type": "Warning" if warning else "Normal",
            "source": {"component": FIELD_MANAGER}, "reportingComponent": FIELD_MANAGER,
            "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        }  # fmt: skip
        self.core.create_namespaced_event(meta["namespace"], body, _request_timeout=timeout)

    def dumps(self, obj: Any) -> str:
        """JSON of an API object (for logs)."""
        return json.dumps(self.api.sanitize_for_serialization(obj))


def decoded_secret_data(data: Mapping[str, str | bytes] | None) -> dict[str, str]:
    """A Secret's `data` (base64 values) decoded."""
    return {k: base64.b64decode(v).decode() for k, v in (data or {}).items()}
