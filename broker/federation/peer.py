"""`amq.peer`: peer status messages applications can subscribe to (seed 002, "Status
Management").

Every server has the fanout exchange `amq.peer` (built in, like `amq.fanout`). The
federation publishes one message there when something happens between this server and
a peer: a link of this server (downstream side) comes up, goes down or is refused; a
federation peer connects here or goes away (upstream side). A JSON body (`PeerEvent`),
the event's name as routing key and message `type`; transient, as a status is news,
not data to keep: an application binds a queue and reads what happens from then on.
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime
from typing import Literal

from pamqp import commands
from pydantic import BaseModel, Field

from twinmq.broker import codec
from twinmq.broker.federation.identity import PEER_EXCHANGE
from twinmq.broker.vhost import VirtualHost

log = logging.getLogger(__name__)


PeerEventName = Literal[
    "link-up", "link-down", "link-refused", "link-status", "peer-connected", "peer-disconnected"
]


class PeerEvent(BaseModel):
    """One peer status message (the body of a message on `amq.peer`, as JSON)."""

    event: PeerEventName = Field(
        description="link-*: a link of this server (downstream side; link-status: periodic, "
        "while it runs); peer-*: a federation peer's connection here (upstream side; "
        "connected: its handshake accepted)"
    )
    server_id: str = Field(description="This server's identifier")
    peer: str | None = Field(None, description="The other side's server identifier, if known")
    link: str | None = Field(None, description="The link's local exchange (link-* events)")
    upstream: str | None = Field(None, description="The upstream's name in the federation file")
    address: str | None = Field(None, description="The peer's address (peer-* events)")
    reason: str | None = Field(None, description="Why a link went down or was refused")
    forward_pending: int = Field(
        0, description="Lag toward the upstream: messages in the link's outbox not yet confirmed"
    )
    messages_received: int = Field(0, description="Received over the link since start")
    messages_forwarded: int = Field(0, description="Forwarded over the link since start")
    epoch: int | None = Field(None, description="This server's (pair's) epoch (link-status)")
    peer_epoch: int | None = Field(
        None,
        description="The upstream's epoch, from its state (link-status; a failover there "
        "raises it)",
    )
    upstream_state_seq: int | None = Field(
        None, description="The upstream's change counter as the link last applied it (link-status)"
    )
    to_peer: bool = Field(
        False,
        description="Sent by a downstream link to its upstream's amq.peer (link-up, "
        "link-status): `server_id` is the sender's, `peer` the receiving server's",
    )
    time: float = Field(description="When, in seconds since the epoch")


def publish(vhost: VirtualHost, event: PeerEvent) -> None:
    """Publish `event` on `amq.peer`."""
    publish_status(
        vhost, PEER_EXCHANGE, event.event, event, event.event, event.time, "twinmq-federation"
    )


def publish_status(
    vhost: VirtualHost,
    exchange_name: str,
    routing_key: str,
    message: BaseModel,
    message_type: str,
    sent: float,
    app_id: str,
) -> None:
    """Publish `message` as a transient JSON message through a built-in exchange (`""`:
    the default one), not on a passive (nothing is published there). A failure is logged,
    never raised: a status message never stops a link, a connection or the broker's work."""
    exchange = vhost.exchanges.get(exchange_name)
    if exchange is None or vhost.replica:
        return
    try:
        header, body = encode_status(message, message_type, sent, app_id)
        info = codec.decode_content_header(header)
        vhost.publish(exchange, routing_key, header, body, info, forward=False, admission="news")
    except Exception as exc:
        where = exchange_name or f"queue {routing_key}"
        log.warning("%s: a %s message was not published: %r", where, message_type, exc)


def encode_status(
    message: BaseModel, message_type: str, sent: float, app_id: str
) -> tuple[bytes, bytes]:
    """(content header payload, body) of a transient JSON status message."""
    body = message.model_dump_json().encode()
    properties = commands.Basic.Properties(
        content_type="application/json",
        delivery_mode=1,
        message_type=message_type,
        timestamp=datetime.fromtimestamp(int(sent), UTC),
        app_id=app_id,
    )
    return codec.encode_header_payload(properties, len(body)), body


def encode(event: PeerEvent) -> tuple[bytes, bytes]:
    """(content header payload, body) of `event` as `publish` sends it (a link sends its
    copy for the upstream's amq.peer so)."""
    return encode_status(event, event.event, event.time, "twinmq-federation")


def now() -> float:
    """The time an event carries."""
    return time.time()
