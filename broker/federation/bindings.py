"""Binding normalisation, subsumption and the upstream binding set (sans-I/O), and the
link's durable record of what may be bound upstream.

The downstream's bindings on a federated exchange become bindings of the link's one
upstream queue, normalised so that each message crosses the link once however many
downstream queues want it:

- direct and topic: one upstream binding per distinct routing key (arguments do not
  take part in their routing);
- fanout: one upstream binding for any number of downstream bindings;
- headers: one per distinct argument table (the routing key does not take part).

`UpstreamSet` counts references (how many downstream bindings need each normalised
binding), changed one downstream binding at a time, and on a topic exchange applies
**subsumption**: a pattern covered by another one needed too (`a.*` by `a.#`, anything by
`#`) is not bound upstream; when its cover goes it is bound again (the link binds before
it unbinds, so no message is lost in between). `drain` says what to bind and unbind.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from twinmq.broker.definitions import BindingDef
from twinmq.broker.routing import topic_matches

WILDCARDS = frozenset(("*", "#"))


@dataclass(frozen=True, slots=True, order=True)
class UpstreamBinding:
    """One binding of the link's upstream queue: a routing key and arguments (as JSON)."""

    routing_key: str
    arguments_json: str = "{}"

    @property
    def arguments(self) -> dict[str, Any]:
        """The binding arguments to send."""
        decoded: dict[str, Any] = json.loads(self.arguments_json)
        return decoded


def normalise(kind: str, binding: BindingDef) -> UpstreamBinding:
    """The upstream binding a downstream binding needs on an exchange of type `kind`."""
    if kind == "fanout":
        return UpstreamBinding("")
    if kind == "headers":
        return UpstreamBinding("", json.dumps(binding.arguments, sort_keys=True, default=str))
    return UpstreamBinding(binding.routing_key)


def needed(kind: str, bindings: Iterable[BindingDef]) -> Counter[UpstreamBinding]:
    """Reference counts: each upstream binding and how many downstream bindings need it."""
    return Counter(normalise(kind, b) for b in bindings)


# -- topic pattern coverage -------------------------------------------------------------------


def _closure(pattern: tuple[str, ...], states: set[int]) -> frozenset[int]:
    """Add the positions reachable without a word: past a `#` (zero words)."""
    todo = list(states)
    while todo:
        i = todo.pop()
        if i < len(pattern) and pattern[i] == "#" and i + 1 not in states:
            states.add(i + 1)
            todo.append(i + 1)
    return frozenset(states)


def _step(pattern: tuple[str, ...], states: frozenset[int], word: str) -> frozenset[int]:
    after: set[int] = set()
    for i in states:
        if i < len(pattern):
            token = pattern[i]
            if token == "#":
                after.add(i)  # `#` takes one more word and stays
            elif token == "*" or token == word:
                after.add(i + 1)
    return _closure(pattern, after)


def covers(cover: tuple[str, ...], pattern: tuple[str, ...]) -> bool:
    """Whether every routing key `pattern` matches, `cover` matches too (topic patterns
    as word tuples: `*` one word, `#` zero or more words).

    A routing key has at least one word (`""` is one empty word, as `topic_matches`
    splits it), so `#` and `*.#` cover each other. Exact: the language inclusion of the
    two patterns, decided by walking both automata together (the cover's determinised)
    over an alphabet of the literal words of both and one word that is neither: any
    other word behaves as that one in both patterns.
    """
    if not WILDCARDS.intersection(pattern):
        return topic_matches(cover, pattern)  # one key: is it matched?
    literals = {t for t in (*pattern, *cover) if t not in WILDCARDS}
    other = "\x00"
    while other in literals:
        other += "\x00"
    alphabet = [*literals, other]
    start = (_closure(pattern, {0}), _closure(cover, {0}), False)
    seen = {start}
    todo = [start]
    while todo:
        here, there, nonempty = todo.pop()
        if nonempty and len(pattern) in here and len(cover) not in there:
            return False  # a key the pattern matches and the cover does not
        for word in alphabet:
            ahead = _step(pattern, here, word)
            if not ahead:
                continue
            state = (ahead, _step(cover, there, word), True)
            if state not in seen:
                seen.add(state)
                todo.append(state)
    return True


def _words(key: str) -> tuple[str, ...]:
    return tuple(key.split("."))


@dataclass(frozen=True, slots=True)
class Changes:
    """What to do upstream: bind these (first), then unbind those."""

    bind: list[UpstreamBinding]
    unbind: list[UpstreamBinding]

    def __bool__(self) -> bool:
        return bool(self.bind or self.unbind)


class UpstreamSet:
    """The normalised bindings the local exchange needs, reference counted, and which of
    them go upstream (`roots`): all of them, except on a topic exchange the ones another
    needed pattern covers.

    Changed one local binding at a time (`add`, `remove`: no scan of the others, except
    a wildcard pattern becoming a root or going away, which looks at what it may cover).
    Covered patterns are kept under the root that covers them (`_covering`), so a root
    that goes re-examines only its own. Among equivalent patterns (`#` and `#.#`), the
    smallest string is the root.
    """

    def __init__(self, kind: str, bindings: Iterable[BindingDef] = ()) -> None:
        self.kind = kind
        self.topic = kind == "topic"
        self.references: Counter[UpstreamBinding] = Counter()
        self.roots: set[UpstreamBinding] = set()
        self._wild_roots: dict[UpstreamBinding, tuple[str, ...]] = {}
        self._cover_of: dict[UpstreamBinding, UpstreamBinding] = {}
        self._covering: dict[UpstreamBinding, set[UpstreamBinding]] = {}
        self._touched: set[UpstreamBinding] = set()
        # Wildcard patterns first: literal keys added after them are covered at once
        # instead of becoming roots to demote (a rebuild of 10,000 keys under `#`).
        ordered = sorted(bindings, key=lambda b: not WILDCARDS.intersection(_words(b.routing_key)))
        for binding in ordered:
            self.add(binding)

    # -- changes --------------------------------------------------------------------------

    def add(self, binding: BindingDef) -> None:
        """A local binding appeared."""
        normal = normalise(self.kind, binding)
        self.references[normal] += 1
        if self.references[normal] == 1:
            self._appeared(normal)

    def remove(self, binding: BindingDef) -> None:
        """A local binding went."""
        normal = normalise(self.kind, binding)
        count = self.references.get(normal, 0)
        if count <= 0:
            return
        if count > 1:
            self.references[normal] = count - 1
            return
        del self.references[normal]
        self._gone(normal)

    def drain(self, bound: set[UpstreamBinding]) -> Changes:
        """What to bind and unbind upstream so that `bound` (the upstream, as far as the
        link knows, equal to `roots` at its last drain) becomes `roots` again."""
        touched, self._touched = self._touched, set()
        bind = sorted(b for b in touched if b in self.roots and b not in bound)
        unbind = sorted(b for b in touched if b not in self.roots and b in bound)
        return Changes(bind, unbind)

    # -- subsumption ------------------------------------------------------------------------

    def _dominates(self, cover: tuple[str, ...], a: UpstreamBinding, b: UpstreamBinding) -> bool:
        """Whether root candidate `a` (words `cover`) makes `b` unneeded upstream."""
        words = _words(b.routing_key)
        if not covers(cover, words):
            return False
        # Equivalent patterns: the smaller string stays (a literal covers only itself).
        return a.routing_key < b.routing_key or not covers(words, cover)

    def _dominator(self, normal: UpstreamBinding) -> UpstreamBinding | None:
        for root, words in self._wild_roots.items():
            if root != normal and self._dominates(words, root, normal):
                return root
        return None

    def _cover(self, normal: UpstreamBinding, root: UpstreamBinding) -> None:
        self._cover_of[normal] = root
        self._covering.setdefault(root, set()).add(normal)

    def _make_root(self, normal: UpstreamBinding) -> None:
        self.roots.add(normal)
        self._touched.add(normal)
        words = _words(normal.routing_key)
        if self.topic and WILDCARDS.intersection(words):
            self._wild_roots[normal] = words

    def _appeared(self, normal: UpstreamBinding) -> None:
        if not self.topic:
            self._make_root(normal)
            return
        root = self._dominator(normal)
        if root is not None:
            self._cover(normal, root)
            return
        self._make_root(normal)
        words = self._wild_roots.get(normal)
        if words is None:
            return  # a literal key covers no other
        for other in [r for r in self.roots if r != normal]:
            if self._dominates(words, normal, other):
                self.roots.discard(other)
                self._wild_roots.pop(other, None)
                self._touched.add(other)
                self._cover(other, normal)
                for below in self._covering.pop(other, set()):
                    self._cover(below, normal)  # covered by what covers their cover

    def _gone(self, normal: UpstreamBinding) -> None:
        root = self._cover_of.pop(normal, None)
        if root is not None:
            self._covering[root].discard(normal)
            return
        self.roots.discard(normal)
        self._wild_roots.pop(normal, None)
        self._touched.add(normal)
        orphans = self._covering.pop(normal, set())
        free: list[UpstreamBinding] = []
        for orphan in orphans:
            del self._cover_of[orphan]
            other = self._dominator(orphan)
            if other is not None:
                self._cover(orphan, other)
            else:
                free.append(orphan)
        # Among the freed: wildcard ones first, each a root unless a root covers it now.
        free.sort(key=lambda b: (not WILDCARDS.intersection(_words(b.routing_key)), b))
        wild = [b for b in free if WILDCARDS.intersection(_words(b.routing_key))]
        for orphan in wild:
            if any(o != orphan and self._dominates(_words(o.routing_key), o, orphan) for o in wild):
                continue  # a freed one covers it: placed below that one's root next
            self._make_root(orphan)
        for orphan in free:
            if orphan in self.roots:
                continue
            other = self._dominator(orphan)
            if other is not None:
                self._cover(orphan, other)
            else:
                self._make_root(orphan)


def covered_by(
    binds: Iterable[UpstreamBinding], unbinds: Iterable[UpstreamBinding]
) -> list[UpstreamBinding]:
    """Topic: the `binds` some of `unbinds` cover (to bind before those go). Only a
    pattern with a wildcard covers another key."""
    covers_some = [words for b in unbinds if WILDCARDS.intersection(words := _words(b.routing_key))]
    if not covers_some:
        return []
    return sorted(b for b in binds if any(covers(w, _words(b.routing_key)) for w in covers_some))


def resync(maybe_held: Iterable[UpstreamBinding], wanted: Iterable[UpstreamBinding]) -> Changes:
    """After a reconnect: bind everything wanted (idempotent), unbind everything that may
    be held and is not wanted (an unbind of a missing binding is harmless)."""
    wanted_set = set(wanted)
    return Changes(sorted(wanted_set), sorted(set(maybe_held) - wanted_set))


# -- the durable record ----------------------------------------------------------------------


class Record:
    """What may be bound upstream, on disk: a snapshot line (a JSON list of `[key,
    arguments]`, the whole record of earlier versions) then one line per change,
    `["+", key, arguments]` before a bind is sent and `["-", key, arguments]` after an
    unbind is answered. A crash leaves more here than upstream, never less; a torn last
    line was a change not yet sent. Rewritten as a snapshot when the changes outgrow it
    (so each change costs a short append, the whole file only now and then).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.held: set[UpstreamBinding] = set()
        self._changes = 0
        if path.exists():
            text = path.read_text()
            self.held = self._read(text)
            if text and not text.endswith("\n"):
                # An earlier version's record, or a line torn by a crash: rewritten so
                # that the next change starts a line of its own.
                self.rewrite(self.held)

    @staticmethod
    def _read(text: str) -> set[UpstreamBinding]:
        lines = text.split("\n")
        held: set[UpstreamBinding] = set()
        for n, line in enumerate(lines):
            if not line:
                continue
            try:
                item = json.loads(line)
            except ValueError:
                if n == len(lines) - 1:
                    break  # torn by a crash while appended: a change not yet sent
                raise
            if n == 0:
                held = {UpstreamBinding(key, args) for key, args in item}
            elif item[0] == "+":
                held.add(UpstreamBinding(item[1], item[2]))
            else:
                held.discard(UpstreamBinding(item[1], item[2]))
        return held

    def add(self, bindings: Iterable[UpstreamBinding]) -> None:
        """Record bindings about to be bound (before they are sent)."""
        new = [b for b in bindings if b not in self.held]
        if new:
            self.held.update(new)
            self._append("+", new)

    def remove(self, bindings: Iterable[UpstreamBinding]) -> None:
        """Record bindings unbound upstream (after the upstream answered)."""
        gone = [b for b in bindings if b in self.held]
        if gone:
            self.held.difference_update(gone)
            self._append("-", gone)

    def rewrite(self, held: set[UpstreamBinding]) -> None:
        """Replace the record with a snapshot of `held` (atomically)."""
        self.held = set(held)
        self._changes = 0
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(encode(self.held) + "\n")
        tmp.replace(self.path)

    def _append(self, sign: str, bindings: list[UpstreamBinding]) -> None:
        if not self.path.exists():
            self.rewrite(self.held)
            return
        text = "".join(json.dumps([sign, b.routing_key, b.arguments_json]) + "\n" for b in bindings)
        # One write of whole lines, appended: a crash tears the last line at most.
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)
        self._changes += len(bindings)
        if self._changes > max(1024, 2 * len(self.held)):
            self.rewrite(self.held)


def encode(bindings: Iterable[UpstreamBinding]) -> str:
    """A snapshot of what may be bound upstream (JSON, one line)."""
    return json.dumps([[b.routing_key, b.arguments_json] for b in sorted(bindings)])


def decode(text: str) -> set[UpstreamBinding]:
    """Read a record (`encode`'s snapshot, and changes after it)."""
    return Record._read(text)
