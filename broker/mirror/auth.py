"""The mirror link's mutual authentication: the replication handshake under a key of its own.

The proofs are the pair's (`broker/replication/handshake.py`), made with a key
derived from the mirror token, so a mirror proof is never valid on a pair's
replication listener nor the reverse, even if an operator gives both links the
same secret. The connecting source proves itself in the handshake's "passive"
direction, the listening mirror in its "active" one.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import Literal

from twinmq.broker.replication.handshake import transcript_proof, verify

_DIRECTION: dict[str, Literal["active", "passive"]] = {"source": "passive", "mirror": "active"}


def mirror_key(token: str) -> str:
    """The key the mirror link's proofs are made with."""
    return hmac.new(token.encode(), b"twinmq-mirror/1", hashlib.sha256).hexdigest()


@dataclass(slots=True, frozen=True)
class Transcript:
    """What both proofs of one handshake cover: both names, both nonces."""

    mirror: str
    source: str
    mirror_nonce: str
    source_nonce: str

    def proof(self, key: str, prover: Literal["source", "mirror"]) -> str:
        """The proof `prover` sends."""
        return transcript_proof(
            key, _DIRECTION[prover], active=self.mirror, passive=self.source,
            active_nonce=self.mirror_nonce, passive_nonce=self.source_nonce, epoch=0,
        )  # fmt: skip

    def refusal(self, key: str, claimed: str, prover: Literal["source", "mirror"]) -> str | None:
        """Why `claimed` is not `prover`'s valid proof (None: it is)."""
        return verify(
            key, claimed, _DIRECTION[prover], active=self.mirror, passive=self.source,
            active_nonce=self.mirror_nonce, passive_nonce=self.source_nonce, epoch=0,
        )  # fmt: skip
