"""The replication link's wire format: length-prefixed frames, sans-I/O.

    frame = u32 length (of what follows) | u8 type | payload

Control frames carry JSON of the pydantic models below; `BATCH` carries a
batch number, flags and the journal's own op encoding, so the passive writes
exactly the record groups the active wrote (live batches), or one catch-up
chunk (`catchup.py`); `ACK` and `CATCHUP_ACK` a batch or chunk number.
"""

from __future__ import annotations

import array
import binascii
import enum
import hashlib
import hmac
import struct
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Final, overload

from pydantic import BaseModel, Field

MAX_FRAME: Final = 512 * 1024 * 1024
_HEAD = struct.Struct(">IB")
_BATCH = struct.Struct(">QB")
_U64 = struct.Struct(">Q")


class FrameType(enum.IntEnum):
    """Frame types of the replication link."""

    CHALLENGE = 1  # active -> passive: Challenge
    HELLO = 2  # passive -> active: Hello
    REFUSE = 3  # either way: Refuse, then the link closes
    SNAPSHOT = 4  # passive -> active: Snapshot
    DEFINITIONS = 5  # active -> passive: Definitions (topology)
    BATCH = 6  # active -> passive: batch number, flags, ops
    CAUGHT_UP = 7  # active -> passive: u64 batch that completes the catch-up
    ACK = 8  # passive -> active: u64 batch durable on the passive
    PING = 9  # either way, keeps the link's liveness visible
    CATCHUP_ACK = 10  # passive -> active: u64 catch-up chunk durable on the passive


# BATCH flags. A catch-up chunk's batch number counts chunks (1, 2, ...), acknowledged
# by CATCHUP_ACK; a live batch's is the active's commit batch, acknowledged by ACK.
BATCH_CATCHUP: Final = 1
BATCH_CATCHUP_LAST: Final = 2  # the catch-up's final chunk


class Challenge(BaseModel):
    """Sent by the active on accept."""

    name: str
    epoch: int
    nonce: str


class Hello(BaseModel):
    """The passive's answer: who it is, its epoch, and proof it knows the shared token."""

    name: str
    epoch: int
    proof: str


class Refuse(BaseModel):
    """Why a link is refused (a stale epoch, a bad proof, not active)."""

    reason: str
    epoch: int


class Snapshot(BaseModel):
    """The passive's replication IDs per queue incarnation (qid).

    `packed` carries them as `pack_ids` does: a million IDs validate in a few
    ms, where a JSON list of them holds the active's event loop for 100 ms or
    more; the active decodes them a slice at a time (`PackedIds`). `queues`,
    plain lists, is read too.
    """

    queues: dict[int, list[int]] = Field(default_factory=dict)
    packed: dict[int, str] = Field(
        default_factory=dict, description="per qid: base64 of the IDs as little-endian u64"
    )

    @classmethod
    def of(cls, ids: Mapping[int, Iterable[int]]) -> Snapshot:
        """The snapshot of `ids` per qid, packed."""
        return cls(packed={qid: pack_ids(mids) for qid, mids in ids.items()})

    def ids(self) -> dict[int, Sequence[int]]:
        """The IDs per qid, packed ones decoded lazily."""
        out: dict[int, Sequence[int]] = {qid: PackedIds(text) for qid, text in self.packed.items()}
        out.update(self.queues)
        return out


def pack_ids(ids: Iterable[int]) -> str:
    """Replication IDs as base64 of little-endian u64s."""
    packed = array.array("Q", ids)
    if sys.byteorder != "little":
        packed.byteswap()
    return binascii.b2a_base64(packed.tobytes(), newline=False).decode()


class PackedIds(Sequence[int]):
    """The IDs of `pack_ids` text; a slice decodes only the base64 it covers."""

    def __init__(self, text: str) -> None:
        self._text = text
        padding = text[-2:].count("=")
        self._len = (len(text) // 4 * 3 - padding) // 8

    def __len__(self) -> int:
        return self._len

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, int):
            return self[index : index + 1 if index != -1 else None][0]
        start, stop, step = index.indices(self._len)
        if step != 1:
            raise ValueError("PackedIds slices have step 1")
        if stop <= start:
            return []
        first, end = start * 8, stop * 8  # byte range
        group = first // 3  # base64 encodes 3 bytes as 4 characters
        raw = binascii.a2b_base64(self._text[group * 4 : (end + 2) // 3 * 4])
        values = array.array("Q")
        values.frombytes(raw[first - group * 3 : first - group * 3 + end - first])
        if sys.byteorder != "little":
            values.byteswap()
        return values.tolist()


def proof(token: str, nonce: str) -> str:
    """HMAC-SHA256 of the challenge nonce under the shared replication token."""
    return hmac.new(token.encode(), nonce.encode(), hashlib.sha256).hexdigest()


def encode(ftype: FrameType, payload: bytes | BaseModel = b"") -> bytes:
    """One frame."""
    data = payload.model_dump_json().encode() if isinstance(payload, BaseModel) else payload
    return _HEAD.pack(len(data) + 1, ftype) + data


def encode_batch(batch: int, flags: int, ops: bytes | bytearray) -> bytes:
    """A BATCH frame around already-encoded ops."""
    return _HEAD.pack(len(ops) + 1 + _BATCH.size, FrameType.BATCH) + _BATCH.pack(batch, flags) + ops


def encode_u64(ftype: FrameType, value: int) -> bytes:
    """An ACK, CATCHUP_ACK or CAUGHT_UP frame."""
    return encode(ftype, _U64.pack(value))


def decode_batch(payload: bytes) -> tuple[int, int, bytes]:
    """(batch, flags, ops bytes) of a BATCH payload."""
    batch, flags = _BATCH.unpack_from(payload)
    return batch, flags, payload[_BATCH.size :]


def decode_u64(payload: bytes) -> int:
    """The value of an ACK, CATCHUP_ACK or CAUGHT_UP payload."""
    (value,) = _U64.unpack(payload)
    return int(value)


class ProtocolError(Exception):
    """The peer broke the replication protocol; the link is closed."""


class FrameDecoder:
    """Bytes in, (type, payload) frames out."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[FrameType, bytes]]:
        """Add received bytes; return the frames they complete."""
        buf = self._buf
        buf += data
        frames: list[tuple[FrameType, bytes]] = []
        pos = 0
        while len(buf) - pos >= _HEAD.size:
            length, ftype = _HEAD.unpack_from(buf, pos)
            if length < 1 or length > MAX_FRAME:
                raise ProtocolError(f"frame length {length} out of range")
            end = pos + 4 + length
            if end > len(buf):
                break
            try:
                kind = FrameType(ftype)
            except ValueError as exc:
                raise ProtocolError(f"unknown frame type {ftype}") from exc
            frames.append((kind, bytes(buf[pos + _HEAD.size : end])))
            pos = end
        if pos:
            del buf[:pos]
        return frames
