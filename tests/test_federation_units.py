"""Federation's pure parts: the file's validation, binding normalisation, the path and
max-hops decision, origin stamping, the durable dedup window, the handshake refusal."""

from __future__ import annotations

from pathlib import Path

import pytest
from pamqp import commands

from twinmq.broker import codec, fieldtable
from twinmq.broker.definitions import BindingDef
from twinmq.broker.federation import bindings as fb
from twinmq.broker.federation.config import FederationConfigError, load
from twinmq.broker.federation.dedup import QUEUE_NAME, SPAN, DurableKeys, LagWindow
from twinmq.broker.federation.headers import (
    ORIGIN,
    ORIGIN_SEQ,
    PATH,
    arrival,
    departure,
    forwarded,
    stamp_origin,
    strip_federation,
)
from twinmq.broker.federation.identity import SERVER_ID_PROPERTY, duplicate_refusal
from twinmq.broker.federation.state import Rows, StateMessage, StateView, difference
from twinmq.testing.rawamqp import PROTOCOL_HEADER, decode_frames, encode
from twinmq.testing.sansio import Harness


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "federation.yaml"
    path.write_text(text)
    return path


def test_a_federation_file_in_yaml_reads_with_its_defaults(tmp_path: Path) -> None:
    config = load(
        _write(
            tmp_path,
            "upstreams:\n  central: {uri: 'amqp://fed@central:5672/', password-env: PW}\n"
            "exchanges:\n  - {exchange: market, upstream: central}\n",
        )
    )
    fed = config.exchanges[0]
    assert (fed.source_exchange, fed.max_hops, fed.type) == ("market", 1, "topic")


def test_a_password_in_the_upstream_uri_is_refused(tmp_path: Path) -> None:
    path = _write(tmp_path, "upstreams:\n  c: {uri: 'amqp://u:secret@h/'}\n")
    with pytest.raises(FederationConfigError, match="password-env or password-file") as err:
        load(path)
    assert "secret" not in str(err.value)  # never logged


def test_an_exchange_naming_an_unknown_upstream_is_refused_with_both_names(
    tmp_path: Path,
) -> None:
    path = _write(
        tmp_path,
        "upstreams:\n  central: {uri: 'amqp://h/'}\n"
        "exchanges:\n  - {exchange: x, upstream: other}\n",
    )
    with pytest.raises(FederationConfigError, match="'other', which is not among the upstreams"):
        load(path)


def test_the_password_comes_from_the_environment_into_the_connect_uri_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FED_PW", "p@ss word")
    config = load(
        _write(tmp_path, "upstreams:\n  c: {uri: 'amqp://fed@h:5673/', password-env: FED_PW}\n")
    )
    upstream = config.upstreams["c"]
    assert upstream.connect_uri() == "amqp://fed:p%40ss%20word@h:5673/"
    assert "p@ss" not in upstream.shown()


def _binding(queue: str, key: str, **arguments: object) -> BindingDef:
    return BindingDef(exchange="x", queue=queue, routing_key=key, arguments=dict(arguments))


def test_identical_keys_normalise_to_one_upstream_binding_with_a_reference_count() -> None:
    counts = fb.needed("topic", [_binding("a", "k.*"), _binding("b", "k.*"), _binding("c", "z")])
    assert counts == {fb.UpstreamBinding("k.*"): 2, fb.UpstreamBinding("z"): 1}


def test_fanout_bindings_normalise_to_one_and_headers_bindings_by_their_arguments() -> None:
    assert set(fb.needed("fanout", [_binding("a", "1"), _binding("b", "2")])) == {
        fb.UpstreamBinding("")
    }
    headers = fb.needed(
        "headers",
        [
            _binding("a", "1", **{"x-match": "all", "k": "v"}),
            _binding("b", "2", k="v", **{"x-match": "all"}),
        ],
    )
    assert len(headers) == 1
    assert next(iter(headers)).arguments == {"k": "v", "x-match": "all"}


def test_a_resync_unbinds_whatever_may_be_held_and_is_not_wanted() -> None:
    old, kept, new = (
        fb.UpstreamBinding("old"),
        fb.UpstreamBinding("kept"),
        fb.UpstreamBinding("new"),
    )
    changes = fb.resync({old, kept}, {kept, new})
    assert (changes.bind, changes.unbind) == ([kept, new], [old])
    assert fb.decode(fb.encode({old, kept})) == {old, kept}


def test_a_message_is_forwarded_with_the_path_extended_and_keyed_by_origin_and_seq() -> None:
    verdict = arrival({ORIGIN: "a", ORIGIN_SEQ: 7}, "a", "b", max_hops=1)
    assert (verdict.verdict, verdict.dedup_key, verdict.path) == ("forward", "a\x007", ["a", "b"])


def test_a_message_that_crossed_this_server_is_dropped_as_a_loop() -> None:
    headers = {ORIGIN: "a", ORIGIN_SEQ: 7, "x-twinmq-federation-path": ["a", "b"]}
    assert arrival(headers, "b", "a", max_hops=5).verdict == "loop"


def test_a_message_past_max_hops_is_dropped() -> None:
    headers = {ORIGIN: "a", ORIGIN_SEQ: 7, "x-twinmq-federation-path": ["a", "b"]}
    assert arrival(headers, "b", "c", max_hops=1).verdict == "too-many-hops"
    assert arrival(headers, "b", "c", max_hops=2).verdict == "forward"


def test_the_upstream_stamps_origin_and_seq_once_and_keeps_every_other_property() -> None:
    properties = commands.Basic.Properties(
        content_type="text/plain", headers={"app": "x"}, message_id="m1", delivery_mode=2
    )
    header = codec.encode_header_payload(properties, 5)
    stamped = stamp_origin(header, "central", 42)
    decoded = codec.decode_properties(stamped)
    assert decoded.headers == {"app": "x", ORIGIN: "central", ORIGIN_SEQ: 42}
    assert (decoded.content_type, decoded.message_id, decoded.delivery_mode) == (
        "text/plain", "m1", 2,
    )  # fmt: skip
    # Stamped already (it came through another link): origin and seq kept.
    assert stamp_origin(stamped, "other", 99) == stamped
    table = codec.decode_headers(
        stamp_origin(codec.encode_header_payload(commands.Basic.Properties(), 0), "c", 1)
    )
    assert fieldtable.as_int(table.get(ORIGIN_SEQ)) == 1


def test_a_clients_federation_headers_are_stripped_and_nothing_else_changes() -> None:
    forged = commands.Basic.Properties(
        content_type="text/plain", message_id="m1", delivery_mode=2,
        headers={"app": "x", ORIGIN: "central", ORIGIN_SEQ: 42, PATH: ["central"]},
    )  # fmt: skip
    stripped = codec.decode_properties(strip_federation(codec.encode_header_payload(forged, 5)))
    assert stripped.headers == {"app": "x"}
    assert (stripped.content_type, stripped.message_id, stripped.delivery_mode) == (
        "text/plain", "m1", 2,
    )  # fmt: skip
    clean = codec.encode_header_payload(commands.Basic.Properties(headers={"app": "x"}), 5)
    assert strip_federation(clean) is clean  # byte for byte, not even re-encoded
    only = commands.Basic.Properties(headers={ORIGIN: "central", ORIGIN_SEQ: 42})
    assert (
        codec.decode_properties(strip_federation(codec.encode_header_payload(only, 0))).headers
        is None
    )  # the property dropped with its last header


def test_a_forwarded_message_is_stamped_here_with_the_path_ending_upstream() -> None:
    properties = commands.Basic.Properties(
        content_type="text/plain", headers={"app": "x"}, reply_to="amq.gen-b.r", delivery_mode=2
    )
    header = codec.encode_header_payload(properties, 3)
    verdict = departure(header, "b", 17, "a", max_hops=1)
    assert verdict.verdict == "forward"
    decoded = codec.decode_properties(verdict.header)
    assert decoded.headers == {"app": "x", ORIGIN: "b", ORIGIN_SEQ: 17, PATH: ["b", "a"]}
    assert (decoded.content_type, decoded.reply_to, decoded.delivery_mode) == (
        "text/plain", "amq.gen-b.r", 2,
    )  # fmt: skip
    # The upstream: keyed by the downstream's origin and seq, not a loop there.
    arrived = forwarded(decoded.headers, "a")
    assert (arrived.verdict, arrived.dedup_key) == ("forward", "b\x0017")


def test_a_message_that_came_from_the_upstream_is_never_forwarded_back() -> None:
    properties = commands.Basic.Properties(headers={ORIGIN: "a", ORIGIN_SEQ: 5, PATH: ["a", "b"]})
    header = codec.encode_header_payload(properties, 0)
    assert departure(header, "b", 9, "a", max_hops=3).verdict == "loop"
    # ... and one that did reach the upstream by another path is dropped there.
    assert forwarded({ORIGIN: "a", ORIGIN_SEQ: 5, PATH: ["a", "c", "a"]}, "a").verdict == "loop"


def test_a_forward_past_max_hops_is_not_sent() -> None:
    header = codec.encode_header_payload(
        commands.Basic.Properties(headers={ORIGIN: "c", ORIGIN_SEQ: 1, PATH: ["c", "b"]}), 0
    )
    assert departure(header, "b", 9, "a", max_hops=1).verdict == "too-many-hops"
    kept = departure(header, "b", 9, "a", max_hops=2)
    assert kept.verdict == "forward"
    assert codec.decode_properties(kept.header).headers[ORIGIN] == "c"  # kept, not restamped


def test_the_dedup_window_is_journaled_and_rebuilt_after_a_restart_and_stays_bounded(
    tmp_path: Path,
) -> None:
    harness = Harness(tmp_path)
    try:
        keys = DurableKeys(size=3)
        keys.load(harness.vhost)
        for batch in (["a", "b"], ["c", "d"], ["e", "f", "g"]):
            for key in batch:
                keys.claim(key)
            assert all(key in keys for key in batch)  # claimed: in flight
            harness.committer.add(keys.record(harness.vhost, batch))
            harness.commit()
            keys.settle(batch, [])
    finally:
        harness.close()
    again = Harness(tmp_path)  # recovered from the journal
    try:
        keys = DurableKeys(size=3)
        keys.load(again.vhost)
        # The oldest records were settled once the newer ones held the window's worth.
        assert [k in keys for k in "abcdefg"] == [False] * 4 + [True] * 3
        assert len(again.vhost.queues[QUEUE_NAME].entries) == 1
    finally:
        again.close()


def test_a_failed_republish_releases_its_claim() -> None:
    keys = DurableKeys(size=10)
    keys.claim("k")
    keys.settle([], ["k"])
    assert "k" not in keys


def test_the_window_keeps_keys_a_lagging_link_has_not_passed_up_to_its_bound() -> None:
    window = LagWindow(size=2)
    window.passed("direct", ["a\x001"])
    window.passed("via-b", ["a\x001"])
    for seq in range(2, 6):  # come by the direct link; the one via b is behind
        window.add(f"a\x00{seq}")
        window.passed("direct", [f"a\x00{seq}"])
    assert all(f"a\x00{seq}" in window for seq in range(2, 6))
    window.passed("via-b", ["a\x003"])  # it caught up to 3: 2 and 3 may go
    assert [f"a\x00{seq}" in window for seq in range(2, 6)] == [False, False, True, True]
    window.add("b\x007")
    window.add("held\x00ff")
    assert "b\x007" in window and len(window) == 4
    for seq in range(100, 100 + 8 * SPAN, 2 * SPAN):  # a link behind for good: bounded
        window.add(f"a\x00{seq}")
    assert sum(bits.span for bits in window.lagged.values()) <= 2 * SPAN
    assert window.forced > 0  # forgotten while a link had not passed them: counted


def test_the_window_waits_for_every_link_even_one_that_never_brought_the_origin() -> None:
    window = LagWindow(size=1)
    window.register("direct")
    window.register("via-b")  # has brought nothing yet: may still bring any origin
    for seq in range(1, 4):
        window.add(f"a\x00{seq}")
        window.passed("direct", [f"a\x00{seq}"])
    assert all(f"a\x00{seq}" in window for seq in range(1, 4))
    window.passed("via-b", ["b\x009"])  # another origin: says nothing of a's keys
    assert all(f"a\x00{seq}" in window for seq in range(1, 4))
    window.passed("via-b", ["a\x002"])  # it has passed 2 of a: 1 and 2 may go
    assert [f"a\x00{seq}" in window for seq in range(1, 4)] == [False, False, True]
    assert window.forced == 0


def test_a_links_mark_counts_only_once_it_brought_more_than_a_cut_can_bring_again() -> None:
    window = LagWindow(size=1)
    window.passed("direct", ["a\x001", "a\x002"], delay=2)
    window.passed("via-b", ["a\x001", "a\x002"], delay=2)
    window.add("a\x001")
    window.add("a\x002")
    assert "a\x001" in window  # neither link's mark is in force yet: 1 may come again
    window.passed("direct", ["a\x003", "a\x004"], delay=2)
    window.passed("via-b", ["a\x003"], delay=2)
    assert "a\x001" in window  # via b has brought only one more key since
    window.passed("via-b", ["a\x004"], delay=2)
    assert "a\x001" not in window and "a\x002" in window


def test_a_peer_announcing_this_servers_identifier_is_refused_at_the_handshake(
    tmp_path: Path,
) -> None:
    assert duplicate_refusal("a", "b", side="upstream") is None
    text = duplicate_refusal("a", b"a", side="downstream")
    assert text is not None and "duplicate server id 'a'" in text
    harness = Harness(tmp_path)
    try:
        peer = harness.connect()
        started = decode_frames(peer.feed(PROTOCOL_HEADER))
        assert started[0][1].server_properties[SERVER_ID_PROPERTY] == "sansio"  # type: ignore[union-attr]
        start_ok = commands.Connection.StartOk(
            client_properties={SERVER_ID_PROPERTY: "sansio"},
            mechanism="PLAIN",
            response="\0guest\0guest",
        )
        answer = decode_frames(peer.feed(encode(0, start_ok)))
        close = answer[-1][1]
        assert isinstance(close, commands.Connection.Close)
        assert close.reply_code == 530 and "duplicate server id 'sansio'" in close.reply_text
    finally:
        harness.close()


def test_no_two_internal_queues_share_a_qid() -> None:
    """The journal files messages by qid: two internal queues with one qid would take each
    other's records at recovery (the federation's dedup keys and the mirror's orphans once
    did: both were INTERNAL_QID_BASE + 4). Every `X_QID: Final = INTERNAL_QID_BASE + n`
    of the broker's source is found and compared, so a new one cannot slip past."""
    import re

    broker = Path(__file__).resolve().parent.parent / "broker"
    pattern = re.compile(r"^(\w*QID\w*): Final = INTERNAL_QID_BASE \+ (.+)$", re.M)
    found = {
        f"{path.relative_to(broker)}:{name}": eval(offset, {})  # our own source: "1", "(1 << 32)"
        for path in broker.rglob("*.py")
        for name, offset in pattern.findall(path.read_text())
    }
    assert len(found) >= 7, found  # the mirror's five, the federation's two
    offsets = sorted(found.values())
    assert len(set(offsets)) == len(offsets), found


def test_global_keys_on_an_exchange_that_does_not_route_by_key_are_refused(
    tmp_path: Path,
) -> None:
    path = _write(
        tmp_path,
        "upstreams:\n  c: {uri: 'amqp://h/'}\n"
        "exchanges:\n  - {exchange: e, upstream: c, type: fanout, global-keys: true}\n",
    )
    with pytest.raises(FederationConfigError, match="global-keys needs a direct or topic"):
        load(path)


def test_a_state_view_applies_changes_after_its_full_state_only() -> None:
    def message(kind: str, seq: int, **parts: object) -> StateMessage:
        return StateMessage.model_validate(
            {"kind": kind, "server_id": "a", "epoch": 3, "seq": seq, "time": 0.0, **parts}
        )

    queue = {"name": "q", "durable": True, "exclusive": False, "auto_delete": False}
    view = StateView()
    # Before any full state, and at or before its seq: already in it, ignored.
    assert not view.apply(message("changes", 1, queues=[queue]))
    assert view.apply(message("full", 2, queues=[queue]))
    assert not view.apply(message("changes", 2, removed={"queues": ["q"]}))
    assert view.state is not None and set(view.state.queues) == {"q"}
    assert view.apply(message("changes", 3, removed={"queues": ["q"]}))
    assert view.state.queues == {}
    # A new full state replaces everything (nothing stale after a re-subscribe).
    exchange = {"name": "x", "type": "topic", "durable": True, "auto_delete": False}
    view.apply(message("full", 1, exchanges=[{**exchange, "internal": False}]))
    assert (set(view.state.exchanges), view.state.queues) == ({"x"}, {})


def test_a_state_difference_names_what_appeared_changed_and_went() -> None:
    durable = (True, False, False, "{}")
    old = Rows(queues={"a": durable, "b": durable}, bindings={("x", "a", "k", "{}")})
    new = Rows(queues={"b": (False, False, False, "{}"), "c": durable})
    added, removed = difference(old, new)
    assert sorted(added.queues) == ["b", "c"] and sorted(removed.queues) == ["a"]
    assert removed.bindings == {("x", "a", "k", "{}")} and not added.bindings
    assert not any(difference(new, new))
