"""Server identifiers at a peering's handshake (sans-I/O).

Each side names itself in the connection handshake: the downstream in its
`client-properties`, the upstream in its `server-properties`, both under
`x-twinmq-server-id`. Two servers with the same identifier would take each other's
messages for their own (the path check drops them, the dedup keys collide): the seed
calls this the configuration error users lose most time on, so both sides refuse it,
loudly, before anything else happens.
"""

from __future__ import annotations

SERVER_ID_PROPERTY = "x-twinmq-server-id"
"""The handshake property naming the sender's server identifier."""

STATE_PROPERTY = "x-twinmq-state-exchange"
"""The upstream's server-property naming its state replication exchange (absent on a
version without one: a link subscribes only where it is announced)."""

PEER_EXCHANGE = "amq.peer"
"""The built-in fanout exchange of peer status messages (seed 002's "status management")."""

PEER_PROPERTY = "x-twinmq-peer-exchange"
"""The upstream's server-property naming the exchange its peers' status messages go to
(`amq.peer`; absent on a version that takes none: a link sends its status only where it
is announced, as a publish to a missing exchange would close the link's channel)."""

DUPLICATE_ID = "duplicate server id"
"""The words every refusal of a duplicate identifier contains (both sides match on them)."""


def duplicate_refusal(own: str, peer: object, *, side: str) -> str | None:
    """Why a peering with `peer` (its announced identifier) is refused, or None.

    `side` names the other end as this one sees it ("downstream", "upstream").
    """
    if isinstance(peer, bytes):
        peer = peer.decode("utf-8", "replace")
    if peer == own:
        return (
            f"{DUPLICATE_ID} '{own}': the {side} announces this server's own identifier; "
            "every federated server needs a unique --server-id (a federation with itself or "
            "two servers configured alike)"
        )
    return None
