"""Real-client (pika) helpers: a connection that opts in to duplicate detection, reading a
queue empty."""

from __future__ import annotations

import pika

from twinmq.broker.connection import DEDUP_CLIENT_PROPERTY
from twinmq.testing.launcher import BrokerProcess


def opted_in(broker: BrokerProcess) -> pika.BlockingConnection:
    """A pika connection that opts in to duplicate detection, as twinmq.client does."""
    params = pika.URLParameters(broker.url)
    params.client_properties = {DEDUP_CLIENT_PROPERTY: True}
    return pika.BlockingConnection(params)


def drain(url: str, queue: str) -> list[bytes]:
    """basic.get (auto-ack) at the broker of `url` until `queue` is empty; the bodies in
    order."""
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    out = []
    while True:
        method, _props, body = ch.basic_get(queue, auto_ack=True)
        if method is None:
            break
        out.append(body)
    conn.close()
    return out
