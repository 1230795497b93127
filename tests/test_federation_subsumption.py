"""Topic subsumption for binding propagation (sans-I/O): the coverage test against a
brute-force matcher over every routing key up to a length, the upstream set kept by
single changes against the set computed from scratch, and the link's durable record."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from twinmq.broker.definitions import BindingDef
from twinmq.broker.federation import bindings as fb

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
    assert fb.covers(cover, pattern) == brute_covers(cover, pattern)


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
