"""Who owns an object under a name the operator generates (docs/security.md, "Names the
operator generates"): the one check, pure (no API client, no kopf), shared by the
operator (`kube.owned`, which raises `kube.Foreign`) and `kubectl twinmq` (which refuses
to copy another site's CA from a ConfigMap its BrokerCluster does not own)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

Obj = dict[str, Any]

CERTIFICATE_NAME = "cert-manager.io/certificate-name"
"""The annotation cert-manager puts on the Secret it writes for a Certificate."""


@dataclass(frozen=True)
class Owner:
    """Who must own an object under a name the operator generates: the BrokerCluster of
    `uid`; for the Secret cert-manager writes (it sets no owner reference by default),
    `certificate`, the name of the BrokerCluster's own cert-manager Certificate whose Secret
    it must be."""

    uid: str
    certificate: str | None = None


def owns(obj: Obj, uid: str) -> bool:
    """Whether `obj` names the object of `uid` among its owners (uids are never reused, and
    an object made before its owner existed cannot name it)."""
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return any(ref.get("uid") == uid for ref in refs)


def foreign_reason(obj: Obj, owner: Owner, certificate: Obj | None = None) -> str | None:
    """Why `obj`, found under a name the operator generates, is not `owner`'s (None: it
    is). `certificate`: with `owner.certificate`, that Certificate as read (None: absent).

    cert-manager's Secret is its Certificate's when it carries cert-manager's annotation
    naming it, the Certificate is the BrokerCluster's, and the Secret is not older than the
    Certificate (cert-manager writes it after; one made before under that name, even with the
    annotation, is someone's pre-emptive copy: cert-manager would keep a valid-looking one
    as is) or names it as its owner (`--enable-certificate-owner-ref`)."""
    if owns(obj, owner.uid):
        return None
    if owner.certificate is None:
        return "no owner reference to it"
    meta = obj.get("metadata") or {}
    named = (meta.get("annotations") or {}).get(CERTIFICATE_NAME)
    if named != owner.certificate:
        return (f"not the Secret of this BrokerCluster's Certificate {owner.certificate}: its "
                f"{CERTIFICATE_NAME} annotation is {named!r}")  # fmt: skip
    if certificate is None or not owns(certificate, owner.uid):
        return f"Certificate {owner.certificate} is not this BrokerCluster's"
    cert_meta = certificate.get("metadata") or {}
    if owns(obj, str(cert_meta.get("uid"))):
        return None
    made, cert_made = _created(meta), _created(cert_meta)
    if made is None or cert_made is None or made < cert_made:
        return (f"created before this BrokerCluster's Certificate {owner.certificate}: "
                "cert-manager did not make it")  # fmt: skip
    return None


def _created(meta: Obj) -> datetime | None:
    stamp = meta.get("creationTimestamp")
    if isinstance(stamp, datetime):
        return stamp
    try:
        return datetime.fromisoformat(str(stamp).replace("Z", "+00:00"))
    except ValueError:
        return None
