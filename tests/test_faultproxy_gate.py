"""The link proxy's frame gate (`testing/faultproxy.py`, `hold_after`), fed the bytes of
a length-prefixed stream in pieces as a socket would give them."""

from __future__ import annotations

import struct

from twinmq.testing.faultproxy import _FrameGate, _Last


def frame(kind: int, body: bytes = b"") -> bytes:
    return struct.pack(">IB", len(body) + 1, kind) + body


def fed(gate: _FrameGate, stream: bytes, piece: int) -> tuple[bytes, bool]:
    """What the gate passes of `stream` fed `piece` bytes at a time; whether a `_Last` came."""
    out = bytearray()
    last = False
    for at in range(0, len(stream), piece):
        passed = gate.feed(stream[at : at + piece])
        last = last or isinstance(passed, _Last)
        out += passed
    return bytes(out), last


STREAM = [frame(6, b"a" * 10), frame(6, b"KEY" + b"b" * 20), frame(9), frame(15, b"c" * 30),
          frame(9, b"p"), frame(6, b"d")]  # fmt: skip


def test_the_gate_passes_up_to_the_accepted_frame_and_nothing_after() -> None:
    for piece in (1, 3, 7, 1000):
        gate = _FrameGate(lambda f: b"KEY" in f)
        passed, last = fed(gate, b"".join(STREAM), piece)
        assert passed == b"".join(STREAM[:2]) and last, piece


def test_frames_passing_after_the_accepted_one_are_let_through_whole_and_in_order() -> None:
    for piece in (1, 3, 7, 1000):
        gate = _FrameGate(lambda f: b"KEY" in f, passing=lambda f: f[0] == 9)
        passed, last = fed(gate, b"".join(STREAM), piece)
        assert passed == b"".join([*STREAM[:2], STREAM[2], STREAM[4]]) and last, piece
