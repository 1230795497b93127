"""The upstream tells each link, per origin, how far it will ever forward (sans-I/O).

A downstream's dedup window forgets a key older than `dedup-window` only once every link
of the server has passed its seq (dedup.py): a link that never brings some origin (a
diamond's second path for the first path's server, a link whose bindings never match an
origin's messages) passed none of it, so that origin's keys were kept, a bit per seq,
until the bound, and copies came through then. The upstream knows more: it tells the
link, in the link's own stream, **"of origin O, everything up to seq S that I will ever
put in your queue is ahead of this point"**, and the same for every origin it does not
name (`others`). The link's mark for O is then S (dedup.py `LagWindow.passed`, `told`).

What the upstream tells (`Federation.told_marks`), for the link queue's vhost:

- its own messages: the highest replication ID given so far. A message takes its ID as
  it enters its queues (vhost.py `_enqueue`, in one step), so every message of this
  origin at or below it is in the queue already;
- another origin: the lowest mark of its own links for it (their own passed marks and
  what their upstreams told them): none of them brings a seq at or below it that was not
  republished already (and so in the queue) or dropped as a copy;
- every origin it does not name: the lowest of its links' `others`; with no link into
  that vhost at all, none but its own messages enter the queue: everything.

Where in the stream: a statement made at time T covers what was in the queue at T, so it
must reach the link after all of it. Per link queue and connection (`MarkTeller`): at a
delivery, if the queue is empty behind it, the marks of now go right after it; else the
marks of now are noted with the queue's last message, and go out after the delivery of
that message (or of a later one: the queue is in ID order but for re-deliveries, which
come first). A link idle with an empty queue is told every `IDLE_TELL` seconds if
anything changed. Rarer telling is always safe (the window waits longer), never wrong.

The frame: an AMQP method frame of a class no AMQP peer uses (`MARKS_CLASS`), body JSON
(`ToldMarks`), on the link's channel. Only to a connection that announced
`x-twinmq-marks` (its client properties) to a server that announced it (its server
properties): an older link is never sent one, and an older upstream sends none, which is
the behaviour before (the window waits for every link for every origin).
"""

from __future__ import annotations

import asyncio
import os
import struct
from collections.abc import Callable
from typing import Final

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from twinmq.broker.message import Entry
from twinmq.broker.queue import Queue

MARKS_PROPERTY: Final = "x-twinmq-marks"  # client and server property: the version told
MARKS_VERSION: Final = 1
# A method frame of this class carries the marks: no AMQP 0-9-1 class has an id this high.
MARKS_CLASS: Final = 0x7A6D
MARKS_METHOD: Final = 10
IDLE_TELL: Final = 1.0  # seconds between tells to a link whose queue is empty
MIN_GAP: Final = 0.1  # seconds at least between tells at a delivery that empties the queue
# `TWINMQ_FEDERATION_MARKS=0`: neither ask for marks (links) nor tell them (upstream), as a
# version before them: the tests' older peer, and a way back should marks ever misbehave.
ENABLED: Final = os.environ.get("TWINMQ_FEDERATION_MARKS", "1") != "0"
_FRAME: Final = struct.Struct(">BHIHH")
_FRAME_END: Final = b"\xce"


class ToldMarks(BaseModel):
    """What an upstream tells its link: every message of `marks`' origins up to their seq,
    and of any other origin up to `others`, that it will ever put in the link's queue is
    ahead of this point in the link's stream. -1: nothing told."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    v: int = Field(MARKS_VERSION, description="The frame's version")
    queue: str = Field("", description="The link queue the marks are about")
    marks: dict[str, int] = Field(default_factory=dict, description="origin -> seq")
    others: int = Field(-1, description="The seq told for every origin not in `marks`")
    acked: int = Field(
        -1,
        description="Every delivery of this channel up to this tag is acknowledged and its "
        "settle durable upstream: never delivered again",
    )


def encode(told: ToldMarks, channel: int) -> bytes:
    """The marks frame on `channel`."""
    body = told.model_dump_json().encode()
    return _FRAME.pack(1, channel, 4 + len(body), MARKS_CLASS, MARKS_METHOD) + body + _FRAME_END


def decode(payload: bytes) -> ToldMarks | None:
    """The marks of a method frame's payload, or None if it is not a marks frame (any
    other method), or one of a version this server does not read (ignored: safe)."""
    if len(payload) < 4 or struct.unpack_from(">HH", payload) != (MARKS_CLASS, MARKS_METHOD):
        return None
    try:
        told = ToldMarks.model_validate_json(payload[4:])
    except ValidationError:
        return ToldMarks()
    return told if told.v == MARKS_VERSION else ToldMarks()


def is_marks(payload: bytes) -> bool:
    """The method frame's payload is a marks frame."""
    return len(payload) >= 4 and struct.unpack_from(">HH", payload) == (
        MARKS_CLASS,
        MARKS_METHOD,
    )


class MarkTeller:
    """The upstream side, per connection of a link that asked for marks (see the module)."""

    def __init__(
        self,
        told: Callable[[str], ToldMarks],
        send: Callable[[bytes], None],
        consumed: Callable[[], list[tuple[Queue, int]]],
        acked: Callable[[int], int],
        durable: Callable[[], tuple[int, int]],
    ) -> None:
        self._told = told  # the marks of now for a queue (named) of this connection's vhost
        self._send = send
        # The queues the connection consumes with acknowledgements (its link's consumer;
        # not a state subscription's), and their channels: told when idle.
        self._consumed = consumed
        # The channel's highest delivery tag with every one up to it acknowledged; and the
        # committer's (batch covering every op so far, batch complete on disk).
        self._acked_through = acked
        self._durable = durable
        # queue -> (batch, tag): once that batch is complete, every delivery up to that
        # tag is settled for good (its settle was added before the batch was chosen).
        self._acks: dict[Queue, tuple[int, int]] = {}
        # queue -> (the ID of its last message when noted, the marks of then, channel)
        self._noted: dict[Queue, tuple[int, ToldMarks, int]] = {}
        self._last: dict[Queue, ToldMarks] = {}  # the last marks sent per queue
        self._told_at: dict[Queue, float] = {}  # when the last marks went out (loop time)
        # From the start, not from a first delivery: a link that reconnects with nothing
        # left to get is told too.
        self._tick = asyncio.get_running_loop().call_later(IDLE_TELL, self._idle_tell)

    def delivered(self, queue: Queue, entry: Entry, channel: int) -> None:
        """`entry` of `queue` was just sent on `channel`: tell what this point covers."""
        noted = self._noted.get(queue)
        told: ToldMarks | None = None
        if noted is not None and not entry.redelivered and entry.message.mid >= noted[0]:
            told = noted[1]  # every message that was in the queue when noted is sent
            del self._noted[queue]
        if not queue.entries:
            self._noted.pop(queue, None)  # it is sent: the marks of now cover more
            now = asyncio.get_running_loop().time()
            if now - self._told_at.get(queue, 0.0) >= MIN_GAP:
                # Nothing behind this delivery: the marks of now hold. Not after every
                # delivery of a link that keeps up (the idle tell follows).
                told = self._told(queue.name)
        elif queue not in self._noted:
            self._noted[queue] = (queue.entries[-1].message.mid, self._told(queue.name), channel)
        if told is not None:
            self._tell(queue, told, channel)

    def _tell(self, queue: Queue, told: ToldMarks, channel: int) -> None:
        told = told.model_copy(update={"acked": self._acked(queue, channel)})
        if self._last.get(queue) == told:
            return
        self._last[queue] = told
        self._told_at[queue] = asyncio.get_running_loop().time()
        self._send(encode(told, channel))

    def _acked(self, queue: Queue, channel: int) -> int:
        """The tag up to which the channel's deliveries are settled for good, as far as
        known now (-1: not yet): a candidate noted earlier whose batch is complete."""
        point, complete = self._durable()
        noted = self._acks.get(queue)
        acked = -1
        if noted is not None and complete >= noted[0]:
            acked = noted[1]
            noted = None
        if noted is None:
            self._acks[queue] = (point, self._acked_through(channel))
        return acked

    def _idle_tell(self) -> None:
        """Each empty queue of the link: everything in it was sent, the marks of now hold at
        this point of the stream. Again every `IDLE_TELL` while the connection lasts."""
        consumed = self._consumed()
        for queue, channel in consumed:
            if not queue.entries:
                self._tell(queue, self._told(queue.name), channel)
            elif queue not in self._acks:
                # A candidate for the next tell (its batch completes meanwhile).
                self._acks[queue] = (self._durable()[0], self._acked_through(channel))
        gone = {queue for queue, _ in consumed}
        for state in (self._noted, self._last, self._acks, self._told_at):
            for queue in [each for each in state if each not in gone]:
                del state[queue]
        self._tick = asyncio.get_running_loop().call_later(IDLE_TELL, self._idle_tell)

    def close(self) -> None:
        """The connection ended: no more tells."""
        self._tick.cancel()
        self._noted.clear()
        self._acks.clear()
