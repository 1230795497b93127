"""Mutual authentication of the replication link, sans-I/O.

    listener (active)                         connector (passive)
    CHALLENGE {name, nonce_a}          ->
                                       <-     HELLO {name, epoch_p, nonce_p, proof_p}
    WELCOME {epoch_a, proof_a}         ->     (or REFUSE: the passive was not proven)
                                       <-     SNAPSHOT (or REFUSE: a stale active)

Each proof is HMAC-SHA256 under the shared replication token over one
transcript: a label for the direction, both names, both nonces and the
prover's epoch. So a proof answers one challenge only (fresh nonces on both
sides: no replay), proves one direction only (a broker's own HELLO reflected
back to it is no WELCOME), binds the epoch it carries, and a broker never
accepts a peer of its own name (a passive's HELLO relayed to its own
listener). Nothing a peer says is acted upon before its proof is verified.

What this does not give without TLS: frames after the handshake carry no MAC
of their own, so whoever can rewrite the TCP stream between the two brokers
still can. TLS for the link comes with the security work.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import Final, Literal

# The direction each proof is for: a proof made for one is never valid for the other.
_LABELS: Final = {
    "passive": b"twinmq-replication/2 passive->active",
    "active": b"twinmq-replication/2 active->passive",
}


def new_nonce() -> str:
    """A fresh 128-bit nonce, hex."""
    return secrets.token_hex(16)


def transcript_proof(
    token: str,
    prover: Literal["active", "passive"],
    *,
    active: str,
    passive: str,
    active_nonce: str,
    passive_nonce: str,
    epoch: int,
) -> str:
    """The proof `prover` sends: HMAC-SHA256 over the direction, both names, both nonces, its epoch.

    Fields are length-prefixed, so no two transcripts encode alike.
    """
    mac = hmac.new(token.encode(), digestmod=hashlib.sha256)
    for part in (_LABELS[prover], active.encode(), passive.encode(),
                 active_nonce.encode(), passive_nonce.encode(), str(epoch).encode()):  # fmt: skip
        mac.update(len(part).to_bytes(4, "big"))
        mac.update(part)
    return mac.hexdigest()


def verify(
    token: str | None,
    claimed: str,
    prover: Literal["active", "passive"],
    *,
    active: str,
    passive: str,
    active_nonce: str,
    passive_nonce: str,
    epoch: int,
) -> str | None:
    """Why `claimed` is not a valid proof by `prover` (None: it is).

    Without a token nothing is valid: an unconfigured broker authenticates no one.
    """
    if token is None:
        return "no replication token configured"
    if active == passive:
        return f"the peer has this broker's own name {active!r} (a reflected handshake)"
    if active_nonce == passive_nonce:
        return "the peer echoed this broker's nonce"
    expected = transcript_proof(
        token, prover, active=active, passive=passive,
        active_nonce=active_nonce, passive_nonce=passive_nonce, epoch=epoch,
    )  # fmt: skip
    if not hmac.compare_digest(claimed.encode(), expected.encode()):
        return "wrong proof"
    return None
