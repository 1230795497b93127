"""Drift: did a server-side apply restore an owned object someone deleted or edited?

Pure: the reconciler applies each child every pass and hands the API server's answer
here. An apply that changes nothing leaves the object alone (same resourceVersion, and
the operator's managedFields entry keeps its time); one that changes something stamps
the operator's entry with the time of the change. So, for a child whose desired state
is the one applied last pass:
- another uid: it was deleted, and the apply recreated it;
- a newer time on the operator's entry: it was edited, and the apply set it back.
A changed desired state (a spec change: a volume grown) is an update, not a repair.
The times have one-second resolution: an edit and its repair within the same second as
the operator's previous write of that object go unreported (never the reverse).

A restarted operator has no previous pass in memory: each child carries the digest of
its desired state in an annotation (`stamped`), so the first pass reads what the previous
process left (`remembered`) and an edit made while no operator ran is still reported. A
child deleted meanwhile is recreated unreported: nothing is left to remember it by.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Literal

Obj = dict[str, Any]
DIGEST_ANNOTATION = "twinmq.io/desired-digest"
Repair = Literal["recreated", "restored"]


@dataclass(frozen=True)
class Applied:
    """What the reconciler remembers of one child after applying it."""

    uid: str
    changed: str  # the time of the operator's last change to it (its managedFields entry)
    desired: str  # a digest of the object applied


@dataclass(frozen=True)
class Repaired:
    """One repair, for its Event (reason DriftRepaired) and metric (by kind)."""

    kind: str
    message: str


def key(obj: Obj) -> str:
    """A child's identity within its cluster: `Kind/name`."""
    return f"{obj['kind']}/{obj['metadata']['name']}"


def digest(desired: Obj) -> str:
    """The digest of a desired state (its own digest annotation left out)."""
    metadata = dict(desired.get("metadata") or {})
    annotations = {
        k: v for k, v in (metadata.get("annotations") or {}).items() if k != DIGEST_ANNOTATION
    }
    if annotations:
        metadata["annotations"] = annotations
    else:
        metadata.pop("annotations", None)
    canonical = json.dumps({**desired, "metadata": metadata}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def stamped(desired: Obj) -> Obj:
    """`desired` with its digest in an annotation: what the next operator process reads."""
    metadata = dict(desired.get("metadata") or {})
    metadata["annotations"] = {**(metadata.get("annotations") or {}),
                               DIGEST_ANNOTATION: digest(desired)}  # fmt: skip
    return {**desired, "metadata": metadata}


def _our_change(meta: Obj, manager: str) -> str:
    entries = meta.get("managedFields") or []
    ours = [e for e in entries if e.get("manager") == manager and e.get("operation") == "Apply"]
    return str(ours[0].get("time") or "") if ours else ""


def applied(desired: Obj, result: Obj, manager: str) -> Applied:
    """What to remember of `desired` once the API server answered the apply with `result`."""
    meta = result.get("metadata") or {}
    return Applied(
        uid=str(meta.get("uid") or ""), changed=_our_change(meta, manager), desired=digest(desired)
    )


def remembered(live: Obj | None, manager: str) -> Applied | None:
    """What an earlier operator process applied, read from the live child before this
    process's first apply of it (None: absent, or never stamped or applied by us)."""
    meta = (live or {}).get("metadata") or {}
    stamp = (meta.get("annotations") or {}).get(DIGEST_ANNOTATION)
    changed = _our_change(meta, manager)
    if not stamp or not changed:
        return None
    return Applied(uid=str(meta.get("uid") or ""), changed=changed, desired=str(stamp))


def repair(before: Applied | None, now: Applied) -> Repair | None:
    """Whether this apply repaired drift (None: nothing to report: a no-op, a first apply,
    or an update of the desired state)."""
    if before is None or before.desired != now.desired:
        return None
    if before.uid != now.uid:
        return "recreated"
    if before.changed != now.changed:
        return "restored"
    return None
