"""What a broker process did, in the order the kernel saw it: strace output, parsed and checked.

The fsync-order tests (`test_fsync_order.py`) trace real broker processes with

    strace -f -tt -yy -xx -s 65536 -e trace=<writes, reads, fdatasync, fsync> -p PID

and ask of the trace what no kill -9 test can show: that the bytes of every
confirmed message were written to a journal segment and that write was made
durable by an fdatasync (or fsync) that *returned* before the confirm began to
leave the process (and, when that write began a new segment, that an fsync
of the journal directory had returned too, so the file's name survives a
power loss); and, the same way, that the message's audit record (written to
`audit/*.jsonl.open`) was fdatasynced before it. This module is pure (no
strace, no broker): a parser for that output, a reassembler of the AMQP and
replication frames the sockets carried, and the checks.

Order. strace stops a traced thread at every syscall entry and exit and
writes one event at a time, so the order of events in its output is an order
in which they really happened: a call that another thread interrupts is split
into `name(args <unfinished ...>` (its entry) and `<... name resumed>rest`
(its exit). Each `Syscall` gets the positions of its entry and its exit in
that order; "A returned before B began" is `A.exit < B.entry`.
"""

from __future__ import annotations

import bisect
import posixpath
import re
import struct
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from twinmq.audit.records import segment_columns
from twinmq.broker.replication.protocol import FrameType, decode_batch, decode_u64

# -- parsing ------------------------------------------------------------------------------

WRITES = frozenset(
    {"write", "writev", "pwrite64", "pwritev", "pwritev2", "send", "sendto", "sendmsg"}
)
READS = frozenset({"read", "readv", "pread64", "preadv", "recv", "recvfrom", "recvmsg"})
SYNCS = frozenset({"fdatasync", "fsync"})
# Positional writes: which argument is the file offset.
_POSITIONAL = {"pwrite64": -1, "pwritev": -1, "pwritev2": -2}
# Calls whose data is a list of iovecs (`iov_base="..."`), not one buffer argument.
_IOV_CALLS = frozenset({"writev", "pwritev", "pwritev2", "sendmsg", "readv", "preadv", "recvmsg"})

_LINE = re.compile(r"(?P<tid>\d+)\s+(?:(?P<time>\d\d:\d\d:\d\d(?:\.\d+)?)\s+)?(?P<rest>.*)")
_CALL = re.compile(r"(?P<name>\w+)\((?P<rest>.*)")
_RESUMED = re.compile(r"<\.\.\. (?P<name>\w+) resumed>(?P<rest>.*)")
_UNFINISHED = ("<unfinished ...>", "<detached ...>")  # a call's entry, its exit not yet seen
_FD = re.compile(r"\s*(?P<fd>-?\d+)(?:<(?P<target>(?:->|\\.|[^>\\])*)>)?")
_TCP = re.compile(r"TCP6?:\[(?P<local>.+):(?P<lport>\d+)->(?P<remote>.+):(?P<rport>\d+)\]")
_ESCAPES = {"n": 10, "t": 9, "r": 13, "v": 11, "f": 12, "a": 7, "b": 8, "e": 27}


class TraceError(ValueError):
    """The trace cannot be read as asked (a malformed line, a buffer strace cut short)."""


@dataclass(frozen=True)
class Syscall:
    """One system call of one thread, with where its entry and exit fall in the trace."""

    tid: int
    time: str
    name: str
    fd: int | None
    target: str  # strace's -yy decoration of the fd: a path, `TCP:[local->remote]`, ...
    data: bytes  # the buffer(s): offered (writes) or received (reads); iovecs joined
    truncated: bool  # strace printed only the first -s bytes of `data`
    result: int | None  # None: no exit seen (the trace ended, or `= ?`)
    offset: int | None  # where a positional write (pwrite64, pwritev) wrote
    entry: int
    exit: int | None
    line: int  # 1-based line of the entry, for messages

    @property
    def transferred(self) -> bytes:
        """The bytes the call really moved (a write's data up to its result)."""
        if self.result is None:
            return self.data if self.name in WRITES else b""
        return self.data[: max(self.result, 0)]

    @property
    def ports(self) -> tuple[int, int] | None:
        """(local, remote) port of a TCP socket fd, else None."""
        m = _TCP.fullmatch(self.target)
        return (int(m["lport"]), int(m["rport"])) if m else None

    def __str__(self) -> str:
        return f"line {self.line} [{self.tid} {self.time}] {self.name}({self.fd}<{self.target}>)"


def unescape(text: str) -> bytes:
    """The bytes of a C-escaped strace string body (`\\x2f`, `\\n`, `\\"`, `\\177`)."""
    out = bytearray()
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c != "\\":
            out += c.encode()
            i += 1
            continue
        e = text[i + 1 : i + 2]
        if e == "x":
            out.append(int(text[i + 2 : i + 4], 16))
            i += 4
        elif e.isdigit():
            j = i + 1
            while j < min(i + 4, n) and text[j] in "01234567":
                j += 1
            out.append(int(text[i + 1 : j], 8) & 0xFF)
            i = j
        elif e in _ESCAPES:
            out.append(_ESCAPES[e])
            i += 2
        else:  # \\ \" \' and anything else: the character itself
            out += e.encode()
            i += 2
    return bytes(out)


def _strings(args: str) -> list[tuple[int, bytes, bool]]:
    """Every quoted string of an argument list: (offset of its quote, bytes, truncated)."""
    found: list[tuple[int, bytes, bool]] = []
    i, n = 0, len(args)
    while i < n:
        if args[i] != '"':
            i += 1
            continue
        j = i + 1
        while j < n and args[j] != '"':
            j += 2 if args[j] == "\\" else 1
        if j >= n:
            raise TraceError(f"unterminated string in {args[:80]!r}")
        truncated = args.startswith("...", j + 1)
        found.append((i, unescape(args[i + 1 : j]), truncated))
        i = j + 1
    return found


def _split_result(text: str) -> tuple[str, int | None]:
    """`args) = 13` -> (`args`, 13): the result after the argument list's closing paren."""
    depth, i, n = 0, 0, len(text)
    while i < n:
        c = text[i]
        if c == '"':
            i += 1
            while i < n and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            if depth == 0:
                result = text[i + 1 :].strip()
                if not result.startswith("="):
                    raise TraceError(f"no result in {text[-80:]!r}")
                value = result[1:].split()[0] if result[1:].split() else "?"
                return text[:i], (None if value == "?" else int(value, 0))
            depth -= 1
        i += 1
    raise TraceError(f"unbalanced argument list {text[:80]!r}")


def _top_level(args: str) -> list[str]:
    """An argument list split at its top-level commas (not inside strings or brackets)."""
    parts: list[str] = []
    depth, start, i, n = 0, 0, 0, len(args)
    while i < n:
        c = args[i]
        if c == '"':
            i += 1
            while i < n and args[i] != '"':
                i += 2 if args[i] == "\\" else 1
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(args[start:i].strip())
            start = i + 1
        i += 1
    parts.append(args[start:].strip())
    return parts


def _call(tid: int, time: str, text: str, entry: int, exit: int | None, line: int) -> Syscall:
    m = _CALL.fullmatch(text)
    if m is None:
        raise TraceError(f"line {line}: not a syscall: {text[:80]!r}")
    name = m["name"]
    if exit is None:
        args, result = m["rest"], None
    else:
        args, result = _split_result(m["rest"])
    fd_m = _FD.match(args)
    fd = int(fd_m["fd"]) if fd_m else None
    target = unescape(fd_m["target"]).decode(errors="replace") if fd_m and fd_m["target"] else ""
    data, truncated = b"", False
    if name in WRITES or name in READS:
        strings = _strings(args[fd_m.end() :] if fd_m else args)
        if name in _IOV_CALLS:
            # Only buffers: a sendmsg's msg_name holds quoted addresses too.
            off = fd_m.end() if fd_m else 0
            strings = [s for s in strings if args[: off + s[0]].endswith("iov_base=")]
        else:
            strings = strings[:1]
        data = b"".join(s[1] for s in strings)
        truncated = any(s[2] for s in strings)
    offset = None
    if name in _POSITIONAL and exit is not None:
        parts = _top_level(args)
        offset = int(parts[_POSITIONAL[name]], 0)
    return Syscall(tid, time, name, fd, target, data, truncated, result, offset, entry, exit, line)


def parse(lines: Iterable[str]) -> list[Syscall]:
    """The syscalls of `strace -f -tt -yy -xx` output, in the order they began.

    Signals, exits and anything else that is not a syscall are skipped. A call
    still unfinished when the trace ends has `exit` and `result` None.
    """
    calls: list[Syscall] = []
    pending: dict[int, tuple[str, str, int, int]] = {}  # tid -> (time, text, entry, line)
    pos = 0
    for number, raw in enumerate(lines, 1):
        m = _LINE.fullmatch(raw.rstrip("\n"))
        if m is None:
            if raw.strip():
                raise TraceError(f"line {number}: no thread id: {raw[:80]!r}")
            continue
        tid, time, rest = int(m["tid"]), m["time"] or "", m["rest"]
        if rest.startswith(("---", "+++")):
            continue
        resumed = _RESUMED.fullmatch(rest)
        if resumed is not None:
            if tid not in pending:
                continue  # began before the trace did
            t0, head, entry, line = pending.pop(tid)
            calls.append(_call(tid, t0, head + resumed["rest"], entry, pos, line))
            pos += 1
        elif rest.endswith(_UNFINISHED):
            pending[tid] = (time, rest[: rest.rindex("<")].rstrip(), pos, number)
            pos += 1
        else:
            calls.append(_call(tid, time, rest, pos, pos + 1, number))
            pos += 2
    for tid, (time, head, entry, line) in pending.items():
        calls.append(_call(tid, time, head, entry, None, line))
    calls.sort(key=lambda c: c.entry)
    return calls


# -- frames on a socket -----------------------------------------------------------------------


@dataclass(frozen=True)
class Frame:
    """A frame reassembled from a socket's bytes, with the calls that carried it."""

    first: Syscall  # carried its first byte: a sent frame starts leaving here
    last: Syscall  # carried its last byte: a received frame is whole once this returns
    kind: int
    channel: int  # AMQP channel (0 on the replication link)
    payload: bytes


# (bytes) -> (frame length, kind, channel, payload), or None when more bytes are needed.
Splitter = Callable[[bytes], tuple[int, int, int, bytes] | None]
_AMQP_HEAD = struct.Struct(">BHI")
_REPL_HEAD = struct.Struct(">IB")


def split_amqp(buf: bytes) -> tuple[int, int, int, bytes] | None:
    """One AMQP 0-9-1 frame: u8 type | u16 channel | u32 size | payload | 0xCE."""
    if len(buf) < _AMQP_HEAD.size:
        return None
    kind, channel, size = _AMQP_HEAD.unpack_from(buf)
    end = _AMQP_HEAD.size + size + 1
    if len(buf) < end:
        return None
    if buf[end - 1] != 0xCE:
        raise TraceError(f"AMQP frame without frame-end: {bytes(buf[:16]).hex()}")
    return end, kind, channel, bytes(buf[_AMQP_HEAD.size : end - 1])


def split_replication(buf: bytes) -> tuple[int, int, int, bytes] | None:
    """One replication frame: u32 length (of what follows) | u8 type | payload."""
    if len(buf) < _REPL_HEAD.size:
        return None
    length, kind = _REPL_HEAD.unpack_from(buf)
    if kind not in FrameType._value2member_map_:
        raise TraceError(f"not a replication frame (the trace began mid-frame?): type {kind}")
    end = 4 + length
    if len(buf) < end:
        return None
    return end, kind, 0, bytes(buf[_REPL_HEAD.size : end])


@dataclass
class _Stream:
    """One direction of one connection being reassembled."""

    buf: bytearray = field(default_factory=bytearray)
    base: int = 0  # stream offset of buf[0]
    starts: list[int] = field(default_factory=list)  # stream offset of each call's bytes
    carriers: list[Syscall] = field(default_factory=list)

    def carrier(self, offset: int) -> Syscall:
        """The call that carried the byte at stream `offset`."""
        return self.carriers[bisect.bisect_right(self.starts, offset) - 1]


def frames(
    calls: Sequence[Syscall],
    split: Splitter,
    *,
    sent: bool,
    local_port: int | None = None,
    remote_port: int | None = None,
) -> list[Frame]:
    """The frames sent (`sent`) or received on the TCP socket(s) with these ports.

    Each connection's bytes are reassembled in call order; a frame knows the
    call that carried its first byte and the one that carried its last.
    """
    names = WRITES if sent else READS
    # Per connection: unparsed bytes, their offset in the stream, and where each call's
    # bytes begin in the stream (with the call), oldest first.
    streams: dict[tuple[int | None, str], _Stream] = {}
    out: list[Frame] = []
    for call in calls:
        ports = call.ports
        if call.name not in names or ports is None:
            continue
        if (local_port is not None and ports[0] != local_port) or (
            remote_port is not None and ports[1] != remote_port
        ):
            continue
        data = call.transferred
        if not data:
            continue
        if call.truncated and (call.result is None or call.result > len(call.data)):
            raise TraceError(f"{call}: strace cut the buffer short; raise -s")
        stream = streams.setdefault((call.fd, call.target), _Stream())
        if stream.base == 0 and not stream.buf and data.startswith(b"AMQP"):
            data = data[8:]  # the client's protocol header is not a frame
        stream.starts.append(stream.base + len(stream.buf))
        stream.carriers.append(call)
        stream.buf += data
        while (got := split(bytes(stream.buf))) is not None:
            end, kind, channel, payload = got
            first = stream.carrier(stream.base)
            last = stream.carrier(stream.base + end - 1)
            out.append(Frame(first, last, kind, channel, payload))
            del stream.buf[:end]
            stream.base += end
            while len(stream.starts) > 1 and stream.starts[1] <= stream.base:
                del stream.starts[0], stream.carriers[0]
    return out


# -- AMQP methods -----------------------------------------------------------------------------

BASIC_ACK = (60, 80)
BASIC_NACK = (60, 120)
TX_COMMIT_OK = (90, 21)
_METHOD = struct.Struct(">HH")


def method_of(frame: Frame) -> tuple[int, int] | None:
    """(class, method) of an AMQP method frame (type 1), else None."""
    if frame.kind != 1 or len(frame.payload) < _METHOD.size:
        return None
    class_id, method_id = _METHOD.unpack_from(frame.payload)
    return int(class_id), int(method_id)


def ack_fields(frame: Frame) -> tuple[int, bool]:
    """(delivery tag, multiple) of a basic.ack or basic.nack frame."""
    tag, bits = struct.unpack_from(">QB", frame.payload, _METHOD.size)
    return int(tag), bool(bits & 1)


# -- durability ---------------------------------------------------------------------------------


def is_journal_write(call: Syscall) -> bool:
    """A successful write to a journal segment (`*.seg`)."""
    return (
        call.name in WRITES
        and call.target.endswith(".seg")
        and call.result is not None
        and call.result > 0
    )


def is_audit_write(call: Syscall) -> bool:
    """A successful write to an open audit segment (`audit/*.jsonl.open`)."""
    return (
        call.name in WRITES
        and call.target.endswith(".jsonl.open")
        and call.result is not None
        and call.result > 0
    )


def audit_needle(body: bytes, event: str) -> Callable[[bytes], bool]:
    """Whether written bytes hold the audit record of `body` with `event`.

    The record is in a line of its batch, not the body: the written lines are read
    as the shipper reads them (`segment_columns`, any line format) and a record with
    `event` and the body's CRC-32 as its digest looked for; the digest is computed
    here independently of the broker's writer.
    """
    digest = "%08x" % zlib.crc32(body)  # noqa: UP031 (as body_digest, written out)

    def holds(data: bytes) -> bool:
        cols = segment_columns(data[: data.rfind(b"\n") + 1])  # whole lines only
        return any(
            e == event and d == digest for e, d in zip(cols["event"], cols["digest"], strict=True)
        )

    return holds


def _synced(calls: Sequence[Syscall], write: Syscall, path: str, before: int) -> Syscall | None:
    """A sync of `path` (0 returned) that began after `write` returned and returned before
    `before`; for the written file itself, through the same fd."""
    assert write.exit is not None
    for sync in calls:
        if (
            sync.name in SYNCS
            and sync.target == path
            and (path != write.target or sync.fd == write.fd)
            and sync.entry > write.exit
            and sync.exit is not None
            and sync.exit < before
            and sync.result == 0
        ):
            return sync
    return None


def durability_problem(
    calls: Sequence[Syscall],
    needle: bytes | Callable[[bytes], bool],
    before: int,
    *,
    written: Callable[[Syscall], bool] = is_journal_write,
    what: str = "journal",
) -> str | None:
    """Why `needle` was not durable in the journal at event `before` (None: it was).

    Durable means: a journal segment write holding `needle` returned, then an
    fdatasync or fsync of that file began and returned 0, all before `before`
    (a position in the trace); and when that write began a segment (offset 0:
    the file is new), an fsync of the journal directory also began after it
    and returned 0 before `before`, so the file's name survives a power loss.
    `written` and `what` ask the same of another kind of file (the audit log's);
    `needle` may be a test of the written bytes instead of bytes they hold.
    """
    holds = needle if callable(needle) else lambda data: needle in data
    directory_problem = None
    for write in calls:
        if write.exit is None or write.exit >= before or not written(write):
            continue
        if not holds(write.transferred) or _synced(calls, write, write.target, before) is None:
            continue
        if write.offset != 0:
            return None
        directory = posixpath.dirname(write.target)
        if _synced(calls, write, directory, before) is not None:
            return None
        directory_problem = (
            f"its write began {posixpath.basename(write.target)} and no fsync of "
            f"{directory} had returned before it"
        )
    return directory_problem or (
        f"no {what} write holding it was made durable by a completed fdatasync before it"
    )


# -- the checks: each returns what is wrong (empty: the order holds) -----------------------------


@dataclass(frozen=True)
class Replication:
    """The active's replication link in a pair: confirms also wait for the passive's ACK."""

    local_port: int  # the active's replication listener


def _acked_by_passive(
    calls: Sequence[Syscall], link: Replication, body: bytes, before: int
) -> str | None:
    """None if the passive's ACK for the batch carrying `body` was read before `before`."""
    batches = [
        f
        for f in frames(calls, split_replication, sent=True, local_port=link.local_port)
        if f.kind == FrameType.BATCH
    ]
    carrying = [decode_batch(f.payload)[0] for f in batches if body in f.payload]
    if not carrying:
        return "never sent to the passive in a BATCH"
    batch = carrying[0]
    acks = [
        f
        for f in frames(calls, split_replication, sent=False, local_port=link.local_port)
        if f.kind == FrameType.ACK and decode_u64(f.payload) >= batch
    ]
    if not acks:
        return f"batch {batch} never acknowledged by the passive"
    if acks[0].last.exit is None or acks[0].last.exit >= before:
        return f"the passive's ACK of batch {batch} was read only at {acks[0].last}"
    return None


def audit_problem(calls: Sequence[Syscall], body: bytes, event: str, before: int) -> str | None:
    """Why the audit record (`event`) of `body` was not durable at `before` (None: it was)."""
    why = durability_problem(
        calls, audit_needle(body, event), before, written=is_audit_write, what=f"{event} audit"
    )
    return None if why is None else f"audit record: {why}"


def _check_completion(
    calls: Sequence[Syscall],
    what: str,
    completion: Frame,
    bodies: Sequence[bytes],
    link: Replication | None,
    audit_event: str | None,
) -> list[str]:
    problems: list[str] = []
    before = completion.first.entry
    for body in bodies:
        if why := durability_problem(calls, body, before):
            problems.append(f"{what} ({completion.first}) for {body!r}: {why}")
        if link is not None and (why := _acked_by_passive(calls, link, body, before)):
            problems.append(f"{what} ({completion.first}) for {body!r}: {why}")
        if audit_event is not None and (why := audit_problem(calls, body, audit_event, before)):
            problems.append(f"{what} ({completion.first}) for {body!r}: {why}")
    return problems


def check_confirms(
    calls: Sequence[Syscall],
    *,
    amqp_port: int,
    bodies: Sequence[bytes],
    replication: Replication | None = None,
    audit_event: str | None = None,
) -> list[str]:
    """Every confirm on the broker's AMQP port came after its message was durable.

    `bodies` are the messages one channel published with confirms, in order
    (delivery tag i is `bodies[i - 1]`). For each basic.ack (a `multiple` one
    covers every tag up to its own) the message's bytes must be in a journal
    write whose fdatasync returned before the ack's write began; with
    `replication`, the passive's ACK of the batch carrying it must have been
    read before then too; with `audit_event` (`confirmed`, `confirmed-alone`),
    the message's audit record with that event must have been written to an
    audit segment and fdatasynced before then too. A nack, or a message never
    confirmed, is a problem.
    """
    problems: list[str] = []
    confirmed = 0
    for frame in frames(calls, split_amqp, sent=True, local_port=amqp_port):
        method = method_of(frame)
        if method not in (BASIC_ACK, BASIC_NACK):
            continue
        tag, multiple = ack_fields(frame)
        tags = range(confirmed + 1, tag + 1) if multiple else range(tag, tag + 1)
        if method == BASIC_NACK:
            problems.append(f"delivery tags {list(tags)} nacked at {frame.first}")
        for t in tags:
            if not 1 <= t <= len(bodies):
                problems.append(f"confirm of unknown delivery tag {t} at {frame.first}")
                continue
            if method == BASIC_ACK:
                problems += _check_completion(
                    calls, f"confirm of tag {t}", frame, [bodies[t - 1]], replication, audit_event
                )
        confirmed = max(confirmed, tag)
    if confirmed < len(bodies):
        problems.append(f"only {confirmed} of {len(bodies)} messages confirmed in the trace")
    return problems


def check_commits(
    calls: Sequence[Syscall],
    *,
    amqp_port: int,
    transactions: Sequence[Sequence[bytes]],
    replication: Replication | None = None,
    audit_event: str | None = None,
) -> list[str]:
    """Every tx.commit-ok came after the messages of its transaction were durable.

    `transactions` are the messages of one channel's commits, in order: the
    k-th tx.commit-ok answers the k-th commit. `replication` and `audit_event`
    as for `check_confirms`.
    """
    problems: list[str] = []
    oks = [
        f
        for f in frames(calls, split_amqp, sent=True, local_port=amqp_port)
        if method_of(f) == TX_COMMIT_OK
    ]
    for k, (frame, bodies) in enumerate(zip(oks, transactions, strict=False), 1):
        problems += _check_completion(
            calls, f"tx.commit-ok {k}", frame, bodies, replication, audit_event
        )
    if len(oks) != len(transactions):
        problems.append(f"{len(oks)} tx.commit-ok in the trace for {len(transactions)} commits")
    return problems


def check_passive_acks(
    calls: Sequence[Syscall],
    *,
    active_port: int,
    bodies: Sequence[bytes],
    audit_event: str | None = None,
) -> list[str]:
    """Every ACK the passive sent came after the batches it covers were durable there.

    For each BATCH frame read from the link (its remote port `active_port`:
    the active's listener, or the proxy in front of it), each of `bodies` it
    carries must be in a journal write of the passive whose fdatasync returned
    before the first ACK of that batch (or a later one) began to be written;
    with `audit_event` (`replicated`), so must the passive's audit record of it.
    """
    problems: list[str] = []
    received = [
        f
        for f in frames(calls, split_replication, sent=False, remote_port=active_port)
        if f.kind == FrameType.BATCH
    ]
    acks = [
        f
        for f in frames(calls, split_replication, sent=True, remote_port=active_port)
        if f.kind == FrameType.ACK
    ]
    seen: set[bytes] = set()
    for frame in received:
        batch = decode_batch(frame.payload)[0]
        carried = [b for b in bodies if b in frame.payload]
        seen.update(carried)
        covering = [a for a in acks if decode_u64(a.payload) >= batch]
        if not covering:
            if carried:
                problems.append(f"batch {batch} ({frame.last}) never acknowledged")
            continue
        ack = covering[0]
        for body in carried:
            if why := durability_problem(calls, body, ack.first.entry):
                problems.append(f"ACK of batch {batch} ({ack.first}) for {body!r}: {why}")
            if audit_event is not None and (
                why := audit_problem(calls, body, audit_event, ack.first.entry)
            ):
                problems.append(f"ACK of batch {batch} ({ack.first}) for {body!r}: {why}")
    missing = [b for b in bodies if b not in seen]
    if missing:
        problems.append(f"{len(missing)} messages never reached the passive: {missing[:3]}")
    return problems
