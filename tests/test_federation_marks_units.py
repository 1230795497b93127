"""What an upstream tells a link, as the dedup window uses it (sans-I/O): a told mark lets
keys go that the link never brings, never over what the link may still bring again, and
what a server tells in turn is the lowest of its links (broker/federation/marks.py)."""

from __future__ import annotations

from twinmq.broker.federation import marks
from twinmq.broker.federation.dedup import LagWindow, Told, scoped_origin
from twinmq.broker.federation.marks import ToldMarks

DELAY = 100  # keys a link's own marks wait before they count (4,096 in the broker)
NEVER = 2**63 - 1


def key(origin: str, seq: int) -> str:
    """A dedup key as `headers.arrival` makes it."""
    return f"{origin}\x00{seq}"


def diamond_window() -> LagWindow:
    """D's window: a link via B that brings A's messages, one via C that never does."""
    window = LagWindow(size=10)
    window.register("via-b", "/")
    window.register("via-c", "/")
    return window


def bring(window: LagWindow, link: str, seqs: range, told: Told | None = None) -> None:
    for seq in seqs:
        window.add(key("a", seq))
    window.passed(link, [key("a", seq) for seq in seqs], DELAY, told)


def test_without_marks_a_link_that_never_brings_an_origin_holds_every_key() -> None:
    window = diamond_window()
    for start in range(0, 5_000, 50):
        bring(window, "via-b", range(start, start + 50))
    assert len(window) == 5_000  # all of them, a bit each: via C has passed none


def test_a_told_mark_lets_the_keys_go_once_the_bringing_link_has_passed_them() -> None:
    window = diamond_window()
    for start in range(0, 5_000, 50):
        bring(window, "via-b", range(start, start + 50))
        # C tells, after its own deliveries (none of A's): A up to what it has forwarded.
        window.passed("via-c", [], DELAY, Told({"a": start + 49}))
    assert window.floor("a") == 5_000 - DELAY - 1  # via B's own marks, DELAY keys late
    assert len(window) <= DELAY + window.size
    assert window.forced == 0


def test_others_covers_every_origin_the_upstream_does_not_name() -> None:
    window = diamond_window()
    window.passed("via-c", [], DELAY, Told({}, others=NEVER))
    for start in range(0, 1_000, 50):
        bring(window, "via-b", range(start, start + 50))
    assert len(window) <= DELAY + window.size


def test_a_told_mark_never_passes_what_the_link_itself_may_bring_again() -> None:
    """Keys via C brought (its acks may be lost in a cut: it brings them again first in
    the next session) stay known whatever C tells, until C tells them settled for good."""
    window = diamond_window()
    window.add(key("a", 7))
    window.passed("via-c", [key("a", 7)], DELAY, None, (1, 1))  # delivery tag 1
    window.passed("via-c", [], DELAY, Told({"a": 1_000}), (1, 1))
    assert window.mark("via-c", "a") == 6
    for start in range(0, 1_000, 50):
        bring(window, "via-b", range(start, start + 50))
    assert key("a", 7) in window  # kept for via C
    # Told with tag 1 acknowledged and settled for good upstream: never delivered again.
    window.passed("via-c", [], DELAY, Told({"a": 1_000}, acked=1), (1, 1))
    assert window.mark("via-c", "a") == 1_000
    assert key("a", 7) not in window


def test_settled_for_good_covers_the_sessions_before_and_the_tags_told_only() -> None:
    window = diamond_window()
    window.passed("via-c", [key("a", 5)], DELAY, None, (1, 9))  # session 1, tag 9
    window.passed("via-c", [key("a", 6)], DELAY, None, (2, 3))  # session 2, tag 3
    window.passed("via-c", [key("a", 8)], DELAY, None, (2, 4))
    window.passed("via-c", [], DELAY, Told({"a": 100}, acked=3), (2, 4))
    # Session 1's and tag 3's are settled; tag 4 (seq 8) may come again.
    assert window.mark("via-c", "a") == 7


def test_a_new_session_forgets_what_the_upstream_told_before() -> None:
    window = diamond_window()
    window.passed("via-c", [], DELAY, Told({"a": 500}, others=NEVER))
    assert window.mark("via-c", "a") == 500
    window.told_reset("via-c")
    assert window.mark("via-c", "a") == -1
    assert window.mark("via-c", "z") == -1


def test_a_link_never_brings_another_vhosts_keys() -> None:
    window = LagWindow(size=10)
    window.register("in-t1", "t1")
    window.register("in-root", "/")
    other = scoped_origin("t1", "a")
    assert window.mark("in-root", other) == NEVER
    assert window.mark("in-t1", other) == -1


def test_a_server_tells_the_lowest_mark_of_its_links_and_nothing_without_them() -> None:
    upstream = LagWindow(size=10)
    assert upstream.tell("/") == ({}, NEVER)  # no link: none but its own messages
    upstream.register("from-a", "/")
    upstream.register("from-e", "/")
    upstream.passed("from-a", [], DELAY, Told({"a": 900}, others=NEVER))
    named, others = upstream.tell("/")
    assert named == {"a": -1}  # from-e has told nothing
    assert others == -1
    upstream.passed("from-e", [], DELAY, Told({"a": 700}, others=50))
    assert upstream.tell("/") == ({"a": 700}, 50)


def test_the_marks_frame_reads_back_and_an_unknown_version_is_ignored() -> None:
    told = ToldMarks(queue="federation: t -> d", marks={"a": 12, "c": 3}, others=-1, acked=4)
    frame = marks.encode(told, 1)
    assert frame[0] == 1 and frame[-1] == 0xCE  # an AMQP method frame
    payload = frame[7:-1]
    assert marks.is_marks(payload)
    assert marks.decode(payload) == told
    later = payload[:4] + b'{"v": 2, "marks": {"a": 99}}'
    assert marks.decode(later) == ToldMarks()  # nothing believed
    assert marks.decode(b"\x00\x3c\x00\x28") is None  # basic.publish: not a marks frame
