"""Pure builders: a BrokerCluster in, the Kubernetes objects it owns out.

No API calls and no global configuration: the reconciler passes everything in
and applies the results (server-side apply), as CloudNativePG's `pkg/specs` do.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from twinmq.broker.auth import hash_password
from twinmq.broker.names import (
    ACTIVE,
    ADMIN_PORT,
    ADMIN_READ_TOKEN_ENV,
    ADMIN_TOKEN_ENV,
    AMQP_PORT,
    AMQPS_PORT,
    LEASE_NAME_ENV,
    LEASE_SECONDS_ENV,
    PASSIVE,
    REPLICATION_PORT,
    REPLICATION_TOKEN_ENV,
)
from twinmq.broker.settings import flag
from twinmq.operator import federation, mirroring
from twinmq.operator.models import (
    CERTIFICATE_LOGIN_ARGS,
    BrokerClusterSpec,
    BrokerName,
    ClientCertificates,
    Limits,
    Mirror,
    PeerTlsPhase,
    Tls,
)

Obj = dict[str, Any]

DATA_DIR = "/var/lib/twinmq"
SECRET_DIR = "/etc/twinmq/auth"
APP_USER = "twinmq"
# The user downstream federation links log in as (tagged `federation`: only such a user
# may announce a server id, broker/auth.py `link_refusal`); its password `federation-password`.
FEDERATION_USER = "twinmq-federation"

LABEL_CLUSTER = "twinmq.io/cluster"
LABEL_BROKER = "twinmq.io/broker"
LABEL_ROLE = "twinmq.io/role"
POD_TEMPLATE_HASH = "twinmq.io/pod-template-hash"
"""Annotation of a broker pod: the hash of the pod spec it was created from."""


@dataclass(frozen=True)
class ClusterRef:
    """The BrokerCluster an object belongs to (for names, labels, owner references)."""

    name: str
    namespace: str
    uid: str


def labels(cluster: ClusterRef, broker: BrokerName | None = None) -> dict[str, str]:
    """The labels of every object of the cluster (the one label helper)."""
    out = {
        "app.kubernetes.io/name": "twinmq",
        "app.kubernetes.io/instance": cluster.name,
        "app.kubernetes.io/managed-by": "twinmq-operator",
        LABEL_CLUSTER: cluster.name,
    }
    if broker is not None:
        out[LABEL_BROKER] = broker
    return out


def broker_selector(cluster: ClusterRef) -> Obj:
    """A label selector of the cluster's two broker pods (not its audit runs' pods)."""
    return {
        "matchLabels": {LABEL_CLUSTER: cluster.name},
        "matchExpressions": [{"key": LABEL_BROKER, "operator": "Exists"}],
    }


def owned_meta(cluster: ClusterRef, name: str, broker: BrokerName | None = None) -> Obj:
    """Metadata of an object the BrokerCluster owns (garbage-collected with it)."""
    return {
        "name": name,
        "namespace": cluster.namespace,
        "labels": labels(cluster, broker),
        "ownerReferences": [
            {
                "apiVersion": "twinmq.io/v1alpha1",
                "kind": "BrokerCluster",
                "name": cluster.name,
                "uid": cluster.uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ],
    }


def pod_name(cluster: ClusterRef, broker: BrokerName) -> str:
    """`<cluster>-primary` / `<cluster>-backup`."""
    return f"{cluster.name}-{broker}"


def secret_name(cluster: ClusterRef, spec: BrokerClusterSpec) -> str:
    """The credentials Secret (given in the spec, or the generated one)."""
    return spec.auth.secret_name or f"{cluster.name}-auth"


TLS_DIR = "/etc/twinmq/tls"
"""Where the broker container sees the server certificate's Secret (a whole-Secret volume,
no subPath: the kubelet's in-place updates must reach the files, `operator/certs.py`)."""


def tls_secret_name(cluster: ClusterRef, tls: Tls) -> str:
    """The server certificate's Secret the pods mount (given, or `<cluster>-tls`)."""
    return tls.secret_name or f"{cluster.name}-tls"


def tls_args(spec: BrokerClusterSpec) -> list[str]:
    """The broker's flags for AMQPS (its default port, 5671); none without TLS."""
    if not spec.tls.enabled:
        return []
    return [f"--tls-cert={TLS_DIR}/tls.crt", f"--tls-key={TLS_DIR}/tls.key"]


def tls_volumes(cluster: ClusterRef, spec: BrokerClusterSpec) -> list[Obj]:
    """The server certificate's Secret volume (the certificate and key only)."""
    if not spec.tls.enabled:
        return []
    return [{"name": "tls", "secret": {
        "secretName": tls_secret_name(cluster, spec.tls),
        "items": [{"key": "tls.crt", "path": "tls.crt"}, {"key": "tls.key", "path": "tls.key"}],
    }}]  # fmt: skip


def tls_mounts(spec: BrokerClusterSpec) -> list[Obj]:
    """Where the broker container sees it."""
    return [{"name": "tls", "mountPath": TLS_DIR, "readOnly": True}] if spec.tls.enabled else []


CLIENT_CA_DIR = "/etc/twinmq/client-ca"
"""Where the broker container sees the applications' CA bundle (`spec.tls.clientCertificates`;
a whole volume, no subPath, so the kubelet's updates reach the file and the broker reloads
it)."""


def client_certificates(spec: BrokerClusterSpec) -> ClientCertificates | None:
    """The client certificates AMQPS asks for, if any (TLS on, a mode other than `none`)."""
    wanted = spec.tls.client_certificates
    if not spec.tls.enabled or wanted is None or wanted.mode == "none":
        return None
    return wanted


def federation_amqps(spec: BrokerClusterSpec) -> bool:
    """Whether federation sets AMQPS's client CA (`--tls-ca`: its downstreams' CAs,
    certificates optional, no certificate login): with TLS on, unless
    `spec.tls.clientCertificates` does."""
    return spec.tls.enabled and client_certificates(spec) is None


def downstream_cas_beside(spec: BrokerClusterSpec) -> bool:
    """Whether the downstreams' CAs go beside the applications' bundle
    (`--tls-federation-ca`): with `spec.tls.clientCertificates` and a downstream bundle.
    Never in `--tls-ca`: a certificate of `--tls-ca` may log in (`login`), and a
    downstream's CA key is another namespace's Secret (docs/security.md, "Whose CA may
    log in")."""
    fed = spec.federation
    return (
        client_certificates(spec) is not None
        and fed is not None
        and fed.downstream_ca_config_map is not None
    )


def client_ca_args(spec: BrokerClusterSpec) -> list[str]:
    """`--tls-ca`, `--tls-client-certs` and `--tls-cert-login` from
    `spec.tls.clientCertificates` (none unset), and `--tls-federation-ca` beside them."""
    wanted = client_certificates(spec)
    if wanted is None:
        return []
    args = [f"--tls-ca={CLIENT_CA_DIR}/ca.crt", f"--tls-client-certs={wanted.mode}"]
    if downstream_cas_beside(spec):
        args.append(f"--tls-federation-ca={federation.DOWNSTREAM_CA_DIR}/ca.crt")
    if wanted.login is not None:
        args.append(f"--tls-cert-login={CERTIFICATE_LOGIN_ARGS[wanted.login]}")
    return args


def downstream_ca_mounted(spec: BrokerClusterSpec) -> bool:
    """Whether the pod mounts the downstreams' CAs (`federation.volumes`' `amqps`): as
    `--tls-ca` or as `--tls-federation-ca`."""
    return federation_amqps(spec) or downstream_cas_beside(spec)


def client_ca_volumes(spec: BrokerClusterSpec) -> list[Obj]:
    """The bundle's ConfigMap or Secret, its one key as `ca.crt`."""
    wanted = client_certificates(spec)
    if wanted is None:
        return []
    items = [{"key": wanted.ca_key, "path": "ca.crt"}]
    if wanted.ca_secret_name is not None:
        return [{"name": "client-ca", "secret": {"secretName": wanted.ca_secret_name,
                                                 "items": items}}]  # fmt: skip
    return [{"name": "client-ca", "configMap": {"name": wanted.ca_config_map, "items": items}}]


def client_ca_mounts(spec: BrokerClusterSpec) -> list[Obj]:
    """Where the broker container sees it."""
    if client_certificates(spec) is None:
        return []
    return [{"name": "client-ca", "mountPath": CLIENT_CA_DIR, "readOnly": True}]


PEER_TLS_DIR = "/etc/twinmq/peer-tls"
"""Where the broker container sees its own certificate (`<cluster>-<broker>-tls`: naming
this broker only, server and client use, with the CA): the replication link's mutual TLS
and the admin API's HTTPS."""
ADMIN_SCHEME = "twinmq.io/admin-scheme"
"""Annotation of a broker pod: `https` when its admin API answers HTTPS only (the operator
dials each pod as its template says: during a rollout one may still speak HTTP)."""
PEER_TLS_MODES: dict[PeerTlsPhase, str] = {
    "PlainListener": "plain-listener",
    "TlsListener": "tls-listener",
    "Required": "required",
}
"""The broker's `--replication-tls-mode` at each phase (none at Plaintext)."""


def other_broker(broker: BrokerName) -> BrokerName:
    """The pair's other broker."""
    return "backup" if broker == "primary" else "primary"


def peer_address(cluster: ClusterRef, broker: BrokerName) -> str:
    """`--peer` of `broker`: the other pod's stable name through the headless Service (it
    publishes not-ready pods too) and its replication port. The operator dials pod IPs:
    the broker accepts one as `replicate_from` only if this name resolves to it, and over
    mutual TLS only a certificate naming the other pod (`--replication-tls-server-name`)."""
    other = pod_name(cluster, other_broker(broker))
    return f"{other}.{cluster.name}-brokers.{cluster.namespace}.svc:{REPLICATION_PORT}"


def peer_secret_name(cluster: ClusterRef, broker: BrokerName) -> str:
    """The broker's own certificate Secret (`<cluster>-primary-tls`)."""
    return f"{pod_name(cluster, broker)}-tls"


def peer_tls_args(cluster: ClusterRef, broker: BrokerName, phase: PeerTlsPhase) -> list[str]:
    """The broker's flags for mutual TLS on the replication link and HTTPS on the admin API
    at `phase`. The passive dials the active's pod IP: it checks the certificate for the
    other broker's pod name instead (`--replication-tls-server-name`)."""
    if phase == "Plaintext":
        return []
    return [
        f"--replication-tls-cert={PEER_TLS_DIR}/tls.crt",
        f"--replication-tls-key={PEER_TLS_DIR}/tls.key",
        f"--replication-tls-ca={PEER_TLS_DIR}/ca.crt",
        f"--replication-tls-mode={PEER_TLS_MODES[phase]}",
        f"--replication-tls-server-name={pod_name(cluster, other_broker(broker))}",
        f"--admin-tls-cert={PEER_TLS_DIR}/tls.crt",
        f"--admin-tls-key={PEER_TLS_DIR}/tls.key",
    ]


def peer_tls_volumes(cluster: ClusterRef, broker: BrokerName, phase: PeerTlsPhase) -> list[Obj]:
    """The broker's own certificate Secret (whole: the kubelet's updates reach the files)."""
    if phase == "Plaintext":
        return []
    return [{"name": "peer-tls", "secret": {
        "secretName": peer_secret_name(cluster, broker),
        "items": [{"key": k, "path": k} for k in ("tls.crt", "tls.key", "ca.crt")],
    }}]  # fmt: skip


def peer_tls_mounts(phase: PeerTlsPhase) -> list[Obj]:
    """Where the broker container sees it."""
    if phase == "Plaintext":
        return []
    return [{"name": "peer-tls", "mountPath": PEER_TLS_DIR, "readOnly": True}]


def health_probe(phase: PeerTlsPhase, period: int, failures: int) -> Obj:
    """The kubelet's probe of `/healthz` (HTTPS once the admin API serves it; the kubelet
    does not verify the certificate)."""
    get: Obj = {"path": "/healthz", "port": "admin"}
    if phase != "Plaintext":
        get["scheme"] = "HTTPS"
    return {"httpGet": get, "periodSeconds": period, "failureThreshold": failures}


def amqps_ports(spec: BrokerClusterSpec) -> list[Obj]:
    """The broker container's AMQPS port; none without TLS."""
    return [{"name": "amqps", "containerPort": AMQPS_PORT}] if spec.tls.enabled else []


def lease_name(cluster: ClusterRef) -> str:
    """The Lease of the active role."""
    return f"{cluster.name}-active"


def vip_name(cluster: ClusterRef) -> str:
    """The virtual-IP Service clients use."""
    return cluster.name


def upgrade_credentials(found: dict[str, str]) -> dict[str, str]:
    """Generated credentials brought to this version: a read-only `metrics-token` added
    when missing, and the app user's password hash re-done with scrypt when it is still a
    salted SHA-256 one (what TwinMQ wrote before), the federation links' user added when
    missing; unchanged otherwise. The brokers take the new hash at their next start and
    accept the old one until then (the users file is read again when it changes)."""
    if "metrics-token" not in found:
        found = {**found, "metrics-token": secrets.token_urlsafe(32)}
    try:
        users = json.loads(found.get("users.json", ""))
        entry = next(u for u in users["users"] if u.get("name") == APP_USER)
    except (ValueError, KeyError, TypeError, StopIteration):
        return found
    if "federation-password" not in found:
        linked = secrets.token_urlsafe(24)
        users["users"].append(federation_user(linked))
        found = {**found, "federation-password": linked, "users.json": json.dumps(users)}
    legacy, password = entry.get("password_hash"), found.get("password")
    if not (isinstance(legacy, str) and legacy.startswith("sha256:") and password):
        return found
    entry["password_hash"] = hash_password(password)
    return {**found, "users.json": json.dumps(users)}


def federation_user(password: str) -> dict[str, Any]:
    """The users file's entry for the federation links' user."""
    return {"name": FEDERATION_USER, "password_hash": hash_password(password),
            "tags": ["federation"]}  # fmt: skip


def generate_credentials() -> dict[str, str]:
    """New credentials: the app user, the federation links' user, the admin token, the
    replication token."""
    password = secrets.token_urlsafe(24)
    federation_password = secrets.token_urlsafe(24)
    users = {"users": [{"name": APP_USER, "password_hash": hash_password(password)},
                       federation_user(federation_password)]}  # fmt: skip
    return {
        "username": APP_USER,
        "password": password,
        "federation-password": federation_password,
        "users.json": json.dumps(users),
        "admin-token": secrets.token_urlsafe(32),
        "metrics-token": secrets.token_urlsafe(32),
        "replication-token": secrets.token_urlsafe(32),
    }


def build_secret(cluster: ClusterRef, credentials: dict[str, str]) -> Obj:
    """The generated credentials Secret holding `credentials` (as `data`: applied as is,
    unlike write-only `stringData`, it compares equal to what the API server stores)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": owned_meta(cluster, f"{cluster.name}-auth"),
        "type": "Opaque",
        "data": {k: base64.b64encode(v.encode()).decode() for k, v in credentials.items()},
    }


def build_pvc(cluster: ClusterRef, spec: BrokerClusterSpec, broker: BrokerName) -> Obj:
    """The broker's data volume (outlives its pod)."""
    pvc: Obj = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": owned_meta(cluster, pod_name(cluster, broker), broker),
        "spec": {
            "accessModes": ["ReadWriteOnce"],
            "resources": {"requests": {"storage": spec.storage.size}},
        },
    }
    if spec.storage.storage_class_name:
        pvc["spec"]["storageClassName"] = spec.storage.storage_class_name
    return pvc


IMAGE_UID = 10001
"""The unprivileged user of the TwinMQ image (`USER 10001:10001` in the Containerfile)."""
POD_SECURITY: Obj = {
    "runAsNonRoot": True,
    "runAsUser": IMAGE_UID,
    "runAsGroup": IMAGE_UID,
    "fsGroup": IMAGE_UID,  # the data volume is writable by the broker's group
    "fsGroupChangePolicy": "OnRootMismatch",  # no recursive chown of a big journal at start
    "seccompProfile": {"type": "RuntimeDefault"},
}
"""Broker pods meet the `restricted` Pod Security Standard, as CloudNativePG's do."""
TMP_MOUNT: Obj = {"name": "tmp", "mountPath": "/tmp"}  # the root filesystem is read-only
CONTAINER_SECURITY: Obj = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,  # writes go to the data volume and /tmp only
    "capabilities": {"drop": ["ALL"]},
}


BROKER_TOKEN_SECONDS_ENV = "TWINMQ_OPERATOR_BROKER_TOKEN_SECONDS"
"""Operator setting: the lifetime of the broker pods' service-account token (default unset:
the API server's automatic `kube-api-access` volume)."""
MIN_TOKEN_SECONDS = 600
"""The TokenRequest API refuses shorter lifetimes."""
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


def broker_token_seconds(env: Mapping[str, str] = os.environ) -> int | None:
    """$TWINMQ_OPERATOR_BROKER_TOKEN_SECONDS: None when unset; refused below the API's
    minimum. Meant for proving token rotation (a test can outlive several lifetimes in
    half an hour), and for clusters whose policy wants short-lived tokens."""
    raw = env.get(BROKER_TOKEN_SECONDS_ENV, "").strip()
    if not raw:
        return None
    seconds = int(raw)
    if seconds < MIN_TOKEN_SECONDS:
        raise ValueError(f"{BROKER_TOKEN_SECONDS_ENV}={seconds}: at least {MIN_TOKEN_SECONDS}")
    return seconds


def token_volume(seconds: int) -> Obj:
    """The API server's `kube-api-access` volume (token, cluster CA, namespace), but with the
    token lifetime given (the admission plugin's is fixed: 3607 s)."""
    return {
        "name": "kube-api-access",
        "projected": {"defaultMode": 0o444, "sources": [
            {"serviceAccountToken": {"path": "token", "expirationSeconds": seconds}},
            {"configMap": {"name": "kube-root-ca.crt",
                           "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
            {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {
                "apiVersion": "v1", "fieldPath": "metadata.namespace"}}]}},
        ]},
    }  # fmt: skip


def limit_args(limits: Limits) -> list[str]:
    """The broker's flags for the limits the spec sets (`--max-connections=100`, ...)."""
    given = limits.model_dump(exclude_none=True)
    return [f"{flag(name)}={value}" for name, value in sorted(given.items())]


def build_pod(
    cluster: ClusterRef,
    spec: BrokerClusterSpec,
    broker: BrokerName,
    token_seconds: int | None = None,
    peer_tls: PeerTlsPhase = "Plaintext",
) -> Obj:
    """A broker pod. It always starts passive: only the operator activates a broker.
    `token_seconds` (`broker_token_seconds`) replaces the automatic service-account token
    volume with one of that lifetime; `peer_tls` is the cluster's step towards mutual TLS
    between the brokers (`status.peerTls`, `operator/peertls.py`)."""
    secret = secret_name(cluster, spec)

    def from_secret(key: str, optional: bool = False) -> Obj:
        ref: Obj = {"name": secret, "key": key}
        if optional:
            ref["optional"] = True
        return {"valueFrom": {"secretKeyRef": ref}}

    meta = owned_meta(cluster, pod_name(cluster, broker), broker)
    meta["labels"][LABEL_ROLE] = PASSIVE
    sidecars = [build_shipper(spec)] if spec.audit.enabled and spec.audit.store_url else []
    pod_spec: Obj = {
        "serviceAccountName": f"{cluster.name}-broker",
        "hostname": pod_name(cluster, broker),
        "subdomain": f"{cluster.name}-brokers",
        "terminationGracePeriodSeconds": 15,
        "restartPolicy": "Always",
        "containers": [
            {
                "name": "broker",
                "image": spec.image,
                "imagePullPolicy": spec.image_pull_policy,
                "command": ["twinmq-broker"],
                "args": [
                    "--name=$(POD_NAME)",
                    f"--data-dir={DATA_DIR}/data",
                    f"--users-file={SECRET_DIR}/users.json",
                    f"--role={PASSIVE}",
                    f"--peer={peer_address(cluster, broker)}",
                    f"--replication-timeout={spec.replication.timeout_seconds}",
                    f"--dedup-window={spec.replication.dedup_window}",
                    # Nothing ships or reads a log no audit asks for: it would only
                    # fill the volume (and cost a sync per batch).
                    *(
                        [f"--audit-segment-seconds={spec.audit.segment_seconds}"]
                        if spec.audit.enabled
                        else ["--no-audit"]
                    ),
                    *federation.broker_args(
                        spec.federation, cluster.namespace, cluster.name, federation_amqps(spec)
                    ),
                    *limit_args(spec.limits),
                    *tls_args(spec),
                    *client_ca_args(spec),
                    *peer_tls_args(cluster, broker, peer_tls),
                ],
                "env": [
                    {
                        "name": "POD_NAME",
                        "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}},
                    },
                    {
                        "name": "POD_NAMESPACE",
                        "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}},
                    },
                    {"name": ADMIN_TOKEN_ENV, **from_secret("admin-token")},
                    # Read-only (monitoring); a user's own Secret may lack it.
                    {"name": ADMIN_READ_TOKEN_ENV, **from_secret("metrics-token", True)},
                    {"name": REPLICATION_TOKEN_ENV, **from_secret("replication-token")},
                    {"name": LEASE_NAME_ENV, "value": lease_name(cluster)},
                    {
                        "name": LEASE_SECONDS_ENV,
                        "value": str(spec.failover.lease_duration_seconds),
                    },
                    *mirroring.broker_env(spec.mirror, cluster.namespace, cluster.name),
                    *mirroring.tls_env(spec),
                ],
                "ports": [
                    {"name": "amqp", "containerPort": AMQP_PORT},
                    *amqps_ports(spec),
                    {"name": "admin", "containerPort": ADMIN_PORT},
                    {"name": "replication", "containerPort": REPLICATION_PORT},
                    *mirroring.container_ports(spec.mirror),
                ],
                "readinessProbe": health_probe(peer_tls, 2, 2),
                "livenessProbe": health_probe(peer_tls, 5, 6),
                "resources": spec.resources.model_dump(),
                "securityContext": CONTAINER_SECURITY,
                "volumeMounts": [
                    {"name": "data", "mountPath": DATA_DIR},
                    {"name": "auth", "mountPath": SECRET_DIR, "readOnly": True},
                    TMP_MOUNT,
                    *tls_mounts(spec),
                    *peer_tls_mounts(peer_tls),
                    *mirroring.tls_mounts(spec),
                    *client_ca_mounts(spec),
                    *federation.mounts(spec.federation, downstream_ca_mounted(spec)),
                ],
            },
            *sidecars,
        ],
        "securityContext": POD_SECURITY,
        "volumes": [
            {"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}},
            {"name": "data", "persistentVolumeClaim": {"claimName": pod_name(cluster, broker)}},
            {
                "name": "auth",
                "secret": {
                    "secretName": secret,
                    "items": [{"key": "users.json", "path": "users.json"}],
                },
            },
            *tls_volumes(cluster, spec),
            *peer_tls_volumes(cluster, broker, peer_tls),
            *mirroring.tls_volumes(spec, cluster.name),
            *client_ca_volumes(spec),
            *federation.volumes(spec.federation, cluster.name, downstream_ca_mounted(spec)),
        ],
    }
    if token_seconds is not None:
        pod_spec["automountServiceAccountToken"] = False
        pod_spec["volumes"].append(token_volume(token_seconds))
        pod_spec["containers"][0]["volumeMounts"].append(
            {"name": "kube-api-access", "mountPath": SERVICE_ACCOUNT_DIR, "readOnly": True}
        )
    pod_spec.update(build_placement(cluster, spec))
    extra = spec.pod_template.metadata
    extra_labels = (extra.labels if extra else None) or {}
    extra_annotations = (extra.annotations if extra else None) or {}
    # The broker reads its federation file at start-up only: a change of the file (in its
    # ConfigMap) must replace the pods, so its hash is part of the template.
    fed_hash = federation.config_hash(spec.federation, cluster.namespace)
    if fed_hash is not None:
        extra_annotations = {**extra_annotations, federation.CONFIG_HASH: fed_hash}
    # The operator dials the admin API as this says: never the user's to set.
    extra_annotations = {k: v for k, v in extra_annotations.items() if k != ADMIN_SCHEME}
    if peer_tls != "Plaintext":
        extra_annotations[ADMIN_SCHEME] = "https"
    # The operator's own labels win (the CRD refuses overrides of them already).
    meta["labels"] = {**extra_labels, **meta["labels"]}
    revision = template_hash(
        {"labels": extra_labels, "annotations": extra_annotations, "spec": pod_spec}
    )
    meta["annotations"] = {**extra_annotations, POD_TEMPLATE_HASH: revision}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec}


def build_placement(cluster: ClusterRef, spec: BrokerClusterSpec) -> Obj:
    """The scheduling fields of a broker pod: the brokers' anti-affinity (required or
    preferred, `spec.placement`) plus `spec.podTemplate`'s overrides. The user's pod
    anti-affinity terms are added to the brokers' own, never put in their place."""
    term = {"labelSelector": broker_selector(cluster),
            "topologyKey": spec.placement.topology_key}  # fmt: skip
    template = spec.pod_template
    user = dump(template.affinity) if template.affinity else {}
    required_key = "requiredDuringSchedulingIgnoredDuringExecution"
    preferred_key = "preferredDuringSchedulingIgnoredDuringExecution"
    anti: Obj = {k: list(v) for k, v in (user.pop("podAntiAffinity", None) or {}).items()}
    if spec.placement.anti_affinity == "required":
        anti[required_key] = [term, *anti.get(required_key, [])]
    else:
        anti[preferred_key] = [{"weight": 100, "podAffinityTerm": term},
                               *anti.get(preferred_key, [])]  # fmt: skip
    out: Obj = {"affinity": {**user, "podAntiAffinity": anti}}
    for name, value in (
        ("nodeSelector", template.node_selector),
        ("tolerations", template.tolerations),
        ("topologySpreadConstraints", template.topology_spread_constraints),
        ("imagePullSecrets", template.image_pull_secrets),
        ("priorityClassName", template.priority_class_name),
    ):
        if value is not None:
            out[name] = dump(value)
    return out


def dump(value: Any) -> Any:
    """A spec value as it goes into a Kubernetes object (wire names, unset fields left out)."""
    if isinstance(value, BaseModel):
        return value.model_dump(by_alias=True, exclude_none=True, mode="json")
    if isinstance(value, list):
        return [dump(v) for v in value]
    return value


def template_hash(template: Obj) -> str:
    """A short, stable hash of a pod template: a pod whose annotation differs is outdated."""
    canonical = json.dumps(template, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def pod_revision(pod: Obj | None) -> str | None:
    """The template hash a pod was created from (None: no pod; "" for a pod without one,
    made by an operator before rolling updates: outdated)."""
    if pod is None:
        return None
    return str(((pod.get("metadata") or {}).get("annotations") or {}).get(POD_TEMPLATE_HASH, ""))


def build_shipper(spec: BrokerClusterSpec) -> Obj:
    """The sidecar shipping the broker's closed audit segments to the store, as often as the
    broker closes them (a segment is written once, atomically; shipping is idempotent)."""
    assert spec.audit.store_url is not None
    container: Obj = {
        "name": "audit-ship",
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["twinmq-audit-ship"],
        "args": [
            f"--store={spec.audit.store_url}",
            f"--audit-dir={DATA_DIR}/data/audit",
            f"--every={spec.audit.segment_seconds}",
            f"--keep-shipped={spec.audit.keep_shipped_seconds}",
        ],
        "resources": {"requests": {"cpu": "20m", "memory": "96Mi"}},
        "securityContext": CONTAINER_SECURITY,
        # Read-write: the shipper keeps its ledger of shipped segments beside them.
        "volumeMounts": [{"name": "data", "mountPath": DATA_DIR}, TMP_MOUNT],
    }
    if spec.audit.store_secret_name:
        container["envFrom"] = [{"secretRef": {"name": spec.audit.store_secret_name}}]
    return container


def build_vip_service(
    cluster: ClusterRef, mirror: Mirror | None = None, amqps: bool = False
) -> Obj:
    """The virtual IP: it selects the pod labelled active, and only that one (a DR mirror
    replica's sources reach its active's mirror port there too; `amqps`: AMQPS on 5671)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": owned_meta(cluster, vip_name(cluster)),
        "spec": {
            "selector": {LABEL_CLUSTER: cluster.name, LABEL_ROLE: ACTIVE},
            "ports": [
                {"name": "amqp", "port": AMQP_PORT, "targetPort": "amqp"},
                *([{"name": "amqps", "port": AMQPS_PORT, "targetPort": "amqps"}] if amqps else []),
                *mirroring.service_ports(mirror),
            ],
        },
    }


def build_federation_config_map(cluster: ClusterRef, spec: BrokerClusterSpec) -> Obj | None:
    """The ConfigMap with the brokers' federation file (None without `spec.federation`)."""
    data = federation.config_map(spec.federation, cluster.namespace)
    if data is None:
        return None
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": owned_meta(cluster, federation.config_map_name(cluster.name)),
        "data": data,
    }


def build_headless_service(cluster: ClusterRef, amqps: bool = False) -> Obj:
    """Stable DNS names for both brokers (the passive replicates through it)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": owned_meta(cluster, f"{cluster.name}-brokers"),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {LABEL_CLUSTER: cluster.name},
            "ports": [
                {"name": "amqp", "port": AMQP_PORT},
                *([{"name": "amqps", "port": AMQPS_PORT}] if amqps else []),
                {"name": "admin", "port": ADMIN_PORT},
                {"name": "replication", "port": REPLICATION_PORT},
            ],
        },
    }


def build_disruption_budget(cluster: ClusterRef) -> Obj:
    """The brokers' PodDisruptionBudget: a voluntary eviction (`kubectl drain`) never takes
    the last ready broker. `minAvailable: 1`, not `maxUnavailable: 1` (the same over two
    pods): Kubernetes allows only an integer minAvailable for pods whose controller has no
    scale subresource. An unready broker may always be evicted: it serves nothing. The
    operator's own pod deletions (a rollout) are not evictions: it does not block them."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": owned_meta(cluster, cluster.name),
        "spec": {
            "minAvailable": 1,
            "selector": broker_selector(cluster),
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def build_broker_rbac(cluster: ClusterRef) -> list[Obj]:
    """The brokers' ServiceAccount, allowed to read and renew their own Lease only."""
    account = f"{cluster.name}-broker"
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": owned_meta(cluster, account)},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": owned_meta(cluster, account),
            "rules": [
                {
                    "apiGroups": ["coordination.k8s.io"],
                    "resources": ["leases"],
                    "resourceNames": [lease_name(cluster)],
                    "verbs": ["get", "update", "patch"],
                }
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": owned_meta(cluster, account),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": account},
            "subjects": [
                {"kind": "ServiceAccount", "name": account, "namespace": cluster.namespace}
            ],
        },
    ]


def build_lease(cluster: ClusterRef, holder: str, duration: int, renew_time: str) -> Obj:
    """The active role's Lease, held by the active broker's pod."""
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": owned_meta(cluster, lease_name(cluster)),
        "spec": {
            "holderIdentity": holder,
            "leaseDurationSeconds": duration,
            "acquireTime": renew_time,
            "renewTime": renew_time,
        },
    }
