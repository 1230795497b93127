"""Dead-lettering: the `x-death` rewrite and RabbitMQ's cycle rule, as pure functions.

The rewrite touches two properties of the content header and copies every other
one byte for byte: the `headers` table gets the new `x-death` entry (and the
`x-first-death-*` fields the first time), and `expiration` is removed so the
message does not expire again where it lands (both as RabbitMQ does). The
table is read and written with the lossless `fieldtable` codec, so odd values
elsewhere in the headers (timestamps beyond year 9999, decimals, byte arrays,
arrays of tables) pass through untouched.

`x-death` belongs to the broker. Whatever a publisher put there is handled:
entries that are tables are matched by `queue` and `reason` (a `count` that is
not an integer restarts at 1); other elements are kept as they are; an `x-death`
that is not an array at all is replaced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

from twinmq.broker import fieldtable
from twinmq.broker.codec import decode_headers, rebuild_header
from twinmq.broker.fieldtable import Array, Table, Value, as_int, as_text

DeathReason = Literal["expired", "maxlen", "rejected"]

HEADERS_FLAG: Final = 0x2000
EXPIRATION_FLAG: Final = 0x0100
_COUNT_MAX: Final = 2**63 - 1


@dataclass(frozen=True, slots=True)
class DeadLettered:
    """A dead-lettered message's new content header and its headers table."""

    header: bytes
    headers: Table


def dead_letter_header(
    header: bytes,
    *,
    queue: str,
    reason: DeathReason,
    exchange: str,
    routing_key: str,
    now: int,
) -> DeadLettered:
    """Rewrite a content header for dead-lettering from `queue` for `reason`.

    Raises `ValueError` when the header or its table cannot be decoded (a header
    that never passed this broker's publish checks); the caller then forwards the
    header unchanged.
    """
    headers = decode_headers(header)
    previous = headers.get("x-death")
    deaths: list[Value] = list(previous.items) if isinstance(previous, Array) else []
    for index, death in enumerate(deaths):
        if (
            isinstance(death, Table)
            and as_text(death.get("queue")) == queue
            and as_text(death.get("reason")) == reason
        ):
            count = as_int(death.get("count"))
            count = count + 1 if count is not None and 0 <= count < _COUNT_MAX else 1
            updated = Table((("count", fieldtable.long_int(count)), *death.without("count").items))
            # The latest death goes first, as RabbitMQ orders them.
            del deaths[index]
            deaths.insert(0, updated)
            break
    else:
        deaths.insert(
            0,
            Table(
                (
                    ("count", fieldtable.long_int(1)),
                    ("reason", fieldtable.text(reason)),
                    ("queue", fieldtable.text(queue)),
                    ("time", fieldtable.timestamp(max(0, now))),
                    ("exchange", fieldtable.text(exchange)),
                    ("routing-keys", Array((fieldtable.text(routing_key),))),
                )
            ),
        )
    items: list[tuple[str, Value]] = []
    placed = False
    for key, value in headers.items:
        if key == "x-death":
            if not placed:
                items.append((key, Array(tuple(deaths))))
                placed = True
            continue
        items.append((key, value))
    if not placed:
        items.append(("x-death", Array(tuple(deaths))))
    for key, first in (
        ("x-first-death-queue", queue),
        ("x-first-death-reason", reason),
        ("x-first-death-exchange", exchange),
    ):
        if headers.get(key) is None:
            items.append((key, fieldtable.text(first)))
    table = Table(tuple(items))
    rewritten = rebuild_header(
        header, {HEADERS_FLAG: fieldtable.encode_table(table), EXPIRATION_FLAG: None}
    )
    return DeadLettered(rewritten, table)


def is_cycle(headers: Table, target: str) -> bool:
    """Whether dead-lettering into `target` closes a cycle no client took part in.

    RabbitMQ's rule: walking `x-death` from the latest death back to the last death
    in `target`, no death was a rejection. Such a message would circle forever
    (an expiry or a length limit on every lap), so it is dropped for that target.
    """
    deaths = headers.get("x-death")
    if not isinstance(deaths, Array):
        return False
    for death in deaths.items:
        if not isinstance(death, Table):
            continue
        if as_text(death.get("reason")) == "rejected":
            return False
        if as_text(death.get("queue")) == target:
            return True
    return False
