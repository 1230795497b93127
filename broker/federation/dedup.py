"""The receiving side's durable dedup window: (origin, seq) keys already republished.

One window per server, shared by all its links: a message that reaches this server by
two paths (a triangle, a diamond) carries the same key on both and is republished once.
A key is *claimed* while its republish is in flight, so the other path's copy is dropped
then too; if the republish fails, the claim is released and the first path's upstream
re-delivers it (never acknowledged), so dropping the second copy loses nothing.

Durability, as the mirror's applied mark: the keys of a batch of republished messages
are one record (a message) of the internal queue `amq.twinmq.federation-dedup`, journaled
**in the same group commit** as the messages themselves (`record` is called in the same
turn of the event loop as their publishes). After a crash either both are on disk or
neither; the pair's passive receives the record like any op, so a promoted passive knows
the keys too. The window is rebuilt from the queue's records at every activation
(`load`); the oldest records are settled once the window holds more keys than its size.

**A lagging path holds its keys, a bit each.** A path into this server can lag another
by far more keys than the window holds (the topology runs at a million messages back their
link queues up by 100,000s; a link down a while), and a window that had forgotten the
first copy's key when the late copy came delivered it twice. Each link tells the window
how far it has got per origin (`passed`: the highest seq of that origin it brought, copies
dropped included); a key older than the newest `size` is forgotten only once **every link
of the server** has passed its seq: any link may bring any origin's messages (in a mesh a
link carries on an origin's message only when its upstream got that one first by the
link's own path, i.e. now and then), so a link that has brought nothing of an origin yet,
or not since a restart, has passed none of it. Until then the key moves to its origin's
bitmap (`SeqBits`): one bit per seq from a floor, the lowest mark of the links, which
rises as they pass it, so memory follows the span of seqs the slowest link lags by, not
the number of keys (~150 bytes a key in the dictionary, ~4-5 bits a key in a mesh of
four whose seqs interleave with its other messages' IDs). Along one link an origin's
messages come in seq order (queues are FIFO, the first copies at an upstream of two
in-order paths are in order too, and the link consumes exclusively, so a cut's
unacknowledged deliveries come back before anything newer), so a link that has passed a
seq brings no copy of it later, save a re-delivery after a cut (its ack lost) or a
reordering within a few batches: a link's mark is in force only once it has brought 4
prefetch windows (at least 4,096 keys) more, and those come before that.

**What the upstream tells** (marks.py): per origin, how far it will ever forward on the
link (`Told`): the link's mark for an origin it never brings (a diamond's other path)
rises with it, held below what the link brought that may still come again (`_recent`:
its last `delay` keys, unless told settled for good upstream). `tell` is the other side:
what this server tells its own downstreams, the lowest mark of its links.

Bounded still, and exact within the bound: past `size * SPAN` bits of span (~1.2 KB per
key of the window, the memory the former 10x stretch of keys took, but a span of seqs
10,000 times the window), the widest origin's oldest seqs are forgotten whatever lags (a
link down for good; a link that never brings some origin and whose upstream tells no
marks holds that origin's floor at its start), counted in `forced`. Forgetting never
loses a message, it can only let a copy through. The bitmaps are journaled as snapshot
records (one line per origin) that replace the key records they cover, taken every
`size` keys or so (rarer as they grow: ~4 bytes journaled per key); the marks are not:
after a restart or a promotion every link has passed nothing, which keeps more, never
fewer.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict, deque
from typing import Final, NamedTuple, Protocol

from twinmq.broker.federation import metrics
from twinmq.broker.federation.seqbits import SeqBits
from twinmq.broker.journal import JournalOp, Settle, StoredMessage
from twinmq.broker.message import Entry, Message
from twinmq.broker.mirror.events import INTERNAL_PREFIX, INTERNAL_QID_BASE, record_header
from twinmq.broker.queue import Queue

log = logging.getLogger(__name__)

QUEUE_NAME: Final = INTERNAL_PREFIX + "federation-dedup"
# Federation's internal qids start at +0x100, clear of the mirror's (+1 ... +4 and the
# marks'); tests/test_federation_units.py checks that no two internal queues share one.
QUEUE_QID: Final = INTERNAL_QID_BASE + 0x100
# The bound of the compacted keys: `SPAN` bits (seqs of span) per key of the window, i.e.
# ~1.2 KB per key: the memory the former 10x stretch of ~150-byte keys allowed, for a
# span of seqs 10,000 times the window instead of 10 times.
SPAN: Final = 10_000
# A record whose body starts so is a snapshot of the compacted keys, one origin a line.
SNAPSHOT: Final = "\x01lagged"
# A mark above every seq: a link that never brings an origin (another vhost's keys; an
# upstream that tells it never forwards it).
_NEVER: Final = 2**63 - 1


class KeyStore(Protocol):
    """What the window needs of the virtual host."""

    next_mid: int

    def internal_queue(self, name: str, qid: int, *, locked: bool = True) -> Queue:
        """A durable queue of the broker's own, made if missing."""
        ...


def scoped(vhost: str, key: str) -> str:
    """`key` (an `origin\\0seq` key, or a held message's) as the window keeps it for the
    local vhost `vhost`: unchanged in `/` (the keys before vhosts, byte for byte); in
    another vhost its origin becomes the JSON list [vhost, origin] (a held key: [vhost,
    key]), so one message federated into two vhosts (two tenants' exchanges) is two keys
    and neither copy is taken for the other's duplicate. JSON escapes NUL, so the result
    still splits at its last NUL into (scoped origin, seq) and the bitmaps keep one
    origin per vhost.

    The origin is the message's header, which a client can set: a `/` origin spelling
    another vhost's scoped one (`["t1", "central"]`) would reach into that vhost's keys
    and suppress its messages. So a `/` origin that starts with `[` (no server id a
    deployment uses does) is scoped as `["/", origin]`: every (vhost, origin) maps to its
    own key."""
    named = _origin_seq(key)
    if vhost == "/" and (named is None or not named[0].startswith("[")):
        return key
    if named is None:
        return json.dumps([vhost, key])
    return f"{json.dumps([vhost, named[0]])}\x00{named[1]}"


def scoped_origin(vhost: str, origin: str) -> str:
    """`origin` as `scoped` spells it in the keys of vhost `vhost`."""
    return scoped(vhost, f"{origin}\x000").rpartition("\x00")[0]


def scope_of(origin: str) -> str:
    """The vhost of a scoped origin (the inverse of `scoped_origin`'s vhost)."""
    if not origin.startswith("["):
        return "/"
    try:
        named = json.loads(origin)
    except ValueError:
        return "/"
    if isinstance(named, list) and len(named) == 2 and isinstance(named[0], str):
        return named[0]
    return "/"


def unscoped_origin(origin: str) -> str:
    """The origin (a server id) of a scoped origin."""
    if not origin.startswith("["):
        return origin
    try:
        named = json.loads(origin)
    except ValueError:
        return origin
    if isinstance(named, list) and len(named) == 2 and isinstance(named[1], str):
        return named[1]
    return origin


def _origin_seq(key: str) -> tuple[str, int] | None:
    """(origin, seq) of a key made by `headers.arrival`; None for another kind (held)."""
    origin, sep, seq = key.rpartition("\x00")
    if not sep or not seq.isdigit():
        return None
    return origin, int(seq)


class Told(NamedTuple):
    """What an upstream told a link in a batch (marks.py `ToldMarks`, origins scoped)."""

    marks: dict[str, int]
    others: int = -1
    acked: int = -1


class LagWindow:
    """The newest `size` keys, and, compacted to a bit per seq (`SeqBits`), the older ones
    some link may still bring (it has not passed them), within `size * SPAN` bits."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._keys: OrderedDict[str, None] = OrderedDict()
        # origin -> its keys older than the newest `size` that a lagging link may bring.
        self.lagged: dict[str, SeqBits] = {}
        # link -> origin -> the highest seq of that origin the link has passed for good.
        self._passed: dict[str, dict[str, int]] = {}
        # link -> (keys brought up to that batch, origin -> (lowest, highest) seq brought):
        # marks not in force yet.
        self._pending: dict[str, deque[tuple[int, dict[str, tuple[int, int]]]]] = {}
        self._brought: dict[str, int] = {}  # link -> keys brought
        # link -> (keys brought up to that batch, session, its highest delivery tag,
        # origin -> lowest seq): what may come again (a cut's re-deliveries), which a
        # told mark must not pass; dropped `delay` keys later or once told settled.
        self._recent: dict[str, deque[tuple[int, int, int, dict[str, int]]]] = {}
        # Every link of the server: each may bring any origin's messages, so each is
        # waited for, whether it has brought that origin yet or not.
        self._links: set[str] = set()
        # link -> the vhost whose keys it brings (keys are scoped by the link's local
        # vhost, `scoped`): a link never brings another vhost's keys. Unknown: any.
        self._scope: dict[str, str] = {}
        # link -> what its upstream told this session (`ToldMarks`, marks.py): origin ->
        # seq, and the seq every other origin is told up to (-1: nothing told).
        self._told: dict[str, tuple[dict[str, int], int]] = {}
        # link -> origin -> the seq it has passed, told marks included (`_effective`); an
        # origin not named: `_others[link]`.
        self._marks: dict[str, dict[str, int]] = {}
        self._others: dict[str, int] = {}
        self.forced = 0  # keys forgotten at the bound while a link had not passed them

    def register(self, link: str, scope: str | None = None) -> None:
        """`link` is one of the server's links: the window waits for it from now on.
        `scope`: the local vhost it republishes into (it brings only that vhost's keys)."""
        self._links.add(link)
        if scope is not None:
            self._scope[link] = scope

    def __contains__(self, key: str) -> bool:
        if key in self._keys:
            return True
        named = _origin_seq(key)
        if named is None:
            return False
        bits = self.lagged.get(named[0])
        return bits is not None and named[1] in bits

    def __len__(self) -> int:
        return len(self._keys) + sum(len(bits) for bits in self.lagged.values())

    def newest(self, key: str) -> bool:
        """`key` is among the newest `size` (its record still holds it: not in a snapshot)."""
        return key in self._keys

    @property
    def lagged_bytes(self) -> int:
        """Memory of the compacted keys."""
        return sum(len(bits.bits) for bits in self.lagged.values())

    def add(self, key: str) -> None:
        """Remember a key; the oldest beyond the size go to the bitmaps if a link lags
        behind them, else are forgotten."""
        if not self.size:
            return
        self._keys[key] = None
        self._keys.move_to_end(key)
        self._forget()

    def add_lagged(self, origin: str, bits: SeqBits) -> None:
        """Merge a journaled snapshot of an origin's compacted keys (load)."""
        merged = self.lagged.setdefault(origin, SeqBits())
        self.forced += merged.union(bits, self.size * SPAN)
        self._bound()

    def passed(
        self,
        link: str,
        keys: list[str],
        delay: int = 0,
        told: Told | None = None,
        at: tuple[int, int] = (0, 0),
    ) -> None:
        """`link` brought these keys (republished or dropped as copies). Its marks count
        once it has brought `delay` more keys: what it delivered just before a cut comes
        again at the next session's start (its acks lost), and must still be known then;
        and a reordering within a few batches is passed by then.

        `told`: what its upstream told after these keys in the link's stream (marks.py):
        the link will never bring a seq at or below them that it has not brought already.
        In force at once, but never over a seq the link brought that may come again: one
        brought within the last `delay` keys and not known settled upstream for good
        (`Told.acked`). `at`: (session, highest delivery tag) of these keys."""
        marks: dict[str, tuple[int, int]] = {}
        for key in keys:
            named = _origin_seq(key)
            if named is None:
                continue
            origin, seq = named
            low, high = marks.get(origin, (seq, seq))
            marks[origin] = (min(low, seq), max(high, seq))
        self._links.add(link)
        passed = self._passed.setdefault(link, {})
        pending = self._pending.setdefault(link, deque())
        brought = self._brought[link] = self._brought.get(link, 0) + len(keys)
        pending.append((brought, marks))
        while pending and brought - pending[0][0] >= delay:
            for origin, (_low, seq) in pending.popleft()[1].items():
                passed[origin] = max(passed.get(origin, -1), seq)
        recent = self._recent.setdefault(link, deque())
        if marks:
            recent.append((brought, at[0], at[1], {o: low for o, (low, _h) in marks.items()}))
        while recent and brought - recent[0][0] >= delay:
            recent.popleft()
        if told is not None:
            if told.acked >= 0:
                # Settled upstream for good: never delivered again.
                session = at[0]
                self._recent[link] = deque(
                    each for each in recent if each[1] == session and each[2] > told.acked
                )
            before, before_others = self._told.get(link, ({}, -1))
            merged = dict(before)
            for origin, seq in told.marks.items():
                merged[origin] = max(merged.get(origin, before_others), seq)
            # An origin named before and not now keeps what was told for it.
            self._told[link] = (merged, max(before_others, told.others))
        self._effective(link)
        for origin in list(self.lagged):
            # Every link has passed the seqs under the lowest mark: none brings them again.
            bits = self.lagged[origin]
            bits.trim(self.floor(origin) + 1)
            if not bits.count:
                del self.lagged[origin]
        self._forget()

    def told_reset(self, link: str) -> None:
        """A new session of `link`: what its upstream told before holds no more (an
        upstream restarted, failed over or reconfigured tells again from what it knows)."""
        self._told.pop(link, None)
        self._effective(link)

    def _effective(self, link: str) -> None:
        """The link's marks per origin: the ones in force (`passed`) and, over them, what
        its upstream told, held below the lowest seq it brought that may come again."""
        marks = dict(self._passed.get(link, {}))
        named, others = self._told.get(link, ({}, -1))
        lowest: dict[str, int] = {}
        for _brought, _session, _tag, lows in self._recent.get(link, ()):
            for origin, low in lows.items():
                lowest[origin] = min(lowest.get(origin, low), low)
        named = dict(named)
        if others >= 0:
            # Every origin the link has marks for is named, so that `others` counts for it
            # too, and never over what the link brought lately (`lowest`).
            for origin in [*marks, *lowest]:
                named.setdefault(origin, others)
        for origin, seq in named.items():
            held = min(seq, lowest.get(origin, seq + 1) - 1)
            if held > marks.get(origin, -1):
                marks[origin] = held
        self._marks[link] = marks
        self._others[link] = others

    def mark(self, link: str, origin: str) -> int:
        """The seq of `origin` (scoped) `link` has passed, told marks included: it brings
        no copy at or below it later. Infinite for another vhost's origin."""
        scope = self._scope.get(link)
        if scope is not None and scope_of(origin) != scope:
            return _NEVER
        marks = self._marks.get(link)
        if marks is None:
            return -1
        seq = marks.get(origin)
        return self._others.get(link, -1) if seq is None else seq

    def floor(self, origin: str) -> int:
        """The lowest mark of the server's links for `origin`: no link brings a seq at or
        below it later."""
        return min((self.mark(link, origin) for link in self._links), default=_NEVER)

    def tell(self, scope: str) -> tuple[dict[str, int], int]:
        """What this server can tell a downstream of its link queue in vhost `scope`
        about the origins its links bring (marks.py): scoped origin -> the floor, and the
        floor of every origin not named (`_NEVER` with no link into `scope`: none but
        this server's own messages enter it, forwards aside, see `Federation.told_marks`)."""
        links = [link for link in self._links if self._scope.get(link, scope) == scope]
        origins: set[str] = set()
        for link in links:
            origins.update(o for o in self._marks.get(link, {}) if scope_of(o) == scope)
        named = {origin: min(self.mark(link, origin) for link in links) for origin in origins}
        others = min((self._others.get(link, -1) for link in links), default=_NEVER)
        return named, others

    def _forget(self) -> None:
        keys = self._keys
        while len(keys) > self.size:
            oldest, _ = keys.popitem(last=False)
            named = _origin_seq(oldest)
            if named is not None and self._awaited(*named):
                bits = self.lagged.setdefault(named[0], SeqBits())
                self.forced += bits.add(named[1], self.size * SPAN)
        self._bound()

    def _bound(self) -> None:
        """Past `size * SPAN` bits, the widest origin's oldest eighth is forgotten."""
        lagged = self.lagged
        budget = self.size * SPAN
        while lagged and sum(bits.span for bits in lagged.values()) > budget:
            origin, bits = max(lagged.items(), key=lambda item: item[1].span)
            self.forced += bits.trim(bits.base + max(bits.span // 8, 8))
            if not bits.count:
                del lagged[origin]

    def _awaited(self, origin: str, seq: int) -> bool:
        """Some link of the server has not passed `seq` of `origin` yet."""
        return any(self.mark(link, origin) < seq for link in self._links)


class DurableKeys:
    """A bounded window of keys whose records ride in the republished messages' commits."""

    def __init__(self, size: int) -> None:
        self.window = LagWindow(size)
        self.claimed: set[str] = set()
        # (mid, its keys; None: a snapshot of the compacted keys), oldest first.
        self._records: deque[tuple[int, list[str] | None]] = deque()
        self._recorded = 0  # keys in the queue's key records
        self._forced = 0  # the window's `forced` already counted in the metric
        # Key records made and not yet held for their batch (`fresh`).
        self._fresh: list[tuple[Queue, Entry]] = []

    def __contains__(self, key: str) -> bool:
        return key in self.claimed or key in self.window

    def __len__(self) -> int:
        return len(self.window)

    def register(self, link: str, scope: str | None = None) -> None:
        """`link` is one of the server's links; see `LagWindow.register`."""
        self.window.register(link, scope)

    def load(self, store: KeyStore) -> None:
        """Rebuild the window from the queue's records (start-up, promotion): snapshots
        and key records in journal order (a snapshot holds what older records held)."""
        queue = store.internal_queue(QUEUE_NAME, QUEUE_QID)
        self._records.clear()
        self._recorded = 0
        for entry in queue.entries:
            snapshot = _snapshot(entry.message.body)
            if snapshot is not None:
                for origin, bits in snapshot.items():
                    self.window.add_lagged(origin, bits)
                self._records.append((entry.message.mid, None))
                continue
            keys = _keys(entry.message.body)
            for key in keys:
                self.window.add(key)
            self._records.append((entry.message.mid, keys))
            self._recorded += len(keys)
        self._count_forced()

    def claim(self, key: str) -> None:
        """A republish of `key` is in flight: copies of it are duplicates meanwhile."""
        self.claimed.add(key)

    def record(self, store: KeyStore, keys: list[str]) -> list[JournalOp]:
        """The ops that journal `keys` (one record) and settle records no longer needed;
        for the caller to add to the group commit of the messages they name."""
        if not keys:
            return []
        queue = store.internal_queue(QUEUE_NAME, QUEUE_QID)
        # The queue's own qid: a queue made by an earlier version may carry another one.
        qid = queue.definition.qid
        stored, entry = self._append(store, queue, "\n".join(keys).encode())
        self._fresh.append((queue, entry))
        ops: list[JournalOp] = [stored]
        self._records.append((stored.mid, keys))
        self._recorded += len(keys)
        window = self.window
        settled: list[int] = []
        if not window.lagged:
            # Nothing compacted: the records of the newest `size` keys are enough (and
            # an older snapshot says nothing any more).
            # A record whose batch is still in flight stays (else a crash after its
            # commit forgets its keys), and the newer ones behind it.
            records = self._records
            while len(records) > 1 and (
                records[0][1] is None
                or (
                    self._recorded - len(records[0][1]) >= window.size
                    and not any(key in self.claimed for key in records[0][1])
                )
            ):
                mid, old = records.popleft()
                self._recorded -= len(old) if old is not None else 0
                settled.append(mid)
        elif self._recorded >= max(2 * window.size, window.lagged_bytes // 4):
            # A snapshot of the compacted keys replaces the records whose keys are all
            # compacted or forgotten (not among the newest, not in flight). Taken once per
            # `size` keys or so, and rarer as the bitmaps grow: ~4 bytes journaled a key.
            body = "\n".join(
                [SNAPSHOT]
                + [f"{origin}\x00{bits.encode()}" for origin, bits in window.lagged.items()]
            ).encode()
            snapshot, _ = self._append(store, queue, body)
            ops.append(snapshot)
            kept: deque[tuple[int, list[str] | None]] = deque()
            for mid, old in self._records:
                if mid == stored.mid:  # this batch's: its keys enter the window later
                    kept.append((mid, old))
                elif old is None or not any(
                    key in self.claimed or window.newest(key) for key in old
                ):
                    self._recorded -= len(old) if old is not None else 0
                    settled.append(mid)
                else:
                    kept.append((mid, old))
            kept.append((snapshot.mid, None))
            self._records = kept
        for mid in settled:
            ops.append(Settle(qid, mid))
            queue.remove_mid(mid)
        return ops

    def _append(self, store: KeyStore, queue: Queue, body: bytes) -> tuple[StoredMessage, Entry]:
        """A record: its journal op and its entry, in the internal queue now."""
        mid = store.next_mid
        store.next_mid += 1
        header = record_header(len(body))
        entry = Entry(Message(mid, "", QUEUE_NAME, header, body, True, None, None), None, True)
        queue.entries.append(entry)
        queue.bytes += len(body)
        stored = StoredMessage(mid, queue.definition.qid, "", QUEUE_NAME, header, body, None)
        return stored, entry

    def fresh(self) -> list[tuple[Queue, Entry]]:
        """The key records `record` made since the last call: for the caller to hold with
        their batch (`Visibility.hold`), so that a failed batch's record is withdrawn with
        it, here and from a passive that applied it (`Visibility.withdraw`). Kept, it held
        keys of messages that were never taken: a passive promoted (or a catch-up from
        this memory) loaded them into the window, and the re-delivery of such a message
        was dropped as a duplicate, acknowledged, lost. (A snapshot holds only keys of
        complete batches: kept.)"""
        fresh, self._fresh = self._fresh, []
        return fresh

    def settle(self, durable: list[str], failed: list[str]) -> None:
        """The batch is complete: its keys enter the window; a failed batch's are released
        (its messages are re-delivered by their upstream)."""
        for key in durable:
            self.window.add(key)
        self.claimed.difference_update(durable)
        self.claimed.difference_update(failed)
        self._count_forced()

    def passed(
        self,
        link: str,
        keys: list[str],
        delay: int = 0,
        told: Told | None = None,
        at: tuple[int, int] = (0, 0),
    ) -> None:
        """`link` brought these keys (republished or dropped as copies), and its upstream
        told `told` after them; see `LagWindow.passed`."""
        self.window.passed(link, keys, delay, told, at)
        self._count_forced()

    def told_reset(self, link: str) -> None:
        """A new session of `link`; see `LagWindow.told_reset`."""
        self.window.told_reset(link)

    def _count_forced(self) -> None:
        forced = self.window.forced - self._forced
        if not forced:
            return
        if not self._forced:
            # Once: the bound is reached for as long as some link lags for good (or never
            # brings some origin, as a diamond's), and every key then would log.
            log.warning(
                "federation: the dedup window's lagged keys span %d seqs (%d times "
                "dedup-window) while a link had not passed the oldest: forgetting them (a "
                "copy that link brings later is delivered again); counted in %s",
                self.window.size * SPAN, SPAN, "twinmq_federation_dedup_forced_total",
            )  # fmt: skip
        self._forced = self.window.forced
        metrics.DEDUP_FORCED.inc(forced)


def _keys(body: bytes) -> list[str]:
    return body.decode("utf-8", "replace").split("\n") if body else []


def _snapshot(body: bytes) -> dict[str, SeqBits] | None:
    """The origins' compacted keys of a snapshot record; None for a key record."""
    text = body.decode("utf-8", "replace")
    if not text.startswith(SNAPSHOT):
        return None
    snapshot: dict[str, SeqBits] = {}
    for line in text.split("\n")[1:]:
        origin, sep, encoded = line.rpartition("\x00")
        bits = SeqBits.decode(encoded) if sep else None
        if bits is not None:
            snapshot[origin] = bits
    return snapshot
