"""`kubectl twinmq`: the BrokerClusters' status, and manual operations as declared requests.

    kubectl twinmq status [CLUSTER] [-n NS | -A] [-o table|json]
    kubectl twinmq promote CLUSTER BROKER [--force] [--wait [--timeout S]]
    kubectl twinmq recover CLUSTER [--wait]
    kubectl twinmq fence CLUSTER BROKER [--wait]
    kubectl twinmq unfence CLUSTER BROKER [--wait]
    kubectl twinmq audit CLUSTER [--sites] [--wait]
    kubectl twinmq rotate-ca CLUSTER [--wait]
    kubectl twinmq federation status [CLUSTER] [-n NS | -A] [-o table|json]
    kubectl twinmq federation trust CLUSTER --from-context CTX --from-namespace NS
        --from-cluster NAME [--upstream NAME]
    kubectl twinmq mirror trust SITE --from-context CTX --from-namespace NS --from-cluster NAME

Every operation is a JSON merge patch of `spec.requests.<op>` carrying a fresh id
(`<op>-<UTC time>-<4 hex>`): the same mechanism a GitOps pipeline uses, handled once by the
operator, which records the id in `status.handledRequests.<op>`. `--wait` polls the
cluster until that happens and prints the outcome. docs/kubectl-plugin.md lists the RBAC
each command needs.

Exit codes: 0 done; 1 error or the operator refused the request; 2 usage;
3 `--wait` timed out (the request stays declared and is handled once the operator gets
to it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, NoReturn

from twinmq.broker.names import ACTIVE, MIRROR_PORT
from twinmq.operator.models import GROUP, PLURAL, VERSION
from twinmq.operator.ownership import Owner, foreign_reason

Obj = dict[str, Any]
BROKERS = ("primary", "backup")
OPERATIONS = ("promote", "recover", "fence", "unfence", "audit", "rotate-ca")
EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_TIMEOUT = 0, 1, 2, 3
DEFAULT_TIMEOUT = {
    "promote": 120.0, "recover": 300.0, "fence": 120.0, "audit": 1800.0, "rotateCa": 120.0,
}  # fmt: skip
RESOURCE = f"{PLURAL}.{GROUP}"


class PluginError(Exception):
    """A failure to report in one line (exit code 1); `status` is the API's HTTP status."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


# -- arguments ---------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The command line: one sub-command per operation, each with its own `--help`."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "-n", "--namespace", help="the namespace (default: the kubeconfig context's, else default)"
    )
    common.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG, ~/.kube)")
    common.add_argument("--context", help="kubeconfig context (default: the current one)")

    waiting = argparse.ArgumentParser(add_help=False)
    waiting.add_argument(
        "--wait", action="store_true", help="wait until the operator has handled the request"
    )
    waiting.add_argument(
        "--timeout", type=float, metavar="SECONDS", help="how long --wait waits (default: per op)"
    )

    parser = argparse.ArgumentParser(
        prog="kubectl twinmq",
        description="Status of TwinMQ BrokerClusters and manual operations on them. Each "
        "operation declares a request with a fresh id in spec.requests; the operator handles "
        "each id once.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    status = sub.add_parser(
        "status", parents=[common], help="show the brokers of one or all clusters",
        description="A table of each broker: role, epoch, ready, reachable, lag, the "
        "cluster's phase, last failover and last audit.",
    )  # fmt: skip
    status.add_argument("cluster", nargs="?", metavar="CLUSTER", help="one cluster (default: all)")
    status.add_argument(
        "-A", "--all-namespaces", action="store_true", help="clusters in every namespace"
    )
    status.add_argument(
        "-o", "--output", choices=("table", "json"), default="table", help="output format"
    )

    def cluster_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument("cluster", metavar="CLUSTER", help="the BrokerCluster's name")

    def broker_arg(p: argparse.ArgumentParser, what: str) -> None:
        p.add_argument("broker", metavar="BROKER", choices=BROKERS, help=f"{what}: primary|backup")

    promote = sub.add_parser(
        "promote", parents=[common, waiting], help="switch the active role to a broker",
        description="Switchover: the active broker is demoted, and BROKER is activated once "
        "the old one reports passive. The operator refuses a target that is not in sync, "
        "or whose journal is damaged, unless --force (which may lose confirmed messages).",
    )  # fmt: skip
    cluster_arg(promote)
    broker_arg(promote, "the broker to activate")
    promote.add_argument(
        "--force",
        action="store_true",
        help="promote even if BROKER is not in sync or its journal is damaged (data loss)",
    )

    recover = sub.add_parser(
        "recover", parents=[common, waiting], help="fail back to the primary",
        description="Recovery: demote the active backup, wait until it reports passive, then "
        "activate the primary. The operator waits until the primary has caught up.",
    )  # fmt: skip
    cluster_arg(recover)

    fence = sub.add_parser(
        "fence", parents=[common, waiting], help="stop a broker from serving",
        description="Fence BROKER: it stops serving clients until unfenced.",
    )  # fmt: skip
    cluster_arg(fence)
    broker_arg(fence, "the broker to fence")

    unfence = sub.add_parser(
        "unfence", parents=[common, waiting], help="let a fenced broker serve again",
        description="Unfence BROKER.",
    )  # fmt: skip
    cluster_arg(unfence)
    broker_arg(unfence, "the broker to unfence")

    mirror = sub.add_parser(
        "mirror", help="the DR mirror between BrokerClusters",
        description="The DR mirror (spec.mirror) of BrokerClusters.",
    )  # fmt: skip
    mirror_sub = mirror.add_subparsers(dest="mirror_command", required=True, metavar="COMMAND")
    mirror_status = mirror_sub.add_parser(
        "status", parents=[common], help="each mirrored cluster's DR role and link",
        description="One row per BrokerCluster with spec.mirror (a full mesh, "
        "spec.mirror.targets: one row per target, with that target's link, backlog and lag): "
        "its DR role and epoch now, the "
        "link's state (a bidirectional site's outgoing one; INBOUND: its incoming one), the "
        "target, the backlog of events not yet acknowledged by the mirror, "
        "the age of the oldest (LAG), the sources linked to a replica, and why a link is "
        "down. Under the table, one line per cluster a forced failover left something on: "
        "the loss its old source counted once back (status.mirror.unmirrored: messages and "
        "settles the promoted site never got, and messages kept unverified) and the messages "
        "kept in its orphan queue. With -A, both sites when they run in one Kubernetes "
        "cluster.",
    )  # fmt: skip
    mirror_status.add_argument(
        "cluster", nargs="?", metavar="CLUSTER", help="one cluster (default: all)"
    )
    mirror_status.add_argument(
        "-A", "--all-namespaces", action="store_true", help="clusters in every namespace"
    )
    mirror_status.add_argument(
        "-o", "--output", choices=("table", "json"), default="table", help="output format"
    )

    switchover = mirror_sub.add_parser(
        "switchover", parents=[common], help="make the replica site the source, losing nothing",
        description="A controlled DR switchover: declare mirrorDemote on SOURCE (it stops "
        "taking writes and drains every event to the mirror), wait for its demotion token, "
        "then declare mirrorPromote with that token on REPLICA (it becomes the source once "
        "it has applied the source's last event). Each half is a request the operators "
        "handle once.",
    )  # fmt: skip
    switchover.add_argument("cluster", metavar="SOURCE", help="the source BrokerCluster")
    switchover.add_argument(
        "replica", metavar="[NAMESPACE/]REPLICA",
        help="the replica BrokerCluster (in the source's namespace unless given)",
    )  # fmt: skip
    switchover.add_argument(
        "--replica-context", help="kubeconfig context of the replica's site (default: the same)"
    )
    switchover.add_argument(
        "--timeout", type=float, default=300.0, metavar="SECONDS", help="for each half"
    )
    failover = mirror_sub.add_parser(
        "failover", parents=[common], help="promote the replica site: the source site is gone",
        description="A DR failover: declare mirrorPromote with force on REPLICA. It becomes "
        "the source at once; the events the source had not mirrored are lost to it and the "
        "operator reports them (its RPO) in status.mirror.lastSwitch and an Event.",
    )  # fmt: skip
    failover.add_argument("cluster", metavar="REPLICA", help="the replica BrokerCluster")
    reseed = mirror_sub.add_parser(
        "reseed", parents=[common], help="seed the mirror again from the source site",
        description="Declare mirrorReseed on SOURCE: its mirror is rebuilt from a new snapshot "
        "(the way out of NeedsResync). What the mirror holds and the source does not is moved "
        "to the mirror's orphan queue (amq.twinmq.mirror-orphans), never discarded.",
    )  # fmt: skip
    reseed.add_argument("cluster", metavar="SOURCE", help="the source BrokerCluster")
    failback = mirror_sub.add_parser(
        "failback", parents=[common], help="make SITE the source again (after a switchover "
        "or a forced failover)",
        description="A DR failback in one command: declare mirrorFailback on the site that is "
        "the source now (by default the cluster SITE's spec.mirror.target names, as "
        "<name>.<namespace>.svc). Its operator waits until SITE is re-attached as its replica "
        "(after a forced failover SITE fences itself, is re-seeded, and keeps what only it "
        "held in its orphan queue) and in sync, then demotes it; the plugin declares "
        "mirrorPromote on SITE with the demotion token and waits until SITE's link is back. "
        "The phases are printed as they change (status.mirror.failback). Both sites are "
        "never writable at once.",
    )  # fmt: skip
    failback.add_argument("cluster", metavar="SITE", help="the BrokerCluster to make the source")
    failback.add_argument(
        "source", nargs="?", metavar="[NAMESPACE/]SOURCE",
        help="the source BrokerCluster now (default: from SITE's spec.mirror.target.host)",
    )  # fmt: skip
    failback.add_argument(
        "--source-context", help="kubeconfig context of the source's site (default: the same)"
    )
    failback.add_argument(
        "--timeout", type=float, default=600.0, metavar="SECONDS",
        help="for the re-attachment and sync, then for the promotion",
    )  # fmt: skip
    trust = mirror_sub.add_parser(
        "trust", parents=[common], help="copy the other site's CA here (mutual TLS on the link)",
        description="Read the other site's published CA (ConfigMap <from-cluster>-ca, key "
        "ca.crt) through another kubeconfig context, write it into the ConfigMap "
        "<SITE>-mirror-trust in SITE's namespace and set SITE's spec.mirror.tls.caConfigMap "
        "to it: SITE's link then runs over mutual TLS (its pods roll once). For sites in "
        "two Kubernetes clusters, where the operator cannot copy it itself; run it on both "
        "sites (the other one with --from-context naming this one). Idempotent: run it "
        "again after the other site's CA was rotated. Prints what it did.",
    )  # fmt: skip
    trust.add_argument("cluster", metavar="SITE", help="the BrokerCluster here that trusts")
    trust.add_argument(
        "--from-context", help="kubeconfig context of the other site (default: the same)"
    )
    trust.add_argument(
        "--from-namespace", help="the other site's namespace (default: the context's)"
    )
    trust.add_argument(
        "--from-cluster", required=True, help="the other site's BrokerCluster (its name)"
    )
    for one_request in (failover, reseed):
        one_request.add_argument(
            "--timeout", type=float, default=120.0, metavar="SECONDS", help="how long to wait"
        )

    audit = sub.add_parser(
        "audit", parents=[common, waiting], help="run a replication audit now",
        description="Request a replication audit now; with --wait, print its verdict.",
    )  # fmt: skip
    cluster_arg(audit)
    audit.add_argument(
        "--sites", action="store_true",
        help="audit this DR site against the other (spec.audit.mirrorStoreUrl) instead of "
        "the pair",
    )  # fmt: skip

    rotate = sub.add_parser(
        "rotate-ca", parents=[common, waiting], help="rotate the operator-managed CA",
        description="Rotate the operator-managed CA: a new CA is published beside the old "
        "one, signs every certificate after the operator's grace period, and the old one "
        "leaves the bundle after another (status.caRotation). --wait returns once the "
        "rotation has started.",
    )  # fmt: skip
    cluster_arg(rotate)

    fed = sub.add_parser(
        "federation", help="exchange federation between BrokerClusters",
        description="Exchange federation (spec.federation) of BrokerClusters.",
    )  # fmt: skip
    fed_sub = fed.add_subparsers(dest="federation_command", required=True, metavar="COMMAND")
    fed_status = fed_sub.add_parser(
        "status", parents=[common], help="each federated exchange's link",
        description="One row per federated exchange of each BrokerCluster with "
        "spec.federation (a cluster that is only an upstream: one row without a link): its "
        "server id, the exchange's vhost (a VHOST column, shown when a link is in a vhost "
        "other than /), the upstream, the link's state (Running only after a verified round "
        "trip; Refused: a duplicate server id), the normalised bindings held upstream and "
        "the local bindings they stand for, the messages received, the messages "
        "forwarded upstream (forward: true), the duplicates and loops dropped, and why a "
        "link is down (or that another BrokerCluster announced the same server id first).",
    )  # fmt: skip
    fed_status.add_argument(
        "cluster", nargs="?", metavar="CLUSTER", help="one cluster (default: all)"
    )
    fed_trust = fed_sub.add_parser(
        "trust", parents=[common],
        help="TLS between a downstream here and its upstream in another Kubernetes cluster",
        description="For a downstream CLUSTER here whose upstream is a BrokerCluster of "
        "another Kubernetes cluster (reached through --from-context), where the operator "
        "cannot copy the CAs itself: copy the upstream's published CA (ConfigMap "
        "<from-cluster>-ca, key ca.crt) into the ConfigMap <CLUSTER>-federation-trust here "
        "(key <upstream>.crt) and set that upstream's spec.federation.upstreams[].tls "
        "(caConfigMap, and clientSecret <CLUSTER>-federation-tls, issued by CLUSTER's CA, "
        "when none is named); and add CLUSTER's CA (ConfigMap <CLUSTER>-ca) to the bundle "
        "<from-cluster>-federation-downstream-trust in the upstream's namespace (keeping "
        "the CAs its current bundle holds) and set the upstream's "
        "spec.federation.downstreamCaConfigMap to it. Both clusters' pods roll once. The "
        "upstream entry needs an amqps:// uri. Idempotent: run it again after either CA was "
        "rotated (a replaced downstream CA stays in the bundle until removed by hand). "
        "Prints what it did.",
    )  # fmt: skip
    fed_trust.add_argument("cluster", metavar="CLUSTER", help="the downstream BrokerCluster here")
    fed_trust.add_argument(
        "--from-context", help="kubeconfig context of the upstream's cluster (default: the same)"
    )
    fed_trust.add_argument(
        "--from-namespace", help="the upstream's namespace (default: the context's)"
    )
    fed_trust.add_argument(
        "--from-cluster", required=True, help="the upstream BrokerCluster (its name)"
    )
    fed_trust.add_argument(
        "--upstream", metavar="NAME",
        help="the entry of CLUSTER's spec.federation.upstreams that is it (default: the only "
        "one, else the one named as --from-cluster)",
    )  # fmt: skip
    fed_status.add_argument(
        "-A", "--all-namespaces", action="store_true", help="clusters in every namespace"
    )
    fed_status.add_argument(
        "-o", "--output", choices=("table", "json"), default="table", help="output format"
    )
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line (exits 2 with a usage message on errors)."""
    args = build_parser().parse_args(argv)
    if getattr(args, "all_namespaces", False) and args.namespace:
        build_parser().error(f"{args.command}: use either --namespace or --all-namespaces")
    if getattr(args, "timeout", None) is not None and args.timeout <= 0:
        build_parser().error("--timeout must be positive")
    return args


# -- requests (pure) ---------------------------------------------------------------------


def request_field(command: str) -> str:
    """The `spec.requests` field a command writes (unfence is a fence request)."""
    return {"unfence": "fence", "rotate-ca": "rotateCa"}.get(command, command)


def new_request_id(command: str, now: datetime | None = None, suffix: str | None = None) -> str:
    """A fresh request id: `<op>-<UTC yyyymmddThhmmssZ>-<4 hex>` (at most 63 characters)."""
    stamp = (now or datetime.now(UTC)).strftime("%Y%m%dT%H%M%SZ")
    return f"{request_field(command)}-{stamp}-{suffix or secrets.token_hex(2)}"


def request_patch(
    command: str,
    request_id: str,
    broker: str | None = None,
    force: bool = False,
    sites: bool = False,
) -> Obj:
    """The merge patch declaring the request. Every field of the request is written, so a
    field of an older request (a `force: true`) never survives into the new one."""
    request: Obj = {"id": request_id}
    if command == "promote":
        request |= {"broker": broker, "force": force}
    elif command in ("fence", "unfence"):
        request |= {"broker": broker, "fenced": command == "fence"}
    elif command == "audit":
        request |= {"sites": sites}
    elif command not in ("recover", "rotate-ca"):
        raise ValueError(f"not a request: {command}")
    return {"spec": {"requests": {request_field(command): request}}}


def pending_request(cluster: Mapping[str, Any], command: str) -> str | None:
    """The id of a declared request of this kind the operator has not handled yet."""
    field = request_field(command)
    declared = ((cluster.get("spec") or {}).get("requests") or {}).get(field) or {}
    handled = ((cluster.get("status") or {}).get("handledRequests") or {}).get(field)
    declared_id = declared.get("id")
    return str(declared_id) if declared_id and declared_id != handled else None


def handled(cluster: Mapping[str, Any], command: str, request_id: str) -> bool:
    """Whether the operator has handled the request `request_id`."""
    done = ((cluster.get("status") or {}).get("handledRequests") or {}).get(request_field(command))
    return bool(done == request_id)


def broker_status(cluster: Mapping[str, Any], broker: str) -> Obj:
    """The status entry of one broker ({} when not reported)."""
    for entry in (cluster.get("status") or {}).get("brokers") or []:
        if entry.get("name") == broker:
            return dict(entry)
    return {}


def outcome(
    cluster: Mapping[str, Any],
    command: str,
    broker: str | None,
    request_id: str,
    events: Sequence[Mapping[str, Any]] = (),
) -> tuple[bool, str]:
    """(succeeded, message) once the request is handled: the state it aimed at, else the
    operator's Event about the request (it names the request id)."""
    status = cluster.get("status") or {}
    active, epoch = status.get("activeBroker"), status.get("epoch")
    said = next(
        (str(e.get("message")) for e in reversed(events) if request_id in str(e.get("message"))),
        None,
    )
    if command in ("promote", "recover"):
        target = broker if command == "promote" else "primary"
        if active == target:
            return True, f"{target} is active in epoch {epoch}" + (f" ({said})" if said else "")
        return False, f"{target} was not activated: {said or f'{active} is active'}"
    if command in ("fence", "unfence"):
        fenced = bool(broker_status(cluster, broker or "").get("fenced"))
        if fenced == (command == "fence"):
            return True, f"{broker} is {'fenced' if fenced else 'not fenced'}"
        return False, f"{broker} is {'fenced' if fenced else 'not fenced'}" + (
            f": {said}" if said else ""
        )
    if command == "rotate-ca":
        rotation = status.get("caRotation") or {}
        text = (f"CA rotation {rotation.get('phase', '?')} since {rotation.get('since', '?')}; "
                f"next step at {rotation.get('nextStepAt') or '-'}")  # fmt: skip
        if rotation.get("waiting"):  # time alone does not move it: a pod has not loaded
            text += f"; waiting: {rotation['waiting']}"
        return True, text
    if said:  # the operator refused the request (audits not enabled)
        return False, said
    last = status.get("lastAudit") or {}
    verdict = last.get("verdict", "unknown")
    detail = f"audit {verdict}" + (f" (run {last['run']})" if last.get("run") else "")
    if last.get("message"):
        detail += f": {last['message']}"
    return verdict == "PASS", detail


def audit_running(cluster: Mapping[str, Any]) -> bool:
    """Whether the last audit run is still going (a requested run is waited for)."""
    last = (cluster.get("status") or {}).get("lastAudit") or {}
    return bool(last.get("verdict") == "RUNNING")


# -- the status table (pure) --------------------------------------------------------------

COLUMNS = (
    "CLUSTER", "BROKER", "ROLE", "EPOCH", "READY", "REACHABLE", "LAG", "PHASE",
    "LAST-FAILOVER", "LAST-AUDIT",
)  # fmt: skip
MIRROR_COLUMNS = (
    "CLUSTER", "DR-ROLE", "STATE", "INBOUND", "DR-EPOCH", "TARGET", "BACKLOG", "LAG", "SOURCES",
    "TLS", "MESSAGE",
)  # fmt: skip
FEDERATION_COLUMNS = (
    "CLUSTER", "SERVER-ID", "EXCHANGE", "UPSTREAM", "STATE", "BINDINGS", "RECEIVED",
    "FORWARDED", "DUPLICATES", "LOOPS", "PEER-STATUS", "MESSAGE",
)  # fmt: skip


def parse_time(value: str | None) -> datetime | None:
    """An RFC 3339 timestamp from the status, or None."""
    if not value:
        return None
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def age(value: str | None, now: datetime) -> str:
    """kubectl-style age of a timestamp: 45s, 3m10s, 2h5m, 4d3h ('?' when unparseable)."""
    then = parse_time(value)
    if then is None:
        return "?"
    seconds = max(0, int((now - then).total_seconds()))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60}s"
    if seconds < 86400:
        return f"{seconds // 3600}h{seconds % 3600 // 60}m"
    return f"{seconds // 86400}d{seconds % 86400 // 3600}h"


def last_failover_text(status: Mapping[str, Any], now: datetime) -> str:
    """`primary->backup 3m10s ago`, or `-`."""
    last = status.get("lastFailover")
    if not last:
        return "-"
    return f"{last.get('from')}->{last.get('to')} {age(last.get('time'), now)} ago"


def last_audit_text(status: Mapping[str, Any], now: datetime) -> str:
    """`PASS 5m0s ago`, or `-`."""
    last = status.get("lastAudit")
    if not last:
        return "-"
    return f"{last.get('verdict')} {age(last.get('time'), now)} ago"


def lag_text(broker: Mapping[str, Any]) -> str:
    """A passive's lag: messages, and seconds when known."""
    messages = int(broker.get("lagMessages") or 0)
    seconds = float(broker.get("lagSeconds") or 0.0)
    return f"{messages} ({seconds:.1f}s)" if seconds else str(messages)


def status_rows(
    clusters: Sequence[Mapping[str, Any]], now: datetime, with_namespace: bool = False
) -> list[tuple[str, ...]]:
    """One row per broker of each cluster (one row for a cluster with no broker status yet),
    in the order of `COLUMNS`, prefixed with the namespace when `with_namespace`.

    ROLE is what the broker reports; READY is a passive's readiness to be promoted (it holds
    every confirmed message), `-` for the active; LAG is a passive's backlog."""
    rows: list[tuple[str, ...]] = []
    for cluster in clusters:
        meta = cluster.get("metadata") or {}
        first = (str(meta.get("namespace", "")),) if with_namespace else ()
        name = str(meta.get("name", "?"))
        status = cluster.get("status") or {}
        common = (
            str(status.get("phase") or "Pending"),
            last_failover_text(status, now),
            last_audit_text(status, now),
        )
        brokers = status.get("brokers") or []
        if not brokers:
            rows.append((*first, name, "-", "-", "-", "-", "-", "-", *common))
            continue
        order = {b: i for i, b in enumerate(BROKERS)}
        for broker in sorted(brokers, key=lambda b: order.get(str(b.get("name")), 9)):
            role = str(broker.get("role") or "unknown")
            if broker.get("fenced"):
                role += " (fenced)"
            if broker.get("damaged"):
                role += " (damaged)"  # its journal: status.brokers[].damage says more
            rows.append((
                *first, name, str(broker.get("name")), role, str(broker.get("epoch", 0)),
                "-" if broker.get("role") == ACTIVE else "yes" if broker.get("ready") else "no",
                "yes" if broker.get("reachable") else "no",
                lag_text(broker), *common,
            ))  # fmt: skip
    return rows


def mirror_rows(
    clusters: Sequence[Mapping[str, Any]], with_namespace: bool = False
) -> list[tuple[str, ...]]:
    """One row per cluster with a `spec.mirror` (a full mesh: one per target), in the order
    of `MIRROR_COLUMNS`: its DR role and link as its active broker last reported them
    (status.mirror)."""
    rows: list[tuple[str, ...]] = []
    for cluster in clusters:
        mirror = (cluster.get("spec") or {}).get("mirror")
        if not mirror:
            continue
        meta = cluster.get("metadata") or {}
        first = (str(meta.get("namespace", "")),) if with_namespace else ()
        state = (cluster.get("status") or {}).get("mirror") or {}
        if mirror.get("targets"):
            rows += mesh_rows(first, str(meta.get("name", "?")), cluster, mirror, state)
            continue
        target = (mirror.get("target") or {}).get("host")
        if target:
            target = f"{target}:{(mirror.get('target') or {}).get('port', MIRROR_PORT)}"
        rows.append((
            *first, str(meta.get("name", "?")),
            str(state.get("role") or mirror.get("role") or "-"),
            str(state.get("state") or "Unknown"),
            # A bidirectional site's incoming direction (a one-way site's is its STATE).
            str(state.get("inbound") or ("Unknown" if mirror.get("role") == "bidirectional"
                                         else "-")),
            str(state.get("epoch", "-")),
            str(target or state.get("target") or "-"),
            str(state.get("queueEvents", "-")),
            f"{float(state.get('lagSeconds') or 0.0):.1f}s" if state else "-",
            str(state.get("sourcesConnected", "-")),
            tls_text(cluster, state),
            failback_text(state) or str(state.get("message") or ""),
        ))  # fmt: skip
    return rows


def mesh_rows(
    first: tuple[str, ...],
    name: str,
    cluster: Mapping[str, Any],
    mirror: Mapping[str, Any],
    state: Mapping[str, Any],
) -> list[tuple[str, ...]]:
    """A full-mesh site's rows: one per target (`spec.mirror.targets`), each with that
    target's link, backlog and lag (`status.mirror.targets[]`; Unknown before the active
    reported it); the site's role, inbound direction, epoch and TLS on every row."""
    seen = {str(t.get("target")): t for t in state.get("targets") or []}
    rows: list[tuple[str, ...]] = []
    for target in mirror.get("targets") or []:
        address = f"{target.get('host')}:{target.get('port', MIRROR_PORT)}"
        link = seen.get(address) or {}
        rows.append((
            *first, name,
            str(state.get("role") or mirror.get("role") or "-"),
            str(link.get("state") or "Unknown"),
            str(state.get("inbound") or "Unknown"),
            str(state.get("epoch", "-")),
            address,
            str(link.get("queueEvents", "-")),
            f"{float(link.get('lagSeconds') or 0.0):.1f}s" if link else "-",
            str(state.get("sourcesConnected", "-")),
            tls_text(cluster, state),
            str(link.get("message") or "") or failback_text(state),
        ))  # fmt: skip
    return rows


def tls_text(cluster: Mapping[str, Any], state: Mapping[str, Any]) -> str:
    """The TLS column: `yes` when the active reports the link over mutual TLS; else the
    `MirrorTls` condition's reason when it keeps the link plaintext (`PeerCAUnknown`:
    `kubectl twinmq mirror trust`), `pending` while the pods are not there yet."""
    if state.get("tls"):
        return "yes"
    conditions = (cluster.get("status") or {}).get("conditions") or []
    why = next((c for c in conditions if c.get("type") == "MirrorTls"), None)
    if why is None:
        return "-"
    return "pending" if why.get("status") == "True" else str(why.get("reason") or "no")


def failback_text(state: Mapping[str, Any]) -> str:
    """A failback in progress on this site, for the MESSAGE column ("" when none is)."""
    fb = state.get("failback") or {}
    phase = fb.get("phase")
    if phase not in ("Reattaching", "Syncing", "Demoting", "Promoting"):
        return ""
    return f"failback {phase}: {fb.get('message', '')}"


def forced_failover_notes(
    clusters: Sequence[Mapping[str, Any]], with_namespace: bool = False
) -> list[str]:
    """One line per mirrored cluster that holds what a forced failover left behind, printed
    under the table: the loss its old source counted once back (`status.mirror.unmirrored`:
    messages and settles the promoted site never got, and the messages it claims to hold
    that the promoted site's seed did not show, kept here unverified) and the messages kept
    in its orphan queue; on a site promoted by force, a seed not durable yet (clients are
    refused until it is: `status.mirror.seedPending`). Too long for a column, and what an
    operator acts on after a forced failover (docs/mirror.md, "The RPO as a count"), so not
    left to `-o json` alone."""
    lines: list[str] = []
    for cluster in clusters:
        if not (cluster.get("spec") or {}).get("mirror"):
            continue
        state = (cluster.get("status") or {}).get("mirror") or {}
        pending = str(state.get("seedPending") or "")
        parts = [
            p
            for p in (
                f"clients refused: {pending}" if pending else "",
                str(state.get("unmirrored") or ""),
                orphans_text(state),
            )
            if p
        ]
        if not parts:
            continue
        meta = cluster.get("metadata") or {}
        name = str(meta.get("name", "?"))
        if with_namespace:
            name = f"{meta.get('namespace', '')}/{name}"
        lines.append(f"{name}: {'; '.join(parts)}")
    return lines


def orphans_text(state: Mapping[str, Any]) -> str:
    """Messages a seed moved to this site's orphan queue (after a forced failover: what only
    the old source held), for the MESSAGE column ("" when none)."""
    count = int(state.get("orphans") or 0)
    return f"{count} orphaned messages kept in amq.twinmq.mirror-orphans" if count else ""


def federation_links(cluster: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """A federated cluster's links: as its active reported them (`status.federation.links`,
    keyed by exchange and vhost), else as its spec declares them (not seen yet)."""
    spec = (cluster.get("spec") or {}).get("federation") or {}
    state = (cluster.get("status") or {}).get("federation") or {}
    return list(state.get("links") or [
        {"exchange": e.get("exchange"), "vhost": e.get("vhost") or "/",
         "upstream": e.get("upstream")}
        for e in spec.get("exchanges") or []
    ])  # fmt: skip


def federation_columns(clusters: Sequence[Mapping[str, Any]]) -> tuple[str, ...]:
    """`FEDERATION_COLUMNS`, with VHOST after EXCHANGE when a link of these clusters is in
    a vhost other than `/` (two vhosts' exchanges of one name are two links; a `/`-only
    listing keeps its columns)."""
    if not any_vhost(clusters):
        return FEDERATION_COLUMNS
    at = FEDERATION_COLUMNS.index("EXCHANGE") + 1
    return (*FEDERATION_COLUMNS[:at], "VHOST", *FEDERATION_COLUMNS[at:])


def any_vhost(clusters: Sequence[Mapping[str, Any]]) -> bool:
    """Whether a federated link of these clusters is in a vhost other than `/`."""
    return any(
        (link.get("vhost") or "/") != "/"
        for c in clusters
        if (c.get("spec") or {}).get("federation") is not None
        for link in federation_links(c)
    )


def federation_rows(
    clusters: Sequence[Mapping[str, Any]], with_namespace: bool = False
) -> list[tuple[str, ...]]:
    """One row per federated exchange of each cluster with a `spec.federation`, in the order
    of `federation_columns` (status.federation; one row without a link for a cluster that
    federates nothing itself: an upstream only). The VHOST cell only when that has it."""
    vhosts = any_vhost(clusters)
    rows: list[tuple[str, ...]] = []
    for cluster in clusters:
        spec = (cluster.get("spec") or {}).get("federation")
        if spec is None:
            continue
        meta = cluster.get("metadata") or {}
        first = (str(meta.get("namespace", "")),) if with_namespace else ()
        state = (cluster.get("status") or {}).get("federation") or {}
        server = str(state.get("serverId") or spec.get("serverId")
                     or f"{meta.get('namespace')}.{meta.get('name')}")  # fmt: skip
        links = federation_links(cluster)
        refused = state.get("refusedPeers") or []
        # Another cluster announced this server id first: said on every row, it is the
        # cause of whatever the links show.
        duplicate = state.get("duplicateOf") or ""
        clash = f"duplicate server id: also {duplicate}" if duplicate else ""
        # The cluster's amq.peer (as an upstream): its downstreams' status messages
        # published there / dropped; the cluster's, so on each of its rows.
        peer = (f"{state.get('peerStatusReceived', 0)}/{state.get('peerStatusDropped', 0)}"
                if state else "-")  # fmt: skip
        if not links:
            note = f"refused: {refused[-1]}" if refused else "upstream only"
            rows.append((*first, str(meta.get("name", "?")), server, "-", *(("-",) * vhosts),
                         "-", "-", "-", "-", "-", "-", "-", peer, clash or note))  # fmt: skip
        for link in links:
            vhost = (str(link.get("vhost") or "/"),) if vhosts else ()
            rows.append((
                *first, str(meta.get("name", "?")), server, str(link.get("exchange", "?")),
                *vhost, str(link.get("upstream", "?")), str(link.get("state") or "Unknown"),
                f"{link.get('bindings', '-')}/{link.get('localBindings', '-')}",
                str(link.get("messagesReceived", "-")), str(link.get("forwarded", "-")),
                str(link.get("duplicatesDropped", "-")), str(link.get("loopsDropped", "-")),
                peer, clash or str(link.get("message") or ""),
            ))  # fmt: skip
    return rows


def render_table(
    rows: Sequence[Sequence[str]],
    with_namespace: bool = False,
    columns: Sequence[str] = COLUMNS,
) -> str:
    """Left-aligned columns separated by three spaces, as kubectl prints them."""
    header = ("NAMESPACE", *columns) if with_namespace else tuple(columns)
    table = [tuple(header), *(tuple(row) for row in rows)]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = ["   ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
             for row in table]  # fmt: skip
    return "\n".join(lines) + "\n"


# -- the Kubernetes side -----------------------------------------------------------------


def describe_api_error(exc: Exception, verb: str, namespace: str | None, name: str | None) -> str:
    """A one-line explanation of an API error, naming the verb and resource on 403."""
    status = getattr(exc, "status", None)
    where = f' in namespace "{namespace}"' if namespace else " in any namespace"
    if status == 404:
        body = str(getattr(exc, "body", None) or "")
        if name and "could not find the requested resource" not in body:
            return f'{RESOURCE} "{name}" not found{where}'
        return f"the {RESOURCE} CRD is not installed (the Helm chart installs it)"
    if status == 403:
        body = getattr(exc, "body", None) or ""
        try:
            detail = json.loads(body).get("message", "")
        except (ValueError, AttributeError):
            detail = ""
        return (
            f"permission denied: you cannot {verb} {RESOURCE}{where} "
            f"(RBAC: grant verb {verb!r} on resource {PLURAL!r} in API group {GROUP!r}; "
            "see docs/kubectl-plugin.md)" + (f"; the API server said: {detail}" if detail else "")
        )
    if status == 401:
        return "unauthorized: the kubeconfig's credentials were refused"
    if status == 422:
        return f"the API server refused the request: {getattr(exc, 'body', exc)}"
    return f"{verb} {RESOURCE} failed: {exc}"


@dataclass
class Kube:
    """The few API calls the plugin makes (BrokerClusters get/list/patch, Events list)."""

    api: Any
    custom: Any
    core: Any
    default_namespace: str

    @classmethod
    def connect(cls, kubeconfig: str | None, context: str | None) -> Kube:
        """Load the kubeconfig (else, inside a pod, the service account) and make the clients."""
        from kubernetes import client, config

        try:
            namespace = _load_kubeconfig(kubeconfig, context)
        except (config.ConfigException, OSError) as exc:
            if kubeconfig or context or "KUBERNETES_SERVICE_HOST" not in os.environ:
                raise PluginError(f"cannot load the kubeconfig: {exc}") from exc
            config.load_incluster_config()  # type: ignore[no-untyped-call]
            namespace = _in_cluster_namespace()
        api = client.ApiClient()
        return cls(api, client.CustomObjectsApi(api), client.CoreV1Api(api), namespace)

    def _call(
        self, verb: str, namespace: str | None, name: str | None, fn: Callable[[], Any]
    ) -> Any:
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        try:
            return fn()
        except ApiException as exc:
            message = describe_api_error(exc, verb, namespace, name)
            raise PluginError(message, exc.status) from exc
        except HTTPError as exc:
            host = self.api.configuration.host
            raise PluginError(f"cannot reach the API server at {host}: {exc}") from exc

    def get(self, namespace: str, name: str) -> Obj:
        """One BrokerCluster."""
        custom = self.custom
        return dict(
            self._call(
                "get", namespace, name,
                lambda: custom.get_namespaced_custom_object(
                    GROUP, VERSION, namespace, PLURAL, name, _request_timeout=30
                ),
            )
        )  # fmt: skip

    def list_clusters(self, namespace: str | None) -> list[Obj]:
        """The BrokerClusters of a namespace (None: of every namespace), sorted."""
        custom = self.custom
        if namespace is None:
            result = self._call(
                "list", None, None,
                lambda: custom.list_cluster_custom_object(
                    GROUP, VERSION, PLURAL, _request_timeout=30
                ),
            )  # fmt: skip
        else:
            result = self._call(
                "list", namespace, None,
                lambda: custom.list_namespaced_custom_object(
                    GROUP, VERSION, namespace, PLURAL, _request_timeout=30
                ),
            )  # fmt: skip
        items = [dict(i) for i in result.get("items", [])]
        return sorted(
            items, key=lambda i: (i["metadata"].get("namespace", ""), i["metadata"]["name"])
        )

    def patch(self, namespace: str, name: str, body: Obj) -> Obj:
        """A JSON merge patch of a BrokerCluster."""
        custom = self.custom
        return dict(
            self._call(
                "patch", namespace, name,
                lambda: custom.patch_namespaced_custom_object(
                    GROUP, VERSION, namespace, PLURAL, name, body,
                    _content_type="application/merge-patch+json", _request_timeout=30,
                ),
            )
        )  # fmt: skip

    def config_map(self, namespace: str, name: str) -> Obj | None:
        """A ConfigMap, or None when there is none."""
        from kubernetes.client.exceptions import ApiException

        try:
            found = self.core.read_namespaced_config_map(name, namespace, _request_timeout=30)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise PluginError(f"cannot read ConfigMap {namespace}/{name}: HTTP {exc.status} "
                              f"{exc.reason}", exc.status) from exc  # fmt: skip
        return dict(self.api.sanitize_for_serialization(found))

    def write_config_map(self, namespace: str, body: Obj, exists: bool) -> None:
        """Create or replace a ConfigMap."""
        from kubernetes.client.exceptions import ApiException

        name = body["metadata"]["name"]
        try:
            if exists:
                self.core.patch_namespaced_config_map(name, namespace, body, _request_timeout=30)
            else:
                self.core.create_namespaced_config_map(namespace, body, _request_timeout=30)
        except ApiException as exc:
            raise PluginError(f"cannot write ConfigMap {namespace}/{name}: HTTP {exc.status} "
                              f"{exc.reason}", exc.status) from exc  # fmt: skip

    def events(self, namespace: str, name: str) -> list[Obj]:
        """The cluster's Events, oldest first ([] when not permitted: they are optional)."""
        from kubernetes.client.exceptions import ApiException

        try:
            result = self.core.list_namespaced_event(
                namespace,
                field_selector=f"involvedObject.kind=BrokerCluster,involvedObject.name={name}",
                _request_timeout=30,
            )
        except ApiException:
            return []
        items = [self.api.sanitize_for_serialization(e) for e in result.items or []]
        return sorted(items, key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")


def _load_kubeconfig(kubeconfig: str | None, context: str | None) -> str:
    """Load the kubeconfig; return the chosen context's namespace (default: `default`)."""
    from kubernetes import config

    config.load_kube_config(config_file=kubeconfig, context=context)  # type: ignore[no-untyped-call]
    contexts, active = config.list_kube_config_contexts(config_file=kubeconfig)  # type: ignore[no-untyped-call]
    chosen = next((c for c in contexts if c["name"] == context), None) if context else active
    return str(((chosen or {}).get("context") or {}).get("namespace") or "default")


def _in_cluster_namespace() -> str:
    """The pod's namespace when running inside the cluster."""
    path = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
    try:
        with open(path) as f:
            return f.read().strip() or "default"
    except OSError:
        return "default"


# -- commands ----------------------------------------------------------------------------


def find_cluster(kube: Kube, namespace: str, name: str) -> Obj:
    """The BrokerCluster; when it does not exist, the error names those that do."""
    try:
        return kube.get(namespace, name)
    except PluginError as exc:
        if exc.status != 404 or "CRD" in str(exc):
            raise
        try:
            names = [c["metadata"]["name"] for c in kube.list_clusters(namespace)]
        except PluginError:
            raise exc from None
        there = f"; clusters there: {', '.join(names)}" if names else "; there are none there"
        raise PluginError(f"{exc}{there}", 404) from None


def selected_clusters(kube: Kube, args: argparse.Namespace) -> tuple[str | None, list[Obj]]:
    """The namespace asked for (None: all) and the clusters of `status` and `mirror status`."""
    namespace = None if args.all_namespaces else (args.namespace or kube.default_namespace)
    if args.cluster:
        if namespace is None:
            raise PluginError(f"{args.command}: name a cluster together with --namespace, not -A")
        return namespace, [find_cluster(kube, namespace, args.cluster)]
    return namespace, kube.list_clusters(namespace)


def cmd_mirror_status(kube: Kube, args: argparse.Namespace, out: Any) -> int:
    """`mirror status`: the DR table (or each mirrored cluster's spec and status as JSON)."""
    namespace, clusters = selected_clusters(kube, args)
    mirrored = [c for c in clusters if (c.get("spec") or {}).get("mirror")]
    return write_clusters(
        out, args.output, namespace, mirrored, "BrokerClusters with spec.mirror",
        lambda c: {"mirror": c["spec"]["mirror"], "status": (c.get("status") or {}).get("mirror")},
        lambda wide: mirror_table(mirrored, wide),
    )  # fmt: skip


def mirror_table(mirrored: Sequence[Mapping[str, Any]], with_namespace: bool) -> str:
    """`mirror status`'s table, then (after a blank line) what forced failovers left behind
    on these clusters, when they left anything (`forced_failover_notes`)."""
    table = render_table(mirror_rows(mirrored, with_namespace), with_namespace, MIRROR_COLUMNS)
    notes = forced_failover_notes(mirrored, with_namespace)
    return table + ("\n" + "".join(f"{line}\n" for line in notes) if notes else "")


def cmd_federation_status(kube: Kube, args: argparse.Namespace, out: Any) -> int:
    """`federation status`: the links table (or each cluster's spec and status as JSON)."""
    namespace, clusters = selected_clusters(kube, args)
    federated = [c for c in clusters if (c.get("spec") or {}).get("federation") is not None]
    return write_clusters(
        out, args.output, namespace, federated, "BrokerClusters with spec.federation",
        lambda c: {"federation": c["spec"]["federation"],
                   "status": (c.get("status") or {}).get("federation")},
        lambda wide: render_table(federation_rows(federated, wide), wide,
                                  federation_columns(federated)),
    )  # fmt: skip


def write_clusters(
    out: Any,
    output: str,
    namespace: str | None,
    clusters: list[Obj],
    what: str,
    as_json: Callable[[Obj], Obj],
    table: Callable[[bool], str],
) -> int:
    """A listing command's output: JSON (namespace, name and `as_json` of each cluster),
    a line when there is nothing to show, or `table` (with a NAMESPACE column for -A)."""
    if output == "json":
        doc = [{"namespace": c["metadata"].get("namespace"), "name": c["metadata"]["name"],
                **as_json(c)} for c in clusters]  # fmt: skip
        out.write(json.dumps(doc, indent=2) + "\n")
        return EXIT_OK
    if not clusters:
        where = "any namespace" if namespace is None else f'namespace "{namespace}"'
        out.write(f"No {what} in {where}.\n")
        return EXIT_OK
    out.write(table(namespace is None))
    return EXIT_OK


def mirror_request(
    kube: Kube, namespace: str, name: str, field: str, request: Obj,
    timeout: float, sleep: Callable[[float], None], clock: Callable[[], float],
) -> Obj:  # fmt: skip
    """Declare a mirror request and wait until the operator has handled its id; the
    cluster as it is then (raises PluginError on a timeout)."""
    find_cluster(kube, namespace, name)
    kube.patch(namespace, name, {"spec": {"requests": {field: request}}})
    deadline = clock() + timeout
    while True:
        cluster = kube.get(namespace, name)
        handled = ((cluster.get("status") or {}).get("handledRequests") or {}).get(field)
        if handled == request["id"]:
            return cluster
        if clock() > deadline:
            raise PluginError(
                f"{field} {request['id']} on {namespace}/{name} not handled within "
                f"{timeout:.0f}s (is its operator running? the request stays declared)",
                EXIT_TIMEOUT,
            )
        sleep(0.5)  # polling interval of a deadline-bound wait


TRUST_KEY = "ca.crt"


def trust_config_map(site: str) -> str:
    """The ConfigMap `mirror trust` writes: the other site's CA, in SITE's namespace."""
    return f"{site}-mirror-trust"


def cmd_mirror_trust(kube: Kube, other: Kube, args: argparse.Namespace, out: Any) -> int:
    """`mirror trust`: the other site's CA (read through its context) into a ConfigMap
    here, named by SITE's `spec.mirror.tls.caConfigMap`. Each step says what it did."""
    namespace = args.namespace or kube.default_namespace
    site = find_cluster(kube, namespace, args.cluster)
    mirror = (site.get("spec") or {}).get("mirror")
    if not mirror:
        raise PluginError(f"{namespace}/{args.cluster} has no spec.mirror: nothing to trust")
    from_ns = args.from_namespace or other.default_namespace
    there = find_cluster(other, from_ns, args.from_cluster)
    bundle = published_ca(other, there, args.from_context)
    where = config_map_where(from_ns, f"{args.from_cluster}-ca", args.from_context)
    name = trust_config_map(args.cluster)
    mine = kube.config_map(namespace, name)
    body = {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": namespace,
                     "labels": {"app.kubernetes.io/managed-by": "kubectl-twinmq"},
                     "annotations": {"twinmq.io/copied-from": where}},
        "data": {TRUST_KEY: bundle},
    }  # fmt: skip
    if mine is not None and (mine.get("data") or {}).get(TRUST_KEY) == bundle:
        out.write(f"configmap/{name} unchanged: it holds the CA of {where}\n")
    else:
        kube.write_config_map(namespace, body, exists=mine is not None)
        verb = "updated" if mine is not None else "created"
        out.write(f"configmap/{name} {verb} in {namespace}: the CA of {where}\n")
    tls = mirror.get("tls") or {}
    if tls.get("caConfigMap") == name and tls.get("caKey", TRUST_KEY) == TRUST_KEY:
        out.write(f"{RESOURCE}/{args.cluster}: spec.mirror.tls.caConfigMap already {name}\n")
    else:
        if tls.get("caConfigMap"):
            out.write(f"{RESOURCE}/{args.cluster}: spec.mirror.tls.caConfigMap was "
                      f"{tls['caConfigMap']}, replaced\n")  # fmt: skip
        patch = {"spec": {"mirror": {"tls": {"caConfigMap": name, "caKey": TRUST_KEY}}}}
        kube.patch(namespace, args.cluster, patch)
        out.write(f"{RESOURCE}/{args.cluster}: spec.mirror.tls.caConfigMap set to {name} (the "
                  "pods roll; the link runs mutual TLS once the other site trusts this "
                  "one's CA too)\n")  # fmt: skip
    return EXIT_OK


FEDERATION_CLIENT_SECRET = "{cluster}-federation-tls"
"""The client certificate the operator issues for a cluster's links (federationtls.py)."""
_PEM = re.compile(r"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", re.DOTALL)


def federation_trust_config_map(cluster: str) -> str:
    """The ConfigMap `federation trust` writes in the downstream's namespace: its upstreams'
    CAs, a key `<upstream>.crt` each."""
    return f"{cluster}-federation-trust"


def downstream_trust_config_map(cluster: str) -> str:
    """The ConfigMap `federation trust` writes in the upstream's namespace: its downstreams'
    CAs, one bundle (`ca.crt`)."""
    return f"{cluster}-federation-downstream-trust"


def pem_certificates(bundle: str) -> list[str]:
    """The PEM certificates of a bundle, in order, each once."""
    return list(dict.fromkeys(m.group(0).strip() for m in _PEM.finditer(bundle)))


def config_map_where(namespace: str, name: str, context: str | None) -> str:
    """A ConfigMap as the plugin's messages name it (with the context it was read through)."""
    return f"ConfigMap {namespace}/{name}" + (f" (context {context})" if context else "")


def generated_config_map(
    kube: Kube, cluster: Mapping[str, Any], name: str, context: str | None
) -> Obj | None:
    """A ConfigMap under a name the operator generates for `cluster` (a BrokerCluster as
    read), or None when there is none. One that `cluster` does not own (its uid in an owner
    reference: `ownership.foreign_reason`, the operator's own check) was made by someone
    else, before the cluster or after deleting its operator's: never used (docs/security.md,
    "Names the operator generates")."""
    meta = cluster.get("metadata") or {}
    namespace = str(meta.get("namespace"))
    found = kube.config_map(namespace, name)
    if found is None:
        return None
    why = foreign_reason(found, Owner(str(meta.get("uid"))))
    if why is not None:
        raise PluginError(
            f"{config_map_where(namespace, name, context)} is not BrokerCluster "
            f"{namespace}/{meta.get('name')}'s ({why}): someone else made it, so it is not "
            "copied; find out who, delete it, and the operator publishes the cluster's own"
        )
    return found


def published_ca(kube: Kube, cluster: Mapping[str, Any], context: str | None) -> str:
    """A BrokerCluster's CA (`cluster`, as read) as its operator publishes it
    (`<cluster>-ca`, `ca.crt`), from that ConfigMap only if the cluster owns it."""
    meta = cluster.get("metadata") or {}
    namespace, name = str(meta.get("namespace")), str(meta.get("name"))
    found = generated_config_map(kube, cluster, f"{name}-ca", context)
    bundle = ((found or {}).get("data") or {}).get(TRUST_KEY)
    if not bundle:
        raise PluginError(
            f"{config_map_where(namespace, f'{name}-ca', context)} "
            + ("holds no ca.crt" if found else "does not exist")
            + f": is {namespace}/{name} a BrokerCluster with spec.tls on (the operator "
            "publishes its CA there)?"
        )
    return str(bundle)


def write_trust(
    kube: Kube, namespace: str, name: str, data: dict[str, str], where: str, out: Any
) -> None:
    """Create or update a ConfigMap of CAs written by the plugin; says what it did."""
    mine = kube.config_map(namespace, name)
    if mine is not None and (mine.get("data") or {}) == data:
        out.write(f"configmap/{name} unchanged in {namespace}: {where}\n")
        return
    body = {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": namespace,
                     "labels": {"app.kubernetes.io/managed-by": "kubectl-twinmq"}},
        "data": data,
    }  # fmt: skip
    if mine is not None:
        # A merge patch: keys dropped from `data` must be null to go (none are here).
        body["data"] = {**{k: None for k in mine.get("data") or {}}, **data}
    kube.write_config_map(namespace, body, exists=mine is not None)
    out.write(f"configmap/{name} {'updated' if mine is not None else 'created'} in "
              f"{namespace}: {where}\n")  # fmt: skip


def chosen_upstream(federation: Mapping[str, Any], args: argparse.Namespace, here: str) -> int:
    """The index in `upstreams` that `federation trust` sets."""
    upstreams = list(federation.get("upstreams") or [])
    names = [str(u.get("name")) for u in upstreams]
    wanted = args.upstream or (None if len(upstreams) == 1 else args.from_cluster)
    if wanted is None:
        return 0
    if wanted not in names:
        raise PluginError(
            f"{here} has no upstream named {wanted} in spec.federation.upstreams (it has: "
            f"{', '.join(names) or 'none'}); name it with --upstream"
        )
    return names.index(wanted)


def cmd_federation_trust(kube: Kube, other: Kube, args: argparse.Namespace, out: Any) -> int:
    """`federation trust`: the upstream's CA into the downstream's `upstreams[].tls`, the
    downstream's CA into the upstream's `downstreamCaConfigMap` bundle. Everything is read
    before anything is written; each step says what it did."""
    namespace = args.namespace or kube.default_namespace
    here = f"{namespace}/{args.cluster}"
    site = find_cluster(kube, namespace, args.cluster)
    federation = (site.get("spec") or {}).get("federation")
    if not federation or not federation.get("upstreams"):
        raise PluginError(f"{here} has no spec.federation.upstreams: nothing to trust")
    index = chosen_upstream(federation, args, here)
    upstreams = [dict(u) for u in federation["upstreams"]]
    entry = upstreams[index]
    uri = entry.get("uri")
    if uri is not None and not str(uri).startswith("amqps://"):
        raise PluginError(
            f"{here}'s upstream {entry['name']} dials {uri}: give it an amqps:// uri (the "
            "upstream's AMQPS port, 5671) first; TLS needs it"
        )
    from_ns = args.from_namespace or other.default_namespace
    there = f"{from_ns}/{args.from_cluster}"
    upstream = find_cluster(other, from_ns, args.from_cluster)
    upstream_ca = published_ca(other, upstream, args.from_context)
    own_ca = published_ca(kube, site, None)
    serving = (upstream.get("spec") or {}).get("federation") or {}
    bundle_name = downstream_trust_config_map(args.from_cluster)
    # The downstreams the upstream trusts now: its named bundle, else the operator's copy
    # of its own Kubernetes cluster's downstreams (`downstreamCaConfigMap` replaces it;
    # under the name the operator generates, only the upstream's own copy is kept).
    current_name = serving.get("downstreamCaConfigMap")
    if current_name:
        current = other.config_map(from_ns, current_name)
    else:
        current_name = f"{args.from_cluster}-federation-downstream-ca"
        current = generated_config_map(other, upstream, current_name, args.from_context)
    trusted = pem_certificates(str(((current or {}).get("data") or {}).get(TRUST_KEY) or ""))

    # The downstream side: the upstream's CA, and the upstream entry's tls naming it.
    name = federation_trust_config_map(args.cluster)
    mine = kube.config_map(namespace, name)
    data = dict((mine or {}).get("data") or {})
    key = f"{entry['name']}.crt"
    data[key] = upstream_ca
    write_trust(kube, namespace, name, data, f"the CA of {there} (key {key})", out)
    tls = dict(entry.get("tls") or {})
    wanted = {**tls, "enabled": True, "caConfigMap": name, "caKey": key}
    secret = FEDERATION_CLIENT_SECRET.format(cluster=args.cluster)
    if not tls.get("clientSecret"):
        # Issued by this cluster's CA, which the upstream is told to trust below.
        wanted["clientSecret"] = secret
    field = f"spec.federation.upstreams[{entry['name']}].tls"
    if wanted == tls:
        out.write(f"{RESOURCE}/{args.cluster}: {field} already names {name}\n")
    else:
        entry["tls"] = wanted
        kube.patch(namespace, args.cluster, {"spec": {"federation": {"upstreams": upstreams}}})
        out.write(f"{RESOURCE}/{args.cluster}: {field} set (caConfigMap {name}, key {key}, "
                  f"clientSecret {wanted['clientSecret']}); the pods roll\n")  # fmt: skip

    # The upstream side: this cluster's CA added to the bundle of downstream CAs.
    ours = pem_certificates(own_ca)
    bundle = "\n".join([*trusted, *(c for c in ours if c not in trusted)]) + "\n"
    kept = f"; {len(trusted)} CAs kept from {current_name}" if trusted else ""
    write_trust(other, from_ns, bundle_name, {TRUST_KEY: bundle},
                f"the CA of {here} among the downstreams' CAs{kept}", out)  # fmt: skip
    if serving.get("downstreamCaConfigMap") == bundle_name:
        out.write(f"{RESOURCE}/{args.from_cluster}: spec.federation.downstreamCaConfigMap "
                  f"already {bundle_name}\n")  # fmt: skip
    else:
        patch = {"spec": {"federation": {"downstreamCaConfigMap": bundle_name}}}
        other.patch(from_ns, args.from_cluster, patch)
        was = serving.get("downstreamCaConfigMap")
        out.write(f"{RESOURCE}/{args.from_cluster}: spec.federation.downstreamCaConfigMap set "
                  f"to {bundle_name}" + (f" (was {was}, its CAs kept)" if was else "")
                  + "; the pods roll: AMQPS there asks for client certificates, verified "
                  "against it\n")  # fmt: skip
    return EXIT_OK


def switch_outcome(
    kube: Kube, namespace: str, name: str, reason: str, success: str | None = None
) -> tuple[bool, str]:
    """Whether the cluster's last mirror Event about `reason` is its `success` (by default
    `reason` + "d": MirrorDemote, MirrorDemoted)."""
    for event in reversed(kube.events(namespace, name)):
        if str(event.get("reason", "")).startswith(reason):
            return event.get("reason") == (success or f"{reason}d"), str(event.get("message", ""))
    return True, "handled"


def cmd_mirror_switch(
    kube: Kube, replica_kube: Kube, args: argparse.Namespace, out: Any, err: Any,
    sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic,
) -> int:  # fmt: skip
    """`mirror switchover` (demote the source, promote the replica with its token),
    `mirror failover` (promote the replica by force) and `mirror reseed` (on the source)."""
    namespace = args.namespace or kube.default_namespace
    if args.mirror_command == "reseed":
        reseed: Obj = {"id": new_request_id("mirror-reseed")}
        mirror_request(kube, namespace, args.cluster, "mirrorReseed", reseed, args.timeout,
                       sleep, clock)  # fmt: skip
        ok, message = switch_outcome(
            kube, namespace, args.cluster, "MirrorReseed", "MirrorReseeded"
        )
        (out if ok else err).write(f"{'reseeded' if ok else 'refused'}: {message}\n")
        return EXIT_OK if ok else EXIT_ERROR
    if args.mirror_command == "failback":
        return cmd_mirror_failback(kube, replica_kube, args, out, err, sleep, clock)
    if args.mirror_command == "failover":
        request = {"id": new_request_id("mirror-promote"), "force": True, "token": None}
        mirror_request(kube, namespace, args.cluster, "mirrorPromote", request, args.timeout,
                       sleep, clock)  # fmt: skip
        ok, message = switch_outcome(kube, namespace, args.cluster, "MirrorPromote")
        (out if ok else err).write(f"{'promoted' if ok else 'refused'}: {message}\n")
        return EXIT_OK if ok else EXIT_ERROR
    replica_ns, _, replica = args.replica.rpartition("/")
    replica_ns = replica_ns or (
        namespace if replica_kube is kube else replica_kube.default_namespace
    )
    demote = {"id": new_request_id("mirror-demote")}
    source = mirror_request(kube, namespace, args.cluster, "mirrorDemote", demote, args.timeout,
                            sleep, clock)  # fmt: skip
    ok, message = switch_outcome(kube, namespace, args.cluster, "MirrorDemote")
    token = ((source.get("status") or {}).get("mirror") or {}).get("demotionToken")
    if not ok or not token:
        err.write(f"refused: demoting {namespace}/{args.cluster}: {message}\n")
        return EXIT_ERROR
    out.write(f"demoted {namespace}/{args.cluster}: {message}\n")
    promote = {"id": new_request_id("mirror-promote"), "token": token, "force": False}
    mirror_request(replica_kube, replica_ns, replica, "mirrorPromote", promote, args.timeout,
                   sleep, clock)  # fmt: skip
    ok, message = switch_outcome(replica_kube, replica_ns, replica, "MirrorPromote")
    (out if ok else err).write(
        f"{'promoted' if ok else 'refused: promoting'} {replica_ns}/{replica}: {message}\n"
    )
    return EXIT_OK if ok else EXIT_ERROR


def failback_source(site: Obj, named: str | None, default_ns: str) -> tuple[str, str]:
    """(namespace, name) of the source a failback to `site` demotes: as named, else the
    cluster behind `site`'s target (`<name>.<namespace>.svc[...]`, its virtual IP)."""
    if named:
        namespace, _, name = named.rpartition("/")
        return namespace or default_ns, name
    host = str((((site.get("spec") or {}).get("mirror") or {}).get("target") or {}).get("host")
               or "")  # fmt: skip
    parts = host.split(".")
    if len(parts) >= 3 and parts[2] == "svc":
        return parts[1], parts[0]
    raise PluginError(
        f"failback: name the source cluster: {site['metadata']['name']}'s spec.mirror.target "
        f"({host or 'none'}) is not <name>.<namespace>.svc"
    )


def cmd_mirror_failback(
    kube: Kube, source_kube: Kube, args: argparse.Namespace, out: Any, err: Any,
    sleep: Callable[[float], None], clock: Callable[[], float],
) -> int:  # fmt: skip
    """`mirror failback SITE [SOURCE]`: mirrorFailback on the source, then, with its
    demotion token, mirrorPromote on SITE; then wait until the source reports it done."""
    started = clock()
    namespace = args.namespace or kube.default_namespace
    site = find_cluster(kube, namespace, args.cluster)
    src_ns, src = failback_source(
        site, args.source, namespace if source_kube is kube else source_kube.default_namespace
    )
    find_cluster(source_kube, src_ns, src)
    request_id = new_request_id("mirror-failback")
    source_kube.patch(src_ns, src, {"spec": {"requests": {"mirrorFailback": {"id": request_id}}}})
    out.write(f"mirrorFailback {request_id} declared on {src_ns}/{src}\n")

    seen = ""

    def progress(until: tuple[str, ...]) -> Obj:
        """Print the phases of the request until one of `until` (or Refused)."""
        nonlocal seen
        deadline = clock() + args.timeout
        while True:
            fb = ((source_kube.get(src_ns, src).get("status") or {}).get("mirror") or {}).get(
                "failback") or {}  # fmt: skip
            if fb.get("id") == request_id:
                phase = str(fb.get("phase") or "")
                if phase and phase != seen:
                    seen = phase
                    out.write(f"{src_ns}/{src}: {phase}: {fb.get('message', '')}\n")
                if phase in (*until, "Refused"):
                    return fb
            if clock() > deadline:
                raise PluginError(
                    f"mirrorFailback {request_id} on {src_ns}/{src} still {seen or 'pending'} "
                    f"after {args.timeout:.0f}s (is its operator running? the request stays "
                    "declared and goes on)", EXIT_TIMEOUT,
                )  # fmt: skip
            sleep(0.5)  # polling interval of a deadline-bound wait

    fb = progress(("Promoting", "Done"))
    if fb.get("phase") == "Refused" or not fb.get("token"):
        err.write(f"refused: failback from {src_ns}/{src}: {fb.get('message', '')}\n")
        return EXIT_ERROR
    promote = {"id": new_request_id("mirror-promote"), "token": fb["token"], "force": False}
    mirror_request(kube, namespace, args.cluster, "mirrorPromote", promote, args.timeout,
                   sleep, clock)  # fmt: skip
    ok, message = switch_outcome(kube, namespace, args.cluster, "MirrorPromote")
    if not ok:
        err.write(f"refused: promoting {namespace}/{args.cluster}: {message} ({src_ns}/{src} "
                  "stays demoted: promote it again with its token or by force)\n")  # fmt: skip
        return EXIT_ERROR
    out.write(f"promoted {namespace}/{args.cluster}: {message}\n")
    fb = progress(("Done",))
    if fb.get("phase") != "Done":
        err.write(f"refused: {src_ns}/{src}: {fb.get('message', '')}\n")
        return EXIT_ERROR
    out.write(f"failed back to {namespace}/{args.cluster} in {clock() - started:.1f} s\n")
    return EXIT_OK


def cmd_status(kube: Kube, args: argparse.Namespace, out: Any) -> int:
    """`status`: the table (or the clusters' status as JSON)."""
    namespace, clusters = selected_clusters(kube, args)
    return write_clusters(
        out, args.output, namespace, clusters, "BrokerClusters",
        lambda c: {"status": c.get("status") or {}},
        lambda wide: render_table(status_rows(clusters, datetime.now(UTC), wide), wide),
    )  # fmt: skip


def cmd_request(
    kube: Kube, args: argparse.Namespace, out: Any, err: Any,
    sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic,
) -> int:  # fmt: skip
    """promote, recover, fence, unfence, audit: declare the request; with --wait, await it."""
    command = args.command
    namespace = args.namespace or kube.default_namespace
    broker = getattr(args, "broker", None)
    cluster = find_cluster(kube, namespace, args.cluster)
    status = cluster.get("status") or {}
    if command == "promote" and status.get("activeBroker") == broker:
        out.write(f"{broker} is already active in epoch {status.get('epoch')}: nothing to do\n")
        return EXIT_OK
    target = broker_status(cluster, broker or "")
    if command == "promote" and not args.force and target.get("damaged"):
        err.write(
            f"warning: {broker}'s journal is damaged ({target.get('damage') or 'see status'}); "
            "the operator refuses to promote it unless --force\n"
        )
    elif command == "promote" and not args.force and not target.get("ready"):
        err.write(
            f"warning: {broker} is not ready (not in sync with the active); the operator "
            "refuses to promote it unless --force\n"
        )
    replaced = pending_request(cluster, command)
    if replaced:
        err.write(f"warning: replacing the {request_field(command)} request {replaced}, "
                  "not handled yet\n")  # fmt: skip
    request_id = new_request_id(command)
    force = bool(getattr(args, "force", False))
    sites = bool(getattr(args, "sites", False))
    kube.patch(namespace, args.cluster, request_patch(command, request_id, broker, force, sites))
    out.write(f"{RESOURCE}/{args.cluster}: {request_field(command)} request {request_id} "
              "declared\n")  # fmt: skip
    if not args.wait:
        return EXIT_OK
    timeout = args.timeout or DEFAULT_TIMEOUT[request_field(command)]
    deadline = clock() + timeout
    while True:
        cluster = kube.get(namespace, args.cluster)
        # An audit request is handled when its run starts; its verdict comes when it ends.
        if handled(cluster, command, request_id) and not (
            command == "audit" and audit_running(cluster)
        ):
            break
        if clock() >= deadline:
            err.write(
                f"timed out after {timeout:g}s waiting for the operator to handle {request_id}"
                + (
                    " (the audit run is still going)"
                    if handled(cluster, command, request_id)
                    else ""
                )
                + " "
                "(is the operator running and watching this namespace? the request stays "
                "declared and will be handled once)\n"
            )
            return EXIT_TIMEOUT
        sleep(0.5)  # polling interval of a deadline-bound wait
    succeeded, message = outcome(
        cluster, command, broker, request_id, kube.events(namespace, args.cluster)
    )
    (out if succeeded else err).write(f"{'done' if succeeded else 'refused'}: {message}\n")
    return EXIT_OK if succeeded else EXIT_ERROR


def run(argv: Sequence[str] | None = None, out: Any = None, err: Any = None) -> int:
    """The plugin: parse, connect, run the command; errors as one line on stderr."""
    out = out or sys.stdout
    err = err or sys.stderr
    args = parse_args(argv)
    try:
        kube = Kube.connect(args.kubeconfig, args.context)
        if args.command == "status":
            return cmd_status(kube, args, out)
        if args.command == "federation" and args.federation_command == "trust":
            other = Kube.connect(args.kubeconfig, args.from_context) if (
                args.from_context) else kube  # fmt: skip
            return cmd_federation_trust(kube, other, args, out)
        if args.command == "federation":
            return cmd_federation_status(kube, args, out)
        if args.command == "mirror" and args.mirror_command == "status":
            return cmd_mirror_status(kube, args, out)
        if args.command == "mirror" and args.mirror_command == "trust":
            other = Kube.connect(args.kubeconfig, args.from_context) if (
                args.from_context) else kube  # fmt: skip
            return cmd_mirror_trust(kube, other, args, out)
        if args.command == "mirror":
            other = kube
            context = getattr(args, "replica_context", None) or getattr(
                args, "source_context", None
            )
            if context:
                other = Kube.connect(args.kubeconfig, context)
            return cmd_mirror_switch(kube, other, args, out, err)
        return cmd_request(kube, args, out, err)
    except PluginError as exc:
        err.write(f"error: {exc}\n")
        return EXIT_ERROR


def main() -> NoReturn:
    """Console script `kubectl-twinmq` (found by kubectl as `kubectl twinmq`)."""
    sys.exit(run())


if __name__ == "__main__":
    main()
