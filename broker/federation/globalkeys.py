"""Global routing keys (seed 002, "Global Message Routing"): request-response across sites.

An internal routing key, one a server makes for its own use, is `<server id><sep><local
name>`: server ids are unique across a federation (a duplicate is refused at every
handshake), so the key is too. The internal keys are the names of this server's
**temporary queues** (exclusive or server-named), where replies go:

- a server-named queue is already `amq.gen-<server id><sep><token>`: its name is its key;
- an exclusive queue `Q` a client named itself has the key `<server id><sep>Q`.

On a federated exchange with `global-keys: true`:

1. each temporary queue a client declares here is **bound to the exchange under its key**
   (the binding goes upstream like any other, so a reply routed by that key comes back
   to this site), and the binding goes with the queue;
2. a message a client publishes here whose `reply-to` names one of this server's
   temporary queues by its local name gets **`reply-to` made global** (only that
   property changes; the content header is otherwise kept byte for byte), so the
   service at another site replies to a name that routes back here.

A reply on the default exchange (`basic_publish("", reply_to)`, as any RabbitMQ RPC
server answers) is routed by the server: here, a key with this server's prefix names the
local queue; upstream, a key some downstream's link queue is bound with goes to that
link queue (`Federation.reply_queues`).
"""

from __future__ import annotations

import logging

from twinmq.broker import codec
from twinmq.broker.errors import AMQPError
from twinmq.broker.queue import Queue
from twinmq.broker.vhost import VirtualHost

log = logging.getLogger(__name__)

REPLY_TO_FLAG = 0x0200
GENERATED_PREFIX = "amq.gen-"


class GlobalKeys:
    """This server's global keys and the federated exchanges that use them."""

    def __init__(
        self, server_id: str, separator: str, vhost: VirtualHost, exchanges: list[str]
    ) -> None:
        self.server_id = server_id
        self.separator = separator
        self.prefix = server_id + separator
        self.vhost = vhost
        self.exchanges = exchanges
        self.bound = 0  # temporary queues bound automatically (status)
        self.rewritten = 0  # reply-to made global (status)

    def key_of(self, queue: Queue) -> str | None:
        """The global key of a temporary queue of this server (None: not temporary)."""
        name = queue.name
        if name.startswith(GENERATED_PREFIX + self.prefix):
            return name  # server-named with this server's id: global already
        if queue.definition.exclusive or name.startswith(GENERATED_PREFIX):
            return self.prefix + name
        return None

    def queue_declared(self, queue: Queue) -> None:
        """Bind a new temporary queue to every global-keys exchange under its key."""
        key = self.key_of(queue)
        if key is None:
            return
        for exchange in self.exchanges:
            if exchange not in self.vhost.exchanges:
                continue
            try:
                self.vhost.bind(queue.name, exchange, key, {}, queue.owner)
            except AMQPError as exc:  # the queue's declare stands; the reply path does not
                log.warning(
                    "global keys: %s not bound to %s under %s: %s", queue.name, exchange, key, exc
                )
                continue
            self.bound += 1

    def rewrite(self, header: bytes) -> bytes:
        """`header` with its `reply-to` made global if it names a temporary queue here by
        its local name; else `header` itself (unchanged bytes)."""
        try:
            spans = codec.property_spans(header)
        except ValueError:
            return header  # refused or held further on, as any unreadable header
        span = spans.get(REPLY_TO_FLAG)
        if span is None:
            return header
        start, end = span
        try:
            reply_to = header[start + 1 : end].decode()
        except UnicodeDecodeError:
            return header
        queue = self.vhost.queues.get(reply_to)
        if queue is None:
            return header
        key = self.key_of(queue)
        if key is None or key == reply_to:
            return header
        encoded = key.encode()
        if len(encoded) > 255:
            return header  # cannot be a shortstr: left as the client set it
        self.rewritten += 1
        return codec.rebuild_header(header, {REPLY_TO_FLAG: bytes([len(encoded)]) + encoded})

    def local_queue(self, routing_key: str) -> str | None:
        """The temporary queue here that a global key with this server's prefix names."""
        if not routing_key.startswith(self.prefix):
            return None
        name = routing_key[len(self.prefix) :]
        queue = self.vhost.queues.get(name)
        if queue is None or self.key_of(queue) != routing_key:
            return None
        return name
