"""`x-overflow: reject-publish-dlx` dead-letters what its length limit refuses, on every
way a message meets the limit: a client's publish (all or nothing), a federation link's
delivery and the broker's own status messages (each queue alone). The real-client view
is `tests/test_pika.py`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pamqp import commands
from pamqp.header import ContentHeader

from twinmq.broker.codec import decode_content_header, decode_headers
from twinmq.broker.fieldtable import to_python
from twinmq.broker.vhost import Admission, VirtualHost
from twinmq.testing.sansio import Harness

OWNER = object()


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Harness]:
    harness = Harness(tmp_path)
    try:
        yield harness
    finally:
        harness.close()


def declare(vhost: VirtualHost, name: str, **arguments: Any) -> None:
    vhost.declare_queue(
        name, passive=False, durable=True, exclusive=False, auto_delete=False,
        arguments=arguments, owner=OWNER,
    )  # fmt: skip


def publish(
    vhost: VirtualHost, queue: str, body: bytes, admission: Admission, *, with_id: bool = True
) -> bool:
    """Publish `body` persistently to `queue` by the default exchange (its message id the
    body, `with_id`); whether refused."""
    message_id = body.decode() if with_id else None
    header = ContentHeader(
        0, len(body), commands.Basic.Properties(delivery_mode=2, message_id=message_id)
    ).marshal()
    info = decode_content_header(header)
    result = vhost.publish(
        vhost.exchanges[""], queue, header, body, info, forward=False, admission=admission
    )
    return result.rejected


def contents(vhost: VirtualHost, queue: str) -> list[tuple[bytes, Any]]:
    """(body, x-first-death-reason) of each message in `queue`."""
    return [
        (e.message.body, to_python(decode_headers(e.message.header)).get("x-first-death-reason"))
        for e in vhost.queues[queue].entries
    ]


@pytest.mark.parametrize("admission", ["publish", "link", "news"])
@pytest.mark.parametrize("overflow", ["reject-publish-dlx", "reject-publish"])
def test_a_refused_message_is_dead_lettered_exactly_when_the_queue_says_dlx(
    harness: Harness, admission: Admission, overflow: str
) -> None:
    vhost = harness.vhost
    declare(vhost, "dlq")
    declare(
        vhost, "full", **{"x-max-length": 1, "x-overflow": overflow,
        "x-dead-letter-exchange": "", "x-dead-letter-routing-key": "dlq"},
    )  # fmt: skip
    assert not publish(vhost, "full", b"first", admission)
    assert publish(vhost, "full", b"second", admission)
    harness.commit()
    assert contents(vhost, "full") == [(b"first", None)]
    dead = [(b"second", "maxlen")] if overflow == "reject-publish-dlx" else []
    assert contents(vhost, "dlq") == dead


@pytest.mark.parametrize("admission", ["publish", "link", "news"])
def test_a_full_queue_dead_lettering_into_itself_refuses_once_and_keeps_nothing(
    harness: Harness, admission: Admission
) -> None:
    """Its dead-letter exchange routes back into it: the copy, its x-death naming the
    queue, is dropped as a cycle rather than dead-lettered again. (Without a message id:
    with one, the copy under the publish's own exchange and key is not made at all, the
    last test.)"""
    vhost = harness.vhost
    declare(
        vhost, "loop", **{"x-max-length": 1, "x-overflow": "reject-publish-dlx",
        "x-dead-letter-exchange": ""},
    )  # fmt: skip
    assert not publish(vhost, "loop", b"first", admission)
    assert publish(vhost, "loop", b"second", admission, with_id=False)
    harness.commit()
    assert contents(vhost, "loop") == [(b"first", None)]


def test_a_refused_publish_is_not_dead_lettered_under_its_own_exchange_and_key(
    harness: Harness,
) -> None:
    """The dead-letter exchange is the publish's own, with its routing key: a copy stored
    there would put the publish's dedup key in the window at the next start, and the
    deduplicating publisher's re-send, which the nack asks for, would be taken as a
    duplicate without reaching the full queue. Such a copy is not made."""
    vhost = harness.vhost
    vhost.declare_exchange(
        "fan", "fanout", passive=False, durable=True, auto_delete=False, internal=False,
        arguments={},
    )  # fmt: skip
    declare(vhost, "other")
    declare(
        vhost, "full", **{"x-max-length": 1, "x-overflow": "reject-publish-dlx",
        "x-dead-letter-exchange": "fan"},
    )  # fmt: skip
    for queue in ("other", "full"):
        vhost.bind(queue, "fan", "", {}, OWNER)
    assert not publish(vhost, "full", b"first", "publish")
    header = ContentHeader(
        0, 1, commands.Basic.Properties(delivery_mode=2, message_id="resent")
    ).marshal()
    result = vhost.publish(vhost.exchanges["fan"], "", header, b"x", decode_content_header(header))
    harness.commit()
    assert result.rejected
    assert contents(vhost, "other") == []
