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
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Literal

Obj = dict[str, Any]
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


def applied(desired: Obj, result: Obj, manager: str) -> Applied:
    """What to remember of `desired` once the API server answered the apply with `result`."""
    meta = result.get("metadata") or {}
    entries = meta.get("managedFields") or []
    ours = [e for e in entries if e.get("manager") == manager and e.get("operation") == "Apply"]
    canonical = json.dumps(desired, sort_keys=True, separators=(",", ":"))
    return Applied(
        uid=str(meta.get("uid") or ""),
        changed=str(ours[0].get("time") or "") if ours else "",
        desired=hashlib.sha256(canonical.encode()).hexdigest(),
    )


def repair(before: Applied | None, now: Applied) -> Repair | None:
    """Whether this apply repaired drift (None: nothing to report: a no-op, the first apply
    this operator process made, or an update of the desired state)."""
    if before is None or before.desired != now.desired:
        return None
    if before.uid != now.uid:
        return "recreated"
    if before.changed != now.changed:
        return "restored"
    return None
