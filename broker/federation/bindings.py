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
binding), changed one downstream binding at a time, and on a topic or headers exchange
applies **subsumption**: a binding implied by another one needed too (`a.*` by `a.#`,
anything by `#`; the headers table `{x-match: all, a: 1, b: 2}` by `{x-match: all, a: 1}`,
`implies`) is not bound upstream; when its cover goes it is bound again (the link binds
before it unbinds, so no message is lost in between). `drain` says what to bind and
unbind.
"""

from __future__ import annotations

import itertools
import json
import os
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from twinmq.broker.definitions import BindingDef
from twinmq.broker.routing import topic_matches

WILDCARDS = frozenset(("*", "#"))
_SUBSETS_UP_TO = 8
"""A headers table of up to this many pairs finds its all covers by its subsets (2^n)."""


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


# -- headers table implication ---------------------------------------------------------------

HeadersForm = tuple[bool, frozenset[tuple[str, str]]]
"""A headers binding as it routes: (any: whether one pair suffices, else all are needed;
the pairs that take part, each (header name, its value as canonical JSON))."""

_MODES = {"all": False, "any": True, "all-with-x": False, "any-with-x": True}


def headers_form(arguments: dict[str, Any], *, as_cover: bool = False) -> HeadersForm | None:
    """How a headers binding routes, or None when it is not reasoned about (then it is
    neither implied nor implies: reference counted only).

    As `routing.headers_match` (and RabbitMQ) route: `x-match` all (the default) or any,
    or all-with-x / any-with-x, where names starting with `x-` take part too; a message
    matches a pair when it has the header with an equal value. Not reasoned about: an
    `x-match` that is not one of these four strings; in all / any, any other `x-` name
    (ignored by today's brokers; an older one that did not ignore it would route
    differently). A **cover** (`as_cover`) must be all or any: an upstream that does not
    know the `-with-x` modes refuses such a binding, and what it was to carry would be
    lost. Values compare as canonical JSON, exactly (`true` is not `1`; a value equal to
    another only as the broker compares text and bytes is a different value here: a
    subsumption missed, never a wrong one)."""
    mode = arguments.get("x-match", "all")
    if not isinstance(mode, str) or mode not in _MODES:
        return None
    with_x = mode.endswith("-with-x")
    if with_x and as_cover:
        return None
    pairs: set[tuple[str, str]] = set()
    for name, value in arguments.items():
        if name == "x-match":
            continue
        if name.startswith("x-") and not with_x:
            return None
        try:
            canonical = json.dumps(value, sort_keys=True, allow_nan=False)
        except (TypeError, ValueError):
            return None
        pairs.add((name, canonical))
    return _MODES[mode], frozenset(pairs)


def implies(cover: HeadersForm, other: HeadersForm) -> bool:
    """Whether every message `other` matches, `cover` matches too (headers bindings).

    With A the cover's pairs and B the other's:
    - all ⇒ all: A ⊆ B (a message with all of B has all of A; else a message with
      exactly B's headers lacks one of A);
    - any ⇒ any: B ⊆ A (B empty: `other` matches nothing);
    - all ⇒ any: A ∩ B non-empty and B non-empty (a message with B's headers has one of
      A's; B empty: `other` matches every message, `cover` not the one with no header);
    - any ⇒ all... the cover all, the other any: A empty (matches every message), or B
      empty (`other` matches none), or A = B with one pair (one pair: all = any);
      otherwise a message with just one of B's pairs lacks another of A's or is not
      A's only one.
    """
    cover_any, a = cover
    other_any, b = other
    if not cover_any and not other_any:
        return a <= b
    if cover_any and other_any:
        return b <= a
    if cover_any:  # the other is all
        return bool(b) and not a.isdisjoint(b)
    return not a or not b or (len(a) == 1 and a == b)


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
    needed pattern covers, and on a headers exchange the tables another needed table
    implies (`implies`).

    Changed one local binding at a time (`add`, `remove`: no scan of the others, except
    a wildcard pattern becoming a root or going away, which looks at what it may cover).
    Covered patterns are kept under the root that covers them (`_covering`), so a root
    that goes re-examines only its own. Among equivalent patterns (`#` and `#.#`), the
    smallest string is the root.
    """

    def __init__(self, kind: str, bindings: Iterable[BindingDef] = ()) -> None:
        self.kind = kind
        self.topic = kind == "topic"
        self.headers = kind == "headers"
        self.subsumes = self.topic or self.headers
        self.references: Counter[UpstreamBinding] = Counter()
        self.roots: set[UpstreamBinding] = set()
        # The roots that may imply others (a topic pattern with a wildcard, a headers
        # table `headers_form` reasons about as a cover), with their form.
        self._wild_roots: dict[UpstreamBinding, Any] = {}
        self._cover_of: dict[UpstreamBinding, UpstreamBinding] = {}
        self._covering: dict[UpstreamBinding, set[UpstreamBinding]] = {}
        self._touched: set[UpstreamBinding] = set()
        # Headers: each needed table's form, as covered and as a cover (parsed once), and
        # the roots indexed by their pairs, so that finding a table's cover, or what a
        # new cover implies, looks at the roots sharing a pair with it, not at all of them.
        self._forms: dict[UpstreamBinding, tuple[HeadersForm | None, HeadersForm | None]] = {}
        self._all_covers: dict[frozenset[tuple[str, str]], set[UpstreamBinding]] = {}
        self._any_covers: dict[tuple[str, str], set[UpstreamBinding]] = {}
        self._roots_by_pair: dict[tuple[str, str], set[UpstreamBinding]] = {}
        self._roots_without_pairs: set[UpstreamBinding] = set()
        # Covers first: literal keys added after them are covered at once instead of
        # becoming roots to demote (a rebuild of 10,000 keys under `#`).
        ordered = sorted(bindings, key=lambda b: self._cover_form(normalise(kind, b)) is None)
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
        self._forms.pop(normal, None)

    def drain(self, bound: set[UpstreamBinding]) -> Changes:
        """What to bind and unbind upstream so that `bound` (the upstream, as far as the
        link knows, equal to `roots` at its last drain) becomes `roots` again."""
        touched, self._touched = self._touched, set()
        bind = sorted(b for b in touched if b in self.roots and b not in bound)
        unbind = sorted(b for b in touched if b not in self.roots and b in bound)
        return Changes(bind, unbind)

    # -- subsumption ------------------------------------------------------------------------

    def _headers_forms(
        self, normal: UpstreamBinding
    ) -> tuple[HeadersForm | None, HeadersForm | None]:
        forms = self._forms.get(normal)
        if forms is None:
            arguments = normal.arguments
            forms = (headers_form(arguments), headers_form(arguments, as_cover=True))
            self._forms[normal] = forms
        return forms

    def _cover_form(self, normal: UpstreamBinding) -> Any:
        """What `normal` covers others by, or None if it covers none: a topic pattern's
        words when it has a wildcard (a literal key covers only itself), a headers
        table's form (`headers_form`, as a cover)."""
        if self.topic:
            words = _words(normal.routing_key)
            return words if WILDCARDS.intersection(words) else None
        if self.headers:
            return self._headers_forms(normal)[1]
        return None

    def _dominates(self, cover: Any, a: UpstreamBinding, b: UpstreamBinding) -> bool:
        """Whether root candidate `a` (its cover form `cover`) makes `b` unneeded upstream."""
        if self.headers:
            form, back = self._headers_forms(b)
            if form is None or not implies(cover, form):
                return False
            # Equivalent tables (`{}` and `{x-match: all}`): the smaller string stays.
            return a.arguments_json < b.arguments_json or back is None or not implies(back, cover)
        words = _words(b.routing_key)
        if not covers(cover, words):
            return False
        # Equivalent patterns: the smaller string stays (a literal covers only itself).
        return a.routing_key < b.routing_key or not covers(words, cover)

    def _dominator(self, normal: UpstreamBinding) -> UpstreamBinding | None:
        candidates = self._headers_covers(normal) if self.headers else self._wild_roots
        for root in candidates:
            if root != normal and self._dominates(self._wild_roots[root], root, normal):
                return root
        return None

    def _headers_covers(self, normal: UpstreamBinding) -> Iterator[UpstreamBinding]:
        """The cover roots that may imply table `normal` (`implies`, by the index): all
        ones whose pairs are a subset of its pairs, any ones sharing a pair with it, and
        when it matches nothing (any, no pair), every cover."""
        form = self._headers_forms(normal)[0]
        if form is None:
            return
        other_any, pairs = form
        if len(pairs) <= _SUBSETS_UP_TO:
            if other_any:  # all covers an any table only with no pair, or its one pair
                keys = [frozenset(), *([pairs] if len(pairs) == 1 else [])]
            else:
                keys = [
                    frozenset(c) for n in range(len(pairs) + 1)
                    for c in itertools.combinations(sorted(pairs), n)
                ]  # fmt: skip
            for key in keys:
                yield from list(self._all_covers.get(key, ()))
        else:  # a large table: the all covers looked at one by one
            yield from [r for r, (any_, _p) in self._wild_roots.items() if not any_]
        for pair in pairs:
            yield from list(self._any_covers.get(pair, ()))
        if other_any and not pairs:
            yield from list(self._wild_roots)

    def _implied_candidates(self, normal: UpstreamBinding, cover: Any) -> list[UpstreamBinding]:
        """The roots a new cover may imply: every other root (topic); the tables sharing
        a pair with it, or with no pair (headers, by the index)."""
        if not self.headers:
            return [r for r in self.roots if r != normal]
        cover_any, pairs = cover
        if not pairs:
            if cover_any:  # matches nothing: implies only what matches nothing
                return [r for r in self._roots_without_pairs if r != normal]
            return [r for r in self.roots if r != normal]  # matches every message
        found = set(self._roots_without_pairs)
        buckets = [self._roots_by_pair.get(pair, set()) for pair in pairs]
        if cover_any:
            for bucket in buckets:
                found |= bucket
        else:  # the tables it implies hold every pair of it: the smallest bucket has them
            found |= min(buckets, key=len)
        found.discard(normal)
        return list(found)

    def _index_root(self, normal: UpstreamBinding, present: bool) -> None:
        if not self.headers:
            return
        form, cover = self._headers_forms(normal)
        if form is not None:
            for pair in form[1] or [None]:
                bucket = self._roots_without_pairs if pair is None else (
                    self._roots_by_pair.setdefault(pair, set())
                )  # fmt: skip
                if present:
                    bucket.add(normal)
                else:
                    bucket.discard(normal)
                    if pair is not None and not bucket:
                        del self._roots_by_pair[pair]
        if cover is not None:
            cover_any, pairs = cover
            keys: list[Any] = list(pairs) if cover_any else [pairs]
            index: dict[Any, set[UpstreamBinding]] = (
                self._any_covers if cover_any else self._all_covers
            )
            for key in keys:
                if present:
                    index.setdefault(key, set()).add(normal)
                elif key in index:
                    index[key].discard(normal)
                    if not index[key]:
                        del index[key]

    def _generality(self, normal: UpstreamBinding) -> tuple[int, int, str]:
        form = self._headers_forms(normal)[1]
        if form is None:
            return (2, 0, normal.arguments_json)  # covers nothing: last
        cover_any, pairs = form
        return (int(cover_any), len(pairs) if not cover_any else -len(pairs), normal.arguments_json)

    def _cover(self, normal: UpstreamBinding, root: UpstreamBinding) -> None:
        self._cover_of[normal] = root
        self._covering.setdefault(root, set()).add(normal)

    def _make_root(self, normal: UpstreamBinding) -> None:
        self.roots.add(normal)
        self._touched.add(normal)
        form = self._cover_form(normal)
        if form is not None:
            self._wild_roots[normal] = form
        self._index_root(normal, True)

    def _unroot(self, normal: UpstreamBinding) -> None:
        self._index_root(normal, False)
        self.roots.discard(normal)
        self._wild_roots.pop(normal, None)
        self._touched.add(normal)

    def _appeared(self, normal: UpstreamBinding) -> None:
        if not self.subsumes:
            self._make_root(normal)
            return
        self._place(normal)

    def _place(self, normal: UpstreamBinding) -> None:
        """Put `normal` under a root that covers it, or make it a root (and put the
        roots it covers under it)."""
        root = self._dominator(normal)
        if root is not None:
            self._cover(normal, root)
            return
        self._make_root(normal)
        words = self._wild_roots.get(normal)
        if words is None:
            return  # a literal key (a table not reasoned about) covers no other
        for other in self._implied_candidates(normal, words):
            if self._dominates(words, normal, other):
                self._unroot(other)
                self._cover(other, normal)
                for below in self._covering.pop(other, set()):
                    self._cover(below, normal)  # covered by what covers their cover

    def _gone(self, normal: UpstreamBinding) -> None:
        root = self._cover_of.pop(normal, None)
        if root is not None:
            self._covering[root].discard(normal)
            return
        self._unroot(normal)
        orphans = self._covering.pop(normal, set())
        if self.headers:
            # Each freed table placed again, the most general first (fewest pairs of an
            # all table), so that few become roots only to be put under another.
            for orphan in orphans:
                del self._cover_of[orphan]
            for orphan in sorted(orphans, key=self._generality):
                self._place(orphan)
            return
        free: list[UpstreamBinding] = []
        for orphan in orphans:
            del self._cover_of[orphan]
            other = self._dominator(orphan)
            if other is not None:
                self._cover(orphan, other)
            else:
                free.append(orphan)
        # Among the freed: covers first, each a root unless a root covers it now.
        forms = {b: self._cover_form(b) for b in free}
        free.sort(key=lambda b: (forms[b] is None, b))
        wild = [b for b in free if forms[b] is not None]
        for orphan in wild:
            if any(o != orphan and self._dominates(forms[o], o, orphan) for o in wild):
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
    binds: Iterable[UpstreamBinding], unbinds: Iterable[UpstreamBinding], kind: str = "topic"
) -> list[UpstreamBinding]:
    """Topic or headers: the `binds` some of `unbinds` cover (to bind before those go).
    Only a pattern with a wildcard covers another key; only a table `headers_form`
    reasons about as a cover covers another table."""
    if kind == "headers":
        tables = [f for b in unbinds if (f := headers_form(b.arguments, as_cover=True))]
        if not tables:
            return []
        return sorted(
            b
            for b in binds
            if (form := headers_form(b.arguments)) is not None
            and any(implies(t, form) for t in tables)
        )
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
