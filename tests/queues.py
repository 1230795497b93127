"""Test helper: read a queue empty through a real client."""

from __future__ import annotations

import pika

from twinmq.broker.launcher import BrokerProcess


def drain(broker: BrokerProcess, queue: str) -> list[bytes]:
    """basic.get (auto-ack) until the queue is empty; the bodies in order."""
    conn = pika.BlockingConnection(pika.URLParameters(broker.url))
    ch = conn.channel()
    out = []
    while True:
        method, _props, body = ch.basic_get(queue, auto_ack=True)
        if method is None:
            break
        out.append(body)
    conn.close()
    return out
