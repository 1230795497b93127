"""Rotating the operator-managed CA with no moment where one side distrusts the other
(issue 16, "Certificates"; docs/security.md, "Rotating the managed CA").

A CA cannot be swapped in one step: whoever still trusts only the old one refuses what the
new one signs, and the trust bundle reaches its holders late (the kubelet refreshes a
mounted Secret or ConfigMap within a minute or so; applications and other sites that copy
`<cluster>-ca` whenever they do). So, as trust-manager and CloudNativePG's guidance do it,
in three phases, each held for the grace period (`CA_GRACE_ENV`, a day by default) before
the next one relies on it:

1. **Staged**: a new CA is made and published beside the current one (every `ca.crt` and
   the `<cluster>-ca` ConfigMap carry both); it signs nothing yet.
2. **Switched**: the new CA signs: every certificate the operator issues is issued again
   at once; the old CA stays in the bundle, so a pod whose volume still holds an
   old-signed certificate is still verified.
3. **Complete**: the old CA leaves the bundle.

A phase's time is not enough: the kubelet may be late delivering a pod's files, or a
broker may fail to load them (a bad file: it keeps the old ones). So the next phase also
waits until every broker pod reports (`GET /status` `tls`, `broker/tls.py`) that it has
loaded the current phase's files: each trust bundle of this CA's holds every CA the phase
publishes, and each certificate of this CA's is signed by the CA that signs now
(`behind`). Until then `status.caRotation.waiting` says which pod is behind and why.

Started by `spec.requests.rotateCa` (an id, handled once: a leaked key, a policy), or on
its own when the CA is two thirds through its life. The state is kept in the CA's own
Secret (`rotation.json`, `next.crt`/`next.key`, `previous.crt`) beside its key, so a
restarted operator resumes where it was. Sans-I/O: `certs.py` reads and writes the Secret.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Generic, Protocol, TypeVar

from cryptography import x509

from twinmq.broker.api import TlsFilesStatus
from twinmq.broker.names import ENV_PREFIX
from twinmq.broker.tls import fingerprint, key_id
from twinmq.operator.models import CaRotation, iso, parse_iso

CA_GRACE_ENV = ENV_PREFIX + "OPERATOR_CA_GRACE_SECONDS"
"""Operator setting: how long each phase of a CA rotation is held (default a day)."""
DEFAULT_CA_GRACE = 86_400
NEXT_CERT, NEXT_KEY, PREVIOUS_CERT, STATE = "next.crt", "next.key", "previous.crt", "rotation.json"


def grace_seconds(env: Mapping[str, str] = os.environ) -> int:
    """$TWINMQ_OPERATOR_CA_GRACE_SECONDS, or a day; at least 1."""
    raw = env.get(CA_GRACE_ENV, "").strip()
    if not raw:
        return DEFAULT_CA_GRACE
    seconds = int(raw)
    if seconds < 1:
        raise ValueError(f"{CA_GRACE_ENV}={seconds}: at least 1")
    return seconds


class Pem(Protocol):
    """A certificate and its key, as PEM."""

    @property
    def cert(self) -> str: ...

    @property
    def key(self) -> str: ...


P = TypeVar("P", bound=Pem)


class CaSet(Protocol, Generic[P]):
    """What a rotation changes: the signing CA, the one staged to follow it, the one it
    replaced (still trusted), and where the rotation stands."""

    ca: P | None
    ca_next: P | None
    ca_previous: str | None
    rotation: CaRotation | None


def bundle(cas: CaSet[P]) -> str:
    """The trust bundle: the signing CA, then the staged and the previous one if any."""
    assert cas.ca is not None
    parts = [cas.ca.cert, cas.ca_next.cert if cas.ca_next else None, cas.ca_previous]
    return "".join(p if p.endswith("\n") else p + "\n" for p in parts if p)


def secret_data(cas: CaSet[P]) -> dict[str, str]:
    """The rotation's keys in the CA's Secret (beside `tls.crt`/`tls.key`: the signer)."""
    data: dict[str, str] = {}
    if cas.ca_next is not None:
        data[NEXT_CERT], data[NEXT_KEY] = cas.ca_next.cert, cas.ca_next.key
    if cas.ca_previous is not None:
        data[PREVIOUS_CERT] = cas.ca_previous
    if cas.rotation is not None:
        data[STATE] = cas.rotation.model_dump_json(by_alias=True)
    return data


def read(cas: CaSet[P], data: Mapping[str, str], pair: Callable[[str, str], P]) -> None:
    """The rotation's state from the CA's Secret (a restarted operator resumes it)."""
    cas.ca_next = pair(data[NEXT_CERT], data[NEXT_KEY]) if data.get(NEXT_CERT) and data.get(
        NEXT_KEY) else None  # fmt: skip
    cas.ca_previous = data.get(PREVIOUS_CERT) or None
    cas.rotation = CaRotation.model_validate_json(data[STATE]) if data.get(STATE) else None


Loaded = Mapping[str, Sequence[TlsFilesStatus] | None]
"""What each broker pod reports it loaded (its `/status` `tls`; None: no answer)."""


def _cert(pem: str) -> x509.Certificate:
    return x509.load_pem_x509_certificate(pem.encode())


def behind(cas: CaSet[P], loaded: Loaded) -> list[str]:
    """Why each pod has not loaded the files of the phase the rotation is in, one line a
    pod (`primary: ...`); empty when every pod has. A pod has when each of its trust
    bundles that holds one of this rotation's CAs holds all the phase publishes (a bundle
    of another's, as the mirror's of the other site, is not this CA's business), and each
    certificate signed by one of them is signed by the CA that signs now."""
    assert cas.ca is not None
    roles = [(cas.ca.cert, "signing"), (cas.ca_next.cert if cas.ca_next else None, "staged"),
             (cas.ca_previous, "previous")]  # fmt: skip
    published = {fingerprint(_cert(pem)): role for pem, role in roles if pem}
    signers = {key_id(_cert(pem)): role for pem, role in roles if pem}
    signing = key_id(_cert(cas.ca.cert))
    lines = []
    for pod, files in sorted(loaded.items()):
        if files is None:
            lines.append(f"{pod}: no report of its TLS files (not reachable)")
            continue
        if not files:
            lines.append(f"{pod}: reports no TLS files loaded (a broker older than this "
                         "operator?)")  # fmt: skip
            continue
        why: list[str] = []
        for f in files:
            lacking = []
            held = set(f.ca_fingerprints)
            if held & published.keys():
                missing = [f"the {role} CA ({fp[:16]})" for fp, role in published.items()
                           if fp not in held]  # fmt: skip
                if missing:
                    lacking.append(f"its {f.listener} trust bundle lacks {', '.join(missing)}")
            role = signers.get(f.certificate.authority_key_id or "")
            if role is not None and f.certificate.authority_key_id != signing:
                lacking.append(f"its {f.listener} certificate (serial {f.certificate.serial}) "
                               f"is signed by the {role} CA")  # fmt: skip
            if lacking and f.load_error is not None:  # the files it was given do not load
                lacking.append(f"its {f.listener} files do not load: {f.load_error}")
            why += lacking
        if why:
            lines.append(f"{pod}: {'; '.join(why)}")
    return lines


def load_errors(loaded: Loaded) -> list[tuple[str, TlsFilesStatus]]:
    """Each (pod, listener files) whose last reload failed (for a Warning Event)."""
    return [(pod, f) for pod, files in sorted(loaded.items()) for f in files or []
            if f.load_error is not None]  # fmt: skip


def advance(
    cas: CaSet[P],
    request: str | None,
    due: bool,
    now: datetime,
    grace: int,
    make_ca: Callable[[], P],
    loaded: Loaded | None = None,
) -> str | None:
    """Take the rotation's next step if its time has come (`request`: the id of
    `spec.requests.rotateCa`; `due`: the signing CA is two thirds through its life) and,
    given `loaded` (what each pod reports), every pod has loaded the current phase's files
    (`behind`: while one has not, the rotation's `waiting` says why). Without `loaded` the
    time alone decides (sans-I/O tests of the timing). Returns what happened, for an Event
    and the log, or None. A request made during a rotation starts another once this one
    is complete (an id is handled once)."""
    state, hold = cas.rotation, timedelta(seconds=grace)
    if state is None or state.phase == "Complete":
        handled = None if state is None else state.request
        asked = request is not None and request != handled
        if not (asked or due):
            return None
        reason = f"requested ({request})" if asked else "the CA is two thirds through its life"
        cas.ca_next = make_ca()
        cas.rotation = CaRotation(phase="Staged", since=iso(now), next_step_at=iso(now + hold),
                                  request=request if asked else handled, reason=reason)  # fmt: skip
        return (f"CA rotation started ({reason}): a new CA is published beside the current "
                f"one and signs from {iso(now + hold)}")  # fmt: skip
    if state.phase == "Staged" and cas.ca_next is None:  # its keys edited out of the Secret
        cas.ca_next = make_ca()
        cas.rotation = state.model_copy(update={"since": iso(now), "next_step_at": iso(now + hold)})
        return "CA rotation: the staged CA was missing from its Secret; a new one is staged"
    if now < parse_iso(state.since) + hold:
        return None
    if loaded is not None:
        lagging = behind(cas, loaded)
        waiting = None
        if lagging:
            waiting = f"the {state.phase} phase's files are not loaded everywhere: " + "; ".join(
                lagging
            )
        if waiting != state.waiting:
            cas.rotation = state = state.model_copy(update={"waiting": waiting})
        if waiting is not None:
            return None
    if state.phase == "Staged":
        assert cas.ca is not None and cas.ca_next is not None
        cas.ca_previous, cas.ca, cas.ca_next = cas.ca.cert, cas.ca_next, None
        cas.rotation = state.model_copy(update={
            "phase": "Switched", "since": iso(now), "next_step_at": iso(now + hold),
            "waiting": None,
        })  # fmt: skip
        return (f"CA rotation: the new CA signs now (every certificate issued again); the "
                f"old one stays trusted until {iso(now + hold)}")  # fmt: skip
    cas.ca_previous = None
    cas.rotation = state.model_copy(
        update={"phase": "Complete", "since": iso(now), "next_step_at": None, "waiting": None}
    )
    return ("CA rotation complete: the old CA is no longer published (each broker stops "
            "trusting it as its volume is updated)")  # fmt: skip
