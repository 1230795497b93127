"""The replication link's wire format: length-prefixed frames, sans-I/O.

    frame = u32 length (of what follows) | u8 type | payload

Control frames carry JSON of the pydantic models below; `BATCH` carries a
batch number, flags and the journal's own op encoding, so the passive writes
exactly the record groups the active wrote (live batches), or one catch-up
chunk (`catchup.py`); `DEDUP_KEYS` the same header and a catch-up chunk of the
active's duplicate-detection keys (`encode_key`); `WITHDRAW` the same header and
the ops that undo a batch whose write failed on the active; `ACK`, `CATCHUP_ACK`
and `WITHDRAWN` a batch or chunk number.

Until both ends are authenticated (`handshake.py`) a frame may be at most
`MAX_HANDSHAKE_FRAME` bytes; after that, `MAX_FRAME`.
"""

from __future__ import annotations

import array
import binascii
import enum
import struct
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Final, TypeVar, overload

from pydantic import BaseModel, Field, ValidationError

MAX_FRAME: Final = 512 * 1024 * 1024
# The handshake's frames are a few short JSON fields: anything bigger is not a peer.
MAX_HANDSHAKE_FRAME: Final = 4096
PROTOCOL_VERSION: Final = 3  # 2: mutual authentication (WELCOME); 3: DEDUP_KEYS
_HEAD = struct.Struct(">IB")
_BATCH = struct.Struct(">QB")
_U64 = struct.Struct(">Q")
# What the length of a BATCH-shaped frame counts besides its body (type, batch, flags).
BATCH_HEAD_BYTES: Final = 1 + _BATCH.size
_KEY_LEN = struct.Struct(">H")


class FrameType(enum.IntEnum):
    """Frame types of the replication link."""

    CHALLENGE = 1  # active -> passive: Challenge (unauthenticated)
    HELLO = 2  # passive -> active: Hello, the passive's proof
    REFUSE = 3  # either way: Refuse, then the link closes (ignored before authentication)
    SNAPSHOT = 4  # passive -> active: Snapshot
    DEFINITIONS = 5  # active -> passive: Definitions (topology)
    BATCH = 6  # active -> passive: batch number, flags, ops
    CAUGHT_UP = 7  # active -> passive: u64 batch that completes the catch-up
    ACK = 8  # passive -> active: u64 batch durable on the passive
    PING = 9  # either way, keeps the link's liveness visible
    WELCOME = 10  # active -> passive: Welcome, the active's proof
    CATCHUP_ACK = 11  # passive -> active: u64 catch-up chunk durable on the passive
    DEDUP_KEYS = 12  # active -> passive: chunk number, flags, dedup window keys (catch-up)
    # active -> passive: DefinitionsDelta, one topology change; only to a passive whose
    # Snapshot said `definitions_delta` (an older one gets DEFINITIONS, whole, instead)
    DEFINITIONS_DELTA = 13
    # The DR mirror link only (broker/mirror/delta.py), both ways: a source's
    # ReconcileRequest, a mirror's ReconcileReply, before any event of the session
    RECONCILE = 14
    # active -> passive: the failed batch's number, flags (0), and the ops that undo it on
    # the passive (discards of its messages, its undone acks' messages stored again); only
    # to a passive whose Snapshot said `withdrawals` (an older one is made to catch up).
    # With WITHDRAW_FORGET, the body is instead the dedup keys (as DEDUP_KEYS) of the
    # failed batch's publishes, to forget; sent just before the ops (a passive whose
    # Snapshot said `withdrawal_keys`; an older one is made to catch up if there are any)
    WITHDRAW = 15
    WITHDRAWN = 16  # passive -> active: u64 failed batch whose WITHDRAW is durable here


# BATCH (and DEDUP_KEYS) flags. A catch-up chunk's batch number counts chunks (1, 2, ...),
# acknowledged by CATCHUP_ACK; a live batch's is the active's commit batch, acknowledged by ACK.
BATCH_CATCHUP: Final = 1
BATCH_CATCHUP_LAST: Final = 2  # the catch-up's final chunk
# WITHDRAW flag: the body holds dedup keys to forget, not ops (acknowledged by nothing:
# the WITHDRAW of ops that follows it is, once the window without them is saved).
WITHDRAW_FORGET: Final = 4


class Challenge(BaseModel):
    """Sent by the listening broker on accept: its name and a fresh nonce, nothing to act on."""

    version: int = 1  # absent in version 1's challenge; every newer one names its own
    name: str = Field(max_length=253)
    nonce: str = Field(min_length=32, max_length=64)


class Hello(BaseModel):
    """The passive's answer: who it is, its epoch, its own nonce, and its proof over both."""

    name: str = Field(max_length=253)
    epoch: int = Field(ge=0)
    nonce: str = Field(min_length=32, max_length=64)
    proof: str = Field(max_length=64)


class Welcome(BaseModel):
    """The active's answer to a valid hello: its epoch and its proof over both nonces."""

    epoch: int = Field(ge=0)
    proof: str = Field(max_length=64)


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
    # A capability: this passive applies DEFINITIONS_DELTA frames. Absent (False) from
    # older passives, which an active then sends the whole topology at every change.
    definitions_delta: bool = False
    # A capability: this passive applies WITHDRAW frames (an older one is made to catch
    # up again instead, `ReplicationSource.resync`).
    withdrawals: bool = False
    # A capability: this passive forgets the keys of a WITHDRAW_FORGET frame.
    withdrawal_keys: bool = False

    @classmethod
    def of(
        cls,
        ids: Mapping[int, Iterable[int]],
        *,
        definitions_delta: bool = True,
        withdrawals: bool = True,
        withdrawal_keys: bool = True,
    ) -> Snapshot:
        """The snapshot of `ids` per qid, packed (with this version's capabilities)."""
        return cls(
            packed={qid: pack_ids(mids) for qid, mids in ids.items()},
            definitions_delta=definitions_delta,
            withdrawals=withdrawals,
            withdrawal_keys=withdrawal_keys,
        )

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
        # Only the shape is checked here (a full decode of a million IDs holds the
        # loop); a slice that does not decode raises ProtocolError when read.
        padding = text[-2:].count("=")
        size = len(text) // 4 * 3 - padding
        if len(text) % 4 or size % 8:
            raise ProtocolError(f"packed IDs of {len(text)} characters are not whole u64s")
        self._text = text
        self._len = size // 8

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
        try:
            raw = binascii.a2b_base64(self._text[group * 4 : (end + 2) // 3 * 4], strict_mode=True)
            values = array.array("Q")
            values.frombytes(raw[first - group * 3 : first - group * 3 + end - first])
        except ValueError as exc:  # binascii.Error included
            raise ProtocolError(f"packed IDs do not decode: {exc}") from None
        if sys.byteorder != "little":
            values.byteswap()
        return values.tolist()


def encode(ftype: FrameType, payload: bytes | BaseModel = b"") -> bytes:
    """One frame."""
    data = payload.model_dump_json().encode() if isinstance(payload, BaseModel) else payload
    return _HEAD.pack(len(data) + 1, ftype) + data


def encode_batch(
    batch: int, flags: int, body: bytes | bytearray, ftype: FrameType = FrameType.BATCH
) -> bytes:
    """A BATCH frame around already-encoded ops (or a DEDUP_KEYS frame around keys)."""
    return _HEAD.pack(len(body) + 1 + _BATCH.size, ftype) + _BATCH.pack(batch, flags) + body


def encode_u64(ftype: FrameType, value: int) -> bytes:
    """An ACK, CATCHUP_ACK, CAUGHT_UP or WITHDRAWN frame."""
    return encode(ftype, _U64.pack(value))


def decode_batch(payload: bytes) -> tuple[int, int, bytes]:
    """(batch, flags, body bytes) of a BATCH or DEDUP_KEYS payload."""
    if len(payload) < _BATCH.size:
        raise ProtocolError(f"a chunk of {len(payload)} bytes has no header")
    batch, flags = _BATCH.unpack_from(payload)
    return batch, flags, payload[_BATCH.size :]


def encode_key(buf: bytearray, key: str) -> None:
    """Append one dedup key (u16 length, UTF-8; lone surrogates kept: any str round-trips)."""
    data = key.encode("utf-8", "surrogatepass")
    buf += _KEY_LEN.pack(len(data))
    buf += data


def decode_keys(body: bytes) -> list[str]:
    """The dedup keys of a DEDUP_KEYS body; ProtocolError if it does not decode whole."""
    keys: list[str] = []
    pos, end = 0, len(body)
    try:
        while pos < end:
            (length,) = _KEY_LEN.unpack_from(body, pos)
            pos += _KEY_LEN.size
            if pos + length > end:
                raise ProtocolError("a dedup key runs past its chunk")
            keys.append(body[pos : pos + length].decode("utf-8", "surrogatepass"))
            pos += length
    except (struct.error, UnicodeDecodeError) as exc:
        raise ProtocolError(f"malformed dedup keys chunk: {exc}") from None
    return keys


def decode_u64(payload: bytes) -> int:
    """The value of an ACK, CATCHUP_ACK or CAUGHT_UP payload."""
    (value,) = _U64.unpack(payload)
    return int(value)


class ProtocolError(Exception):
    """The peer broke the replication protocol; the link is closed."""


M = TypeVar("M", bound=BaseModel)


def decode_model(model: type[M], payload: bytes) -> M:
    """A control frame's model; a malformed one is the peer's protocol error."""
    try:
        return model.model_validate_json(payload)
    except ValidationError as exc:
        raise ProtocolError(f"malformed {model.__name__} ({exc.error_count()} errors)") from None


class FrameDecoder:
    """Bytes in, (type, payload) frames out, none longer than `max_frame`.

    Frames are cut one at a time (`next`), so a limit raised after the
    handshake applies to the frames that follow it, even when their bytes
    arrived in the same read.
    """

    def __init__(self, max_frame: int = MAX_FRAME) -> None:
        self.max_frame = max_frame
        self._buf = bytearray()
        self._pos = 0

    def push(self, data: bytes) -> None:
        """Add received bytes."""
        if self._pos:
            del self._buf[: self._pos]
            self._pos = 0
        self._buf += data

    def next(self) -> tuple[FrameType, bytes] | None:
        """The next complete frame, or None until more bytes arrive.

        Raises ProtocolError as soon as a frame's header announces more than
        `max_frame` bytes: its payload is never waited for nor buffered.
        """
        buf, pos = self._buf, self._pos
        if len(buf) - pos < _HEAD.size:
            return None
        length, ftype = _HEAD.unpack_from(buf, pos)
        if length < 1 or length > self.max_frame:
            raise ProtocolError(f"frame length {length} out of range (limit {self.max_frame})")
        end = pos + 4 + length
        if end > len(buf):
            return None
        try:
            kind = FrameType(ftype)
        except ValueError as exc:
            raise ProtocolError(f"unknown frame type {ftype}") from exc
        with memoryview(buf) as view:  # one copy (a bytearray slice would be a second)
            frame = kind, bytes(view[pos + _HEAD.size : end])
        if end == len(buf):  # all consumed: let a big frame's bytes go now
            buf.clear()
            end = 0
        self._pos = end
        return frame

    def feed(self, data: bytes) -> list[tuple[FrameType, bytes]]:
        """Add received bytes; return the frames they complete."""
        self.push(data)
        frames: list[tuple[FrameType, bytes]] = []
        while (frame := self.next()) is not None:
            frames.append(frame)
        return frames
