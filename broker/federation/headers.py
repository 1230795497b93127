"""What a federated message carries, and what a downstream does with it (sans-I/O).

Headers (all set by TwinMQ, never by clients in normal use):

- `x-twinmq-origin`: the server identifier where the message was first published;
- `x-twinmq-origin-seq`: its replication ID there (unique and increasing across
  restarts and pair failovers, docs/replication.md), so (origin, seq) names one
  message across the whole topology: the dedup key;
- `x-twinmq-federation-path`: the servers it has been on, oldest first.

The upstream stamps origin and seq as it delivers to a federation link, when the
message has none yet (`stamp_origin`); a downstream appends the link's upstream and
itself to the path as it republishes (`arrival`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from twinmq.broker import codec, fieldtable

ORIGIN = "x-twinmq-origin"
ORIGIN_SEQ = "x-twinmq-origin-seq"
PATH = "x-twinmq-federation-path"
HEADERS_FLAG = 0x2000  # the `headers` property's flag bit


def stamp_origin(header: bytes, server_id: str, mid: int) -> bytes:
    """The content header with origin and seq added if it has none (upstream side).

    Every other property is copied byte for byte; a header the broker cannot walk
    (it checked it at publish, so only a bug) goes out unchanged.
    """
    try:
        table = codec.decode_headers(header)
    except ValueError:
        return header
    if table.get(ORIGIN) is not None:
        return header
    items = (
        *table.items,
        (ORIGIN, fieldtable.text(server_id)),
        (ORIGIN_SEQ, fieldtable.long_int(mid)),
    )
    encoded = fieldtable.encode_table(fieldtable.Table(items))
    return codec.rebuild_header(header, {HEADERS_FLAG: encoded})


MARK = b"x-twinmq-"  # in a content header's bytes: one of the headers above may be there


def strip_federation(header: bytes) -> bytes:
    """The content header without origin, seq and path (a client's publish).

    Only a federation link may carry them: the upstream stamps a message's origin only
    when it has none, and a downstream trusts (origin, seq) as the dedup key, so a client
    that set them could claim the keys of another publisher's next messages (their ids
    are the broker's, in order) and have those dropped downstream as duplicates
    (`tests/test_vhost_attacks2.py`). A client re-publishing a federated message makes a
    new one. Every other property is copied byte for byte.
    """
    try:
        table = codec.decode_headers(header)
    except ValueError:
        return header
    kept = tuple((k, v) for k, v in table.items if k not in (ORIGIN, ORIGIN_SEQ, PATH))
    if len(kept) == len(table.items):
        return header
    encoded = fieldtable.encode_table(fieldtable.Table(kept)) if kept else None
    return codec.rebuild_header(header, {HEADERS_FLAG: encoded})


Verdict = Literal["forward", "loop", "too-many-hops", "unstamped"]


@dataclass(frozen=True, slots=True)
class Arrival:
    """What a downstream decides for one delivery from its upstream."""

    verdict: Verdict
    dedup_key: str | None
    path: list[str]  # the path to republish with (this server last) when forwarded


def arrival(
    headers: dict[str, Any] | None, upstream_id: str, own_id: str, max_hops: int
) -> Arrival:
    """Decide on a delivery: forward it, or drop it as a loop or past `max-hops`.

    `headers`: the delivery's headers as the client library decoded them.
    """
    headers = headers or {}
    origin = _text(headers.get(ORIGIN))
    seq = headers.get(ORIGIN_SEQ)
    raw_path = headers.get(PATH)
    path = [_text(p) or "" for p in raw_path] if isinstance(raw_path, list) else []
    if not path or path[-1] != upstream_id:
        path.append(upstream_id)
    if origin is None or not isinstance(seq, int):
        return Arrival("unstamped", None, path)
    key = f"{origin}\x00{seq}"
    if own_id in path:
        return Arrival("loop", key, path)
    if len(path) > max_hops:
        return Arrival("too-many-hops", key, path)
    return Arrival("forward", key, [*path, own_id])


def _text(value: Any) -> str | None:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value if isinstance(value, str) else None


@dataclass(frozen=True, slots=True)
class Departure:
    """What a downstream decides for one message it would forward to its upstream."""

    verdict: Literal["forward", "loop", "too-many-hops"]
    header: bytes  # the content header to send (origin stamped, path extended) if forwarded


def departure(header: bytes, own_id: str, mid: int, upstream_id: str, max_hops: int) -> Departure:
    """Forwarding (downstream -> upstream): stamp origin and seq if the message has none
    (it was published here: this server and its replication ID), extend the path with
    this server and the upstream (the receiving side appends nothing: the path already
    ends with it, as a republished message's does), or refuse a loop / too many hops.

    Raises ValueError if the header's table cannot be walked or rebuilt (past the bounds).
    """
    table = codec.decode_headers(header)
    raw_path = table.get(PATH)
    values = raw_path.items if isinstance(raw_path, fieldtable.Array) else ()
    path = [_text(fieldtable.to_python(v)) or "" for v in values]
    if not path or path[-1] != own_id:
        path.append(own_id)
    if upstream_id in path:
        return Departure("loop", header)
    path.append(upstream_id)
    if len(path) - 1 > max_hops:
        return Departure("too-many-hops", header)
    items = list(table.without(PATH).items)
    if table.get(ORIGIN) is None:
        items += [(ORIGIN, fieldtable.text(own_id)), (ORIGIN_SEQ, fieldtable.long_int(mid))]
    items.append((PATH, fieldtable.Array(tuple(fieldtable.text(hop) for hop in path))))
    encoded = fieldtable.encode_table(fieldtable.Table(tuple(items)))
    return Departure("forward", codec.rebuild_header(header, {HEADERS_FLAG: encoded}))


def forwarded(headers: dict[str, Any] | None, own_id: str) -> Arrival:
    """Upstream side: decide on a message a downstream forwarded (its path ends here).

    A loop if this server is earlier on the path; its dedup key from origin and seq.
    """
    headers = headers or {}
    origin = _text(headers.get(ORIGIN))
    seq = headers.get(ORIGIN_SEQ)
    raw_path = headers.get(PATH)
    path = [_text(p) or "" for p in raw_path] if isinstance(raw_path, list) else []
    if origin is None or not isinstance(seq, int):
        return Arrival("unstamped", None, path)
    key = f"{origin}\x00{seq}"
    if own_id in path[:-1]:
        return Arrival("loop", key, path)
    return Arrival("forward", key, path)
