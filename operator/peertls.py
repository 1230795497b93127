"""Mutual TLS between a cluster's brokers (replication) and HTTPS on their admin API,
moved to and from one rolling update at a time (issue 16, "Transport security").

Each broker has a certificate of its own (`<cluster>-<broker>-tls`, `operator/certs.py`)
naming its pod only, for server and client use: the replication link verifies that the
peer's certificate names the broker its handshake claims, so one broker cannot pose as the
other. A running pair cannot switch at once: a rolling update restarts one broker at a
time, and a passive that speaks TLS to an active that does not (or the reverse) never
pairs, so the switchover the rollout needs would never be allowed. The cluster therefore
walks these phases (`status.peerTls`), each a rolling update of its own, and each step's
brokers pair with the step before and after it (`tests/test_replication_tls.py`):

| phase | replication listener | the passive dials | admin API |
|---|---|---|---|
| `Plaintext` | plaintext | plaintext | HTTP |
| `PlainListener` | plaintext | TLS, then plaintext if refused | HTTPS |
| `TlsListener` | TLS only | TLS, then plaintext if refused | HTTPS |
| `Required` | TLS only | TLS only | HTTPS |

The operator moves one step only when the pods run the current step's template and the
passive is in sync: the pair is never left unreplicated by the move. The admin API needs
no such steps: the operator dials each pod as its template says (`builders.ADMIN_SCHEME`),
and the kubelet's probes are part of that template. New clusters start at their target;
a cluster with no phase recorded but pods starts where its pods are (`observed`: `Plaintext`
for pods of an older operator). The target is
`Required` while `spec.tls` is on with certificates the operator can have issued per broker
(its own CA, or cert-manager with `issuerRef`), else `Plaintext` (TLS off, or your own
Secret: one certificate for both brokers cannot tell them apart): the walk runs backwards
too.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, get_args

from twinmq.operator.builders import PEER_TLS_MODES
from twinmq.operator.models import BrokerClusterSpec, PeerTlsPhase

PHASES: tuple[PeerTlsPhase, ...] = get_args(PeerTlsPhase)
MODE_FLAG = "--replication-tls-mode="


def target(spec: BrokerClusterSpec) -> PeerTlsPhase:
    """Where the cluster's brokers should end up."""
    tls = spec.tls
    per_broker = tls.issuer_ref is not None or tls.secret_name is None
    return "Required" if tls.enabled and per_broker else "Plaintext"


def observed(pods: Iterable[Mapping[str, Any] | None]) -> PeerTlsPhase:
    """The phase the existing pods were built for, read from their
    `--replication-tls-mode` (none: `Plaintext`, as pods of an older operator); the earlier
    one when they differ (a rollout under way: either is a neighbour of the other)."""
    modes = {mode: phase for phase, mode in PEER_TLS_MODES.items()}
    found: list[PeerTlsPhase] = []
    for pod in pods:
        if pod is None:
            continue
        containers = (pod.get("spec") or {}).get("containers") or [{}]
        args = [str(a) for a in containers[0].get("args") or []]
        mode = next((a.split("=", 1)[1] for a in args if a.startswith(MODE_FLAG)), None)
        found.append(modes.get(mode, "Plaintext") if mode else "Plaintext")
    return min(found, key=PHASES.index) if found else "Plaintext"


def current(
    recorded: PeerTlsPhase | None,
    spec: BrokerClusterSpec,
    pods: Iterable[Mapping[str, Any] | None],
    started: bool,
) -> PeerTlsPhase:
    """The phase the pods are built for: the recorded one; with none recorded, the target
    for a cluster not started yet (no pods, epoch 0), else what its pods run (`observed`:
    `Plaintext` for pods of an older operator)."""
    if recorded is not None:
        return recorded
    pods = list(pods)
    if not started and all(p is None for p in pods):
        return target(spec)
    return observed(pods)


def step(phase: PeerTlsPhase, goal: PeerTlsPhase) -> PeerTlsPhase:
    """The next phase from `phase` towards `goal` (one step, either way)."""
    here, there = PHASES.index(phase), PHASES.index(goal)
    if here == there:
        return phase
    return PHASES[here + (1 if there > here else -1)]


def advance(
    phase: PeerTlsPhase, goal: PeerTlsPhase, *, converged: bool, in_sync: bool
) -> PeerTlsPhase:
    """The phase to record after this pass: the next step once the pods run this one's
    template (`converged`) and the passive is in sync; else where it is."""
    if phase == goal or not (converged and in_sync):
        return phase
    return step(phase, goal)
