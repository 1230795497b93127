"""Topic and headers subsumption for binding propagation (sans-I/O): the coverage test against a
brute-force matcher over every routing key up to a length, the upstream set kept by
single changes against the set computed from scratch, and the link's durable record."""

from __future__ import annotations

import itertools
import random
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from twinmq.broker.definitions import BindingDef
from twinmq.broker.federation import bindings as fb
from twinmq.broker.routing import headers_match

KEY_WORDS = ("a", "b", "c", "")  # "c" is a word no pattern names; "" an empty word
KEYS = [k for n in range(1, 6) for k in itertools.product(KEY_WORDS, repeat=n)]
TOKENS = ("a", "b", "*", "#")


def brute_matches(pattern: tuple[str, ...], words: tuple[str, ...]) -> bool:
    """AMQP topic matching written plainly: `*` one word, `#` zero or more words."""
    if not pattern:
        return not words
    head, rest = pattern[0], pattern[1:]
    if head == "#":
        return brute_matches(rest, words) or (bool(words) and brute_matches(pattern, words[1:]))
    if not words:
        return False
    return (head == "*" or head == words[0]) and brute_matches(rest, words[1:])


def brute_covers(cover: tuple[str, ...], pattern: tuple[str, ...]) -> bool:
    return all(brute_matches(cover, k) for k in KEYS if brute_matches(pattern, k))


patterns = st.lists(st.sampled_from(TOKENS), min_size=1, max_size=4).map(tuple)


def test_coverage_agrees_with_brute_force_for_every_pair_of_short_patterns() -> None:
    short = [p for n in range(1, 4) for p in itertools.product(("a", "*", "#"), repeat=n)]
    for cover, pattern in itertools.product(short, repeat=2):
        assert fb.covers(cover, pattern) == brute_covers(cover, pattern), (cover, pattern)


@settings(max_examples=400, deadline=None)
@given(patterns, patterns)
def test_coverage_agrees_with_brute_force_for_generated_patterns(
    cover: tuple[str, ...], pattern: tuple[str, ...]
) -> None:
    expected = brute_covers(cover, pattern)
    if expected and not fb.covers(cover, pattern):
        # Keys of up to 5 words are too few for two 4-token patterns: `#.a.*.*` misses
        # `a.a.a.#` first at `a.a.a.b.c.d`. Looked at again with keys of up to 8 words.
        longer = [k for n in range(1, 9) for k in itertools.product(("a", "b", "c"), repeat=n)]
        expected = all(brute_matches(cover, k) for k in longer if brute_matches(pattern, k))
    assert fb.covers(cover, pattern) == expected


def test_the_briefs_examples_of_coverage_hold_and_their_converses_do_not() -> None:
    def c(cover: str, pattern: str) -> bool:
        return fb.covers(tuple(cover.split(".")), tuple(pattern.split(".")))

    assert c("#", "a.b") and c("#", "*.#") and c("*.#", "#")  # every key has a word
    assert c("a.*", "a.b") and not c("a.b", "a.*")
    assert c("a.#", "a.*.c") and not c("a.*.c", "a.#")
    assert not c("a.*", "a.#") and c("a.#", "a")  # `#` matches zero words
    assert not c("*", "*.*") and c("#.*", "*.#") and c("*.#", "#.*")


def _binding(queue: str, key: str) -> BindingDef:
    return BindingDef(exchange="x", queue=queue, routing_key=key, arguments={})


def expected_roots(keys: set[str]) -> set[str]:
    """From scratch: the patterns no other one covers (the smallest of equivalent ones)."""
    words = {k: tuple(k.split(".")) for k in keys}

    def dominated(k: str) -> bool:
        return any(
            o != k and brute_covers(words[o], words[k])
            and (o < k or not brute_covers(words[k], words[o]))
            for o in keys
        )  # fmt: skip

    return {k for k in keys if not dominated(k)}


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.booleans(), st.integers(0, 3), patterns.map(".".join)),
        min_size=1,
        max_size=40,
    )
)
def test_the_upstream_set_kept_by_single_changes_equals_the_one_computed_from_scratch(
    steps: list[tuple[bool, int, str]],
) -> None:
    needed = fb.UpstreamSet("topic")
    upstream: set[fb.UpstreamBinding] = set()
    local: set[tuple[str, str]] = set()
    for add, queue, key in steps:
        binding = _binding(f"q{queue}", key)
        if add and (binding.queue, key) not in local:
            local.add((binding.queue, key))
            needed.add(binding)
        elif not add and (binding.queue, key) in local:
            local.discard((binding.queue, key))
            needed.remove(binding)
        else:
            continue
        changes = needed.drain(upstream)
        # Binds before unbinds: what was matched before is matched at every point after.
        before = {k for k in KEYS if any(brute_matches(tuple(b.routing_key.split(".")), k)
                                         for b in upstream)}  # fmt: skip
        upstream |= set(changes.bind)
        during = {k for k in KEYS if any(brute_matches(tuple(b.routing_key.split(".")), k)
                                         for b in upstream)}  # fmt: skip
        assert before <= during
        upstream -= set(changes.unbind)
        keys = {k for _q, k in local}
        assert {b.routing_key for b in upstream} == expected_roots(keys)
        assert {b.routing_key for b in needed.roots} == expected_roots(keys)
        rebuilt = fb.UpstreamSet("topic", [_binding(q, k) for q, k in local])
        assert rebuilt.roots == needed.roots


def test_a_catch_all_covers_ten_thousand_keys_and_they_come_back_before_it_goes() -> None:
    needed = fb.UpstreamSet("topic")
    upstream: set[fb.UpstreamBinding] = set()
    for i in range(10_000):
        needed.add(_binding("q", f"k.{i}"))
    upstream |= set(needed.drain(upstream).bind)
    assert len(upstream) == 10_000
    needed.add(_binding("all", "#"))
    changes = needed.drain(upstream)
    assert changes.bind == [fb.UpstreamBinding("#")] and len(changes.unbind) == 10_000
    upstream = (upstream | set(changes.bind)) - set(changes.unbind)
    needed.remove(_binding("all", "#"))
    changes = needed.drain(upstream)
    assert len(changes.bind) == 10_000 and changes.unbind == [fb.UpstreamBinding("#")]


def test_other_kinds_are_reference_counted_without_subsumption() -> None:
    needed = fb.UpstreamSet("direct")
    needed.add(_binding("a", "#"))
    needed.add(_binding("b", "x"))
    needed.add(_binding("c", "x"))
    assert needed.drain(set()).bind == [fb.UpstreamBinding("#"), fb.UpstreamBinding("x")]
    needed.remove(_binding("b", "x"))
    assert not needed.drain({fb.UpstreamBinding("#"), fb.UpstreamBinding("x")})
    needed.remove(_binding("c", "x"))
    assert needed.drain({fb.UpstreamBinding("x")}).unbind == [fb.UpstreamBinding("x")]


def test_the_record_replays_its_changes_and_ignores_a_torn_last_line(tmp_path: Path) -> None:
    path = tmp_path / "x.bindings.json"
    a, b, c = fb.UpstreamBinding("a"), fb.UpstreamBinding("b"), fb.UpstreamBinding("c")
    path.write_text(fb.encode({a}))  # an earlier version's record: a snapshot only
    record = fb.Record(path)
    assert record.held == {a}
    record.add([b, c])
    record.remove([a])
    assert fb.Record(path).held == {b, c}
    with path.open("a") as f:
        f.write('["+", "d", "{')  # a crash in the middle of an append
    assert fb.Record(path).held == {b, c}


def test_the_record_is_compacted_when_its_changes_outgrow_it(tmp_path: Path) -> None:
    path = tmp_path / "x.bindings.json"
    record = fb.Record(path)
    rng = random.Random(15)
    model: set[fb.UpstreamBinding] = set()
    for _ in range(3000):
        binding = fb.UpstreamBinding(f"k{rng.randrange(50)}")
        if binding in model:
            record.remove([binding])
            model.discard(binding)
        else:
            record.add([binding])
            model.add(binding)
    assert fb.Record(path).held == model
    assert len(path.read_text().splitlines()) <= 1 + 1025


def test_a_resync_binds_first_only_what_a_binding_about_to_go_covers() -> None:
    binds = [fb.UpstreamBinding(k) for k in ("a.b", "a.x.c", "b.c", "d")]
    unbinds = [fb.UpstreamBinding(k) for k in ("a.#", "old", "*.c")]
    assert fb.covered_by(binds, unbinds) == [
        fb.UpstreamBinding("a.b"),
        fb.UpstreamBinding("a.x.c"),
        fb.UpstreamBinding("b.c"),
    ]
    assert fb.covered_by(binds, [fb.UpstreamBinding("a.b")]) == []


# -- headers tables -----------------------------------------------------------------------------

HEADER_NAMES = ("a", "b", "x-d")
MODES = (None, "all", "any", "all-with-x", "any-with-x", "bogus")
# Every message over these names: each absent or one of three values (3 no table names).
MESSAGES = [
    {n: v for n, v in zip(HEADER_NAMES, values, strict=True) if v is not None}
    for values in itertools.product((None, 1, 2, 3), repeat=len(HEADER_NAMES))
]


def table(mode: str | None, pairs: dict[str, Any]) -> dict[str, Any]:
    return pairs if mode is None else {"x-match": mode, **pairs}


TABLES = [
    table(mode, {n: v for n, v in zip(HEADER_NAMES, values, strict=True) if v is not None})
    for mode in MODES
    for values in itertools.product((None, 1, 2), repeat=len(HEADER_NAMES))
]


def brute_implies(cover: dict[str, Any], other: dict[str, Any]) -> bool:
    """Every message the broker routes by `other`, it routes by `cover` too."""
    return all(headers_match(cover, m) for m in MESSAGES if headers_match(other, m))


def claims(cover: dict[str, Any], other: dict[str, Any]) -> bool:
    c, o = fb.headers_form(cover, as_cover=True), fb.headers_form(other)
    return c is not None and o is not None and fb.implies(c, o)


def test_headers_implication_is_never_claimed_wrongly_and_exact_where_it_reasons() -> None:
    for cover in TABLES:
        for other in TABLES:
            claimed = claims(cover, other)
            if claimed:
                assert brute_implies(cover, other), (cover, other)
            elif fb.headers_form(cover, as_cover=True) and fb.headers_form(other):
                # Over a universe with a value no table names, the rules are exact.
                assert not brute_implies(cover, other), (cover, other)


def test_headers_tables_left_out_of_subsumption_are_the_doubtful_ones() -> None:
    assert fb.headers_form({"x-match": "bogus", "a": 1}) is None  # the broker routes as all
    assert fb.headers_form({"x-match": "all", "x-d": 1}) is None  # an x- name, not with-x
    assert fb.headers_form({"x-match": "all-with-x", "x-d": 1}) is not None
    assert fb.headers_form({"x-match": "all-with-x", "x-d": 1}, as_cover=True) is None
    assert fb.headers_form({"x-match": b"all", "a": 1}) is None
    # Exact values: true is not 1, "1" is not 1 (a missed subsumption at worst).
    assert not claims({"a": True}, {"a": 1}) and not claims({"a": "1"}, {"a": 1})
    assert claims({}, {"x-match": "any-with-x", "x-d": 1})
    assert claims({"x-match": "any", "a": 1}, {"a": 1, "b": 2})
    assert not claims({"a": 1, "b": 2}, {"x-match": "any", "a": 1, "b": 2})
    assert claims({"a": 1}, {"x-match": "any", "a": 1})  # one pair: all = any


header_values = st.one_of(st.integers(0, 2), st.sampled_from(("1", True, None, 1.5, [1])))
header_tables = st.builds(
    table,
    st.sampled_from(MODES),
    st.dictionaries(st.sampled_from(("a", "b", "c", "x-d")), header_values, max_size=3),
)
odd_messages = st.dictionaries(
    st.sampled_from(("a", "b", "c", "x-d", "e")),
    st.one_of(header_values, st.just(b"1"), st.just("b")),
    max_size=5,
)


@settings(max_examples=3000, deadline=None)
@given(header_tables, header_tables, odd_messages)
def test_a_claimed_headers_implication_holds_for_any_message_with_odd_values(
    cover: dict[str, Any], other: dict[str, Any], message: dict[str, Any]
) -> None:
    # Void values (presence), text and bytes, booleans, floats, arrays: whatever the
    # rules claim, the broker's own matcher agrees on every message.
    if claims(cover, other) and headers_match(other, message):
        assert headers_match(cover, message)


def _headers_binding(queue: str, arguments: dict[str, Any]) -> BindingDef:
    return BindingDef(exchange="x", queue=queue, routing_key="", arguments=arguments)


def _matched(upstream: set[fb.UpstreamBinding], messages: list[dict[str, Any]]) -> set[int]:
    return {
        i for i, m in enumerate(messages) if any(headers_match(b.arguments, m) for b in upstream)
    }


def expected_header_roots(needed: set[fb.UpstreamBinding]) -> set[fb.UpstreamBinding]:
    """The tables no other needed table dominates (implies; of equivalent ones the
    smallest JSON stays), computed plainly."""

    def dominates(a: fb.UpstreamBinding, b: fb.UpstreamBinding) -> bool:
        cover, form = fb.headers_form(a.arguments, as_cover=True), fb.headers_form(b.arguments)
        if cover is None or form is None or not fb.implies(cover, form):
            return False
        back = fb.headers_form(b.arguments, as_cover=True)
        return a.arguments_json < b.arguments_json or back is None or not fb.implies(back, cover)

    return {b for b in needed if not any(a != b and dominates(a, b) for a in needed)}


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.booleans(), st.integers(0, 3), header_tables), min_size=1, max_size=40)
)
def test_headers_subsumption_never_drops_a_message_a_local_binding_wants(
    steps: list[tuple[bool, int, dict[str, Any]]],
) -> None:
    needed = fb.UpstreamSet("headers")
    upstream: set[fb.UpstreamBinding] = set()
    local: dict[tuple[str, str], BindingDef] = {}
    messages = [*MESSAGES, {"c": 1}, {"c": 2, "a": 1}, {"a": "1"}, {"a": True}, {"a": None}]
    for add, queue, arguments in steps:
        binding = _headers_binding(f"q{queue}", arguments)
        key = (binding.queue, fb.normalise("headers", binding).arguments_json)
        if add and key not in local:
            local[key] = binding
            needed.add(binding)
        elif not add and key in local:
            needed.remove(local.pop(key))
        else:
            continue
        changes = needed.drain(upstream)
        before = _matched(upstream, messages)
        upstream |= set(changes.bind)
        assert before <= _matched(upstream, messages)  # binds first: nothing missed meanwhile
        upstream -= set(changes.unbind)
        # Every message a local binding matches crosses the link.
        wanted = {i for i, m in enumerate(messages)
                  if any(headers_match(b.arguments, m) for b in local.values())}  # fmt: skip
        assert wanted <= _matched(upstream, messages)
        normal = {fb.normalise("headers", b) for b in local.values()}
        assert upstream == needed.roots == expected_header_roots(normal)
        assert fb.UpstreamSet("headers", local.values()).roots == needed.roots


def test_a_table_matching_everything_covers_ten_thousand_and_they_come_back_before_it_goes() -> (
    None
):
    needed = fb.UpstreamSet("headers")
    upstream: set[fb.UpstreamBinding] = set()
    for i in range(10_000):
        needed.add(_headers_binding("q", {"x-match": "all", "type": "order", "id": i}))
    upstream |= set(needed.drain(upstream).bind)
    assert len(upstream) == 10_000
    # One pair they all hold covers them all; it goes, they come back (bound first).
    needed.add(_headers_binding("orders", {"type": "order"}))
    changes = needed.drain(upstream)
    assert len(changes.bind) == 1 and len(changes.unbind) == 10_000
    upstream = (upstream | set(changes.bind)) - set(changes.unbind)
    needed.remove(_headers_binding("orders", {"type": "order"}))
    changes = needed.drain(upstream)
    assert len(changes.bind) == 10_000 and len(changes.unbind) == 1
    assert fb.covered_by(changes.bind, changes.unbind, "headers") == changes.bind
