"""Duplicate detection by message id (as Artemis does with its duplicate-id cache).

A publisher that sets `message_id` and re-sends after a failover or a lost
confirm does not create a second copy while the id is in the window: the
re-send is confirmed and dropped. The key is the publish itself (exchange,
routing key and message id), so a worker that forwards a consumed message,
properties and all, to another destination is not mistaken for a re-send.
The window holds the newest `size` keys; the passive builds the same window
from the replication stream and from the active's window, which every
catch-up carries after its messages (docs/replication.md, "Duplicates"), and a
snapshot file (rewritten every few seconds, and at shutdown) carries it over
restarts together with the keys of the messages recovered from the journal.
The known gap: keys added in the last few seconds before a crash whose
messages were also consumed since.

A key enters the window only once its message is enqueued *and* durable (its
group-commit batch complete): a publish that was returned (unroutable), nacked
(a full queue, a failed write), rolled back or whose transaction failed leaves
no key, so its re-send is a new message, enqueued and confirmed. A re-send that
races its original's batch is not dropped either (the original may still fail):
it is not enqueued again: its confirm waits for the original's batch and shares its
outcome (positive once the original is durable, a nack if its write failed, and the
publisher re-sends), so a publisher that re-sends at once after a failover, while
the new active's replicated batches still wait, creates no duplicate.
"""

from __future__ import annotations

import json
from collections import OrderedDict, deque
from pathlib import Path

from twinmq.broker.atomicfile import replace_file, sync_dir

ROOT_SCOPE = "/"


def dedup_key(exchange: str, routing_key: str, message_id: str) -> str:
    """What identifies a publish in the vhost `/` for duplicate detection."""
    return f"{exchange}\x00{routing_key}\x00{message_id}"


def scoped_dedup_key(vhost: str, exchange: str, routing_key: str, message_id: str) -> str:
    """A dedup key scoped by vhost; `/`'s keys are those written before vhosts existed.

    Another vhost's key is the JSON list of the four names: JSON escapes NUL, so it has
    none, while every `/` key has two (its separators); and a list's encoding is
    unambiguous. Joining with NUL instead let a client of `/` forge another vhost's key
    (names and message ids may hold NUL), making that vhost's publish a duplicate."""
    if vhost != ROOT_SCOPE:
        return json.dumps([vhost, exchange, routing_key, message_id])
    return dedup_key(exchange, routing_key, message_id)


def key_scope(key: str) -> str:
    """The vhost whose publish `key` identifies (`scoped_dedup_key`'s inverse)."""
    if "\x00" in key or not key.startswith("["):
        return ROOT_SCOPE
    try:
        scope = json.loads(key)[0]
    except (ValueError, IndexError, KeyError, TypeError):
        return ROOT_SCOPE
    return scope if isinstance(scope, str) else ROOT_SCOPE


class DedupWindow:
    """The newest `size` message ids of each vhost (0 disables deduplication).

    Each vhost has a window of its own size: a tenant that publishes more distinct ids
    than the window holds pushes out only its own keys, never another vhost's (a
    shared window let one tenant make another's re-sends after a lost confirm new
    messages)."""

    def __init__(self, size: int, path: Path | None = None) -> None:
        self.size = size
        self.path = path
        self._scopes: dict[str, OrderedDict[str, None]] = {ROOT_SCOPE: OrderedDict()}
        self._pending: deque[tuple[int, str]] = deque()  # (batch, key), batches ascending
        self._pending_batch: dict[str, int] = {}  # key -> the newest batch it waits for
        self.dirty = False
        if path is not None and path.exists() and size:
            for message_id in json.loads(path.read_text()):
                self.add(message_id)  # each vhost keeps its newest `size`
            self.dirty = False

    def _window(self, key: str) -> OrderedDict[str, None]:
        scope = key_scope(key)
        window = self._scopes.get(scope)
        if window is None:
            window = self._scopes[scope] = OrderedDict()
        return window

    def __contains__(self, message_id: str) -> bool:
        window = self._scopes.get(key_scope(message_id))
        return window is not None and message_id in window

    def __len__(self) -> int:
        return sum(map(len, self._scopes.values()))

    def add(self, message_id: str) -> None:
        """Remember an id, forgetting its vhost's oldest beyond the window."""
        if not self.size:
            return
        ids = self._window(message_id)
        if message_id in ids:
            ids.move_to_end(message_id)
        else:
            ids[message_id] = None
            if len(ids) > self.size:
                ids.popitem(last=False)
        self.dirty = True

    def forget(self, key: str) -> None:
        """Drop a key, admitted or waiting (its message was discarded: never taken)."""
        window = self._scopes.get(key_scope(key))
        if window is not None and key in window:
            del window[key]
            self.dirty = True
        if self._pending_batch.pop(key, None) is not None:
            self._pending = deque(p for p in self._pending if p[1] != key)

    def forget_keys(self, keys: list[str]) -> None:
        """`forget` each of `keys` (the waiting ones taken out in one pass)."""
        waiting = False
        for key in keys:
            window = self._scopes.get(key_scope(key))
            if window is not None and key in window:
                del window[key]
                self.dirty = True
            if self._pending_batch.pop(key, None) is not None:
                waiting = True
        if waiting:
            gone = set(keys)
            self._pending = deque(p for p in self._pending if p[1] not in gone)

    def forget_admitted(self) -> None:
        """Drop every admitted key (keys waiting for their batch stay)."""
        if any(self._scopes.values()):
            self._scopes = {ROOT_SCOPE: OrderedDict()}
            self.dirty = True

    def pending_batch(self, key: str) -> int | None:
        """The batch whose outcome decides whether `key` enters the window, while it waits."""
        return self._pending_batch.get(key)

    def waiting_for(self, batch: int) -> list[str]:
        """The keys whose entry into the window waits for batch `batch`."""
        return [key for each, key in self._pending if each == batch]

    def add_when_durable(self, key: str, batch: int) -> None:
        """Remember `key` once batch `batch` is durable (now if 0); never if it fails.

        The caller registers the window as a waiter of group commit (`durable`).
        """
        if not self.size:
            return
        if batch == 0:
            self.add(key)
        else:
            self._pending.append((batch, key))
            self._pending_batch[key] = batch

    def durable(self, batch: int, failed: bool = False) -> bool:
        """Batches up to `batch` are complete (or failed): keep or forget their keys.

        Returns whether keys of later batches still wait (group commit's waiter protocol).
        """
        pending = self._pending
        while pending and pending[0][0] <= batch:
            each, key = pending.popleft()
            if self._pending_batch.get(key) == each:
                del self._pending_batch[key]
            if not failed:
                self.add(key)
        return bool(pending)

    def keys(self) -> list[str]:
        """The admitted keys, each vhost's oldest first (a copy at C speed: what a catch-up
        carries)."""
        if len(self._scopes) == 1:
            return list(self._scopes[ROOT_SCOPE])
        return [key for window in self._scopes.values() for key in window]

    def snapshot(self) -> list[str]:
        """The ids, oldest first (taken on the loop; written off it)."""
        self.dirty = False
        return self.keys()

    def remove_file(self) -> None:
        """Durably remove the snapshot file (runs in a worker thread): a restart then
        starts from the keys of the journal's messages alone, never from an older
        window holding a key forgotten since."""
        if self.path is None:
            return
        self.path.unlink(missing_ok=True)
        sync_dir(self.path.parent)

    def write(self, ids: list[str]) -> None:
        """Atomically replace the snapshot file (runs in a worker thread)."""
        if self.path is None:
            return
        try:
            replace_file(self.path, json.dumps(ids).encode())
        except OSError:
            # A full disk: do not leave half a file taking space.
            self.path.with_suffix(".tmp").unlink(missing_ok=True)
            raise
