"""The strace parser and the fsync-order checks of `syscalls`, on recorded and written traces.

`traces/pair-confirm-*.strace` were recorded from a real pair (one confirmed
message; paths shortened to /d/a and /d/b): the active's journal thread is in
its fdatasync while the event loop reads the passive's ACK, which strace
prints as `<unfinished ...>` / `<... fdatasync resumed>`. The rejections below
move single lines of such traces: a confirm, a commit-ok or an ACK that leaves
before the fdatasync returned must be reported, or the checks prove nothing.
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from syscalls import (
    Replication,
    TraceError,
    check_commits,
    check_confirms,
    check_passive_acks,
    frames,
    parse,
    split_amqp,
    unescape,
)

TRACES = Path(__file__).parent / "traces"
ACTIVE = (TRACES / "pair-confirm-active.strace").read_text().splitlines()
PASSIVE = (TRACES / "pair-confirm-passive.strace").read_text().splitlines()
# The recorded pair: the active's AMQP and replication ports, the passive's link port.
AMQP_PORT, REPLICATION_PORT, LINK_PORT = 31789, 24489, 28566
BODY = b"body-0"

# Markers of the recorded lines the tests move around.
CONFIRM = "write(20<TCP:"  # the active's basic.ack to the client
RESUMED = "<... fdatasync resumed>"  # the active's fdatasync returns
ACK_READ = "read(19<TCP:"  # the active reads the passive's ACK
ACK_WRITE = "write(19<TCP:"  # the passive sends its ACK
FDATASYNC = "fdatasync("


def hexs(data: bytes) -> str:
    """`data` as strace -xx prints it."""
    return "".join(f"\\x{b:02x}" for b in data)


def index(lines: list[str], marker: str) -> int:
    """The one line holding `marker`."""
    found = [i for i, line in enumerate(lines) if marker in line]
    assert len(found) == 1, (marker, found)
    return found[0]


def moved(lines: list[str], marker: str, before: str) -> list[str]:
    """`lines` with the line holding `marker` moved just before the one holding `before`."""
    out = list(lines)
    line = out.pop(index(out, marker))
    out.insert(index(out, before), line)
    return out


# -- parsing -------------------------------------------------------------------------------


def test_a_call_interrupted_by_another_thread_is_one_call_spanning_the_interruption() -> None:
    calls = parse(ACTIVE)
    (sync,) = [c for c in calls if c.name == "fdatasync"]
    ack_read = next(c for c in calls if c.name == "read" and c.ports == (REPLICATION_PORT, 60610))
    assert sync.tid == 9251 and ack_read.tid == 9169
    assert sync.result == 0 and sync.target == "/d/a/journal/00000000000000000001.seg"
    assert sync.exit is not None and ack_read.exit is not None
    assert sync.entry < ack_read.entry < ack_read.exit < sync.exit


def test_buffers_are_decoded_with_the_bytes_the_call_really_moved() -> None:
    calls = parse(ACTIVE)
    (pwrite,) = [c for c in calls if c.name == "pwrite64"]
    assert BODY in pwrite.transferred and pwrite.result == len(pwrite.data)
    assert pwrite.offset == 32  # after the segment header: not a new segment
    confirm = calls[-1]
    assert confirm.ports == (AMQP_PORT, 36684)
    assert confirm.data == bytes.fromhex("0100010000000d003c0050000000000000000100ce")


def test_iovecs_short_writes_errors_and_unfinished_calls() -> None:
    sock = "5<TCP:[127.0.0.1:1000->127.0.0.1:2000]>"
    calls = parse(
        [
            f'1  10:00:00.000001 writev({sock}, [{{iov_base="\\x01\\x02", iov_len=2}}, '
            f'{{iov_base="ab\\n\\"", iov_len=4}}], 2) = 5',
            f"1  10:00:00.000002 sendmsg({sock}, {{msg_name={{sa_family=AF_INET, "
            f'sin_port=htons(1), sin_addr=inet_addr("127.0.0.1")}}, msg_namelen=16, '
            f'msg_iov=[{{iov_base="xyz", iov_len=3}}], msg_iovlen=1, msg_controllen=0, '
            f"msg_flags=0}}, 0) = 3",
            f"1  10:00:00.000003 read({sock}, 0x7f0000, 1024) = -1 EAGAIN (Resource "
            "temporarily unavailable)",
            "1  10:00:00.000004 --- SIGCHLD {si_signo=SIGCHLD} ---",
            f'2  10:00:00.000005 write({sock}, "\\177\\0", 2 <unfinished ...>',
            "1  10:00:00.000006 +++ exited with 0 +++",
        ]
    )
    writev, sendmsg, read, write = calls
    assert writev.transferred == b'\x01\x02ab\n"'[:5]
    assert sendmsg.data == b"xyz"  # not the quoted address of msg_name
    assert read.result == -1 and read.transferred == b""
    assert write.exit is None and write.result is None and write.transferred == b"\x7f\x00"


def test_unescape_reads_every_escape_strace_prints() -> None:
    assert unescape(r"\x2f\101\0\n\t\\\"z") == b'/A\x00\n\t\\"z'


def test_a_frame_split_over_two_writes_knows_both() -> None:
    frame = struct.pack(">BHI", 1, 1, 5) + b"\x00\x5a\x00\x15\x00\xce"
    sock = "7<TCP:[127.0.0.1:5672->127.0.0.1:40000]>"
    calls = parse(
        [
            f'1  10:00:00.000001 write({sock}, "{hexs(frame[:4])}", 4) = 4',
            f'1  10:00:00.000002 write({sock}, "{hexs(frame[4:])}", {len(frame) - 4}) = 3',
            f'1  10:00:00.000003 write({sock}, "{hexs(frame[7:])}", {len(frame) - 7}) = '
            f"{len(frame) - 7}",
        ]
    )
    (got,) = frames(calls, split_amqp, sent=True, local_port=5672)
    assert got.first is calls[0] and got.last is calls[2]
    assert got.payload == frame[7:-1]


def test_a_buffer_strace_cut_short_is_an_error_not_a_guess() -> None:
    sock = "7<TCP:[127.0.0.1:5672->127.0.0.1:40000]>"
    calls = parse([f'1  10:00:00.000001 write({sock}, "\\x01\\x00"..., 4096) = 4096'])
    with pytest.raises(TraceError, match="raise -s"):
        frames(calls, split_amqp, sent=True, local_port=5672)


# -- the recorded pair ------------------------------------------------------------------------


def check_active(lines: list[str]) -> list[str]:
    return check_confirms(
        parse(lines),
        amqp_port=AMQP_PORT,
        bodies=[BODY],
        replication=Replication(local_port=REPLICATION_PORT),
    )


def check_passive(lines: list[str]) -> list[str]:
    return check_passive_acks(parse(lines), active_port=LINK_PORT, bodies=[BODY])


def test_the_recorded_pair_confirm_holds() -> None:
    assert check_active(ACTIVE) == []
    assert check_passive(PASSIVE) == []


def test_a_confirm_sent_while_the_fdatasync_is_still_running_is_rejected() -> None:
    (problem,) = check_active(moved(ACTIVE, CONFIRM, before=RESUMED))
    assert "confirm of tag 1" in problem and "completed fdatasync" in problem


def test_a_confirm_sent_before_the_fdatasync_began_is_rejected() -> None:
    # Also before the passive's ACK was read: both are reported.
    durable, acked = check_active(moved(ACTIVE, CONFIRM, before=FDATASYNC))
    assert "completed fdatasync" in durable and "ACK of batch 1 was read only at" in acked


def test_a_confirm_sent_before_the_passive_ack_was_read_is_rejected() -> None:
    lines = moved(ACTIVE, ACK_READ, before=CONFIRM)
    assert check_active(lines) == []  # still before the confirm: fine
    lines.append(lines.pop(index(lines, ACK_READ)))  # now after it
    (problem,) = check_active(lines)
    assert "ACK of batch 1 was read only at" in problem


def test_a_confirm_without_the_passive_ack_is_rejected() -> None:
    lines = [line for line in ACTIVE if ACK_READ not in line]
    (problem,) = check_active(lines)
    assert "batch 1 never acknowledged" in problem


def test_a_failed_fdatasync_does_not_make_a_write_durable() -> None:
    lines = [
        line.replace(">) = 0", ">) = -1 EIO (Input/output error)") if RESUMED in line else line
        for line in ACTIVE
    ]
    assert len(check_active(lines)) == 1


def test_an_fdatasync_of_another_file_does_not_make_a_write_durable() -> None:
    i = index(ACTIVE, FDATASYNC)
    lines = list(ACTIVE)
    lines[i] = lines[i].replace("fdatasync(14<", "fdatasync(15<")
    assert len(check_active(lines)) == 1


def test_a_passive_ack_sent_before_its_fdatasync_returned_is_rejected() -> None:
    (problem,) = check_passive(moved(PASSIVE, ACK_WRITE, before=FDATASYNC))
    assert "ACK of batch 1" in problem and "completed fdatasync" in problem


def test_a_batch_the_passive_never_acknowledged_is_reported() -> None:
    (problem,) = check_passive([line for line in PASSIVE if ACK_WRITE not in line])
    assert "batch 1" in problem and "never acknowledged" in problem


# -- tx.commit-ok, nacks, multiple acks (written traces) --------------------------------------

SEG = "3</d/journal/00000000000000000001.seg>"
JOURNAL_DIR = "4</d/journal>"
CLIENT = "7<TCP:[127.0.0.1:5672->127.0.0.1:40000]>"


def pwrite(*bodies: bytes, offset: int = 4096) -> str:
    data = b"".join(b"\x3b\x00\x00\x00record" + b for b in bodies)
    n = len(data)
    return f'9  10:00:00.000001 pwrite64({SEG}, "{hexs(data)}", {n}, {offset}) = {n}'


def fdatasync() -> str:
    return f"9  10:00:00.000002 fdatasync({SEG}) = 0"


def fsync_dir() -> str:
    return f"9  10:00:00.000002 fsync({JOURNAL_DIR}) = 0"


def method(class_id: int, method_id: int, args: bytes = b"") -> str:
    payload = struct.pack(">HH", class_id, method_id) + args
    frame = struct.pack(">BHI", 1, 1, len(payload)) + payload + b"\xce"
    return f'8  10:00:00.000003 write({CLIENT}, "{hexs(frame)}", {len(frame)}) = {len(frame)}'


def ack(tag: int, multiple: bool = False) -> str:
    return method(60, 80, struct.pack(">QB", tag, multiple))


def nack(tag: int) -> str:
    return method(60, 120, struct.pack(">QB", tag, 0))


COMMIT_OK = method(90, 21)


def test_each_tx_commit_ok_needs_its_whole_transaction_durable() -> None:
    txs = [[b"t1-a", b"t1-b"], [b"t2-a"]]
    good = [pwrite(*txs[0]), fdatasync(), COMMIT_OK, pwrite(*txs[1]), fdatasync(), COMMIT_OK]
    assert check_commits(parse(good), amqp_port=5672, transactions=txs) == []
    early = [pwrite(*txs[0]), fdatasync(), COMMIT_OK, pwrite(*txs[1]), COMMIT_OK, fdatasync()]
    (problem,) = check_commits(parse(early), amqp_port=5672, transactions=txs)
    assert "tx.commit-ok 2" in problem and "t2-a" in problem
    partial = [pwrite(txs[0][0]), fdatasync(), COMMIT_OK, pwrite(*txs[1]), fdatasync()]
    problems = check_commits(parse(partial), amqp_port=5672, transactions=txs)
    assert any("t1-b" in p for p in problems)
    assert any("1 tx.commit-ok in the trace for 2 commits" in p for p in problems)


def test_a_multiple_ack_needs_every_message_it_covers_durable() -> None:
    bodies = [b"m-1", b"m-2"]
    good = [pwrite(*bodies), fdatasync(), ack(2, multiple=True)]
    assert check_confirms(parse(good), amqp_port=5672, bodies=bodies) == []
    half = [pwrite(b"m-1"), fdatasync(), pwrite(b"m-2"), ack(2, multiple=True), fdatasync()]
    (problem,) = check_confirms(parse(half), amqp_port=5672, bodies=bodies)
    assert "tag 2" in problem


def test_a_nack_and_a_missing_confirm_are_reported() -> None:
    bodies = [b"m-1", b"m-2", b"m-3"]
    problems = check_confirms(
        parse([pwrite(b"m-1"), fdatasync(), ack(1), nack(2)]), amqp_port=5672, bodies=bodies
    )
    nacked, unconfirmed = problems
    assert nacked.startswith("delivery tags [2] nacked at line 4 ")
    assert unconfirmed == "only 2 of 3 messages confirmed in the trace"


def test_a_write_that_began_a_segment_also_needs_the_directory_fsync() -> None:
    # Without it a power loss can take the new file's name, and the record with it.
    bodies = [b"m-1"]
    new = pwrite(b"m-1", offset=0)
    good = [new, fdatasync(), fsync_dir(), ack(1)]
    assert check_confirms(parse(good), amqp_port=5672, bodies=bodies) == []
    (problem,) = check_confirms(
        parse([new, fdatasync(), ack(1), fsync_dir()]), amqp_port=5672, bodies=bodies
    )
    assert "began 00000000000000000001.seg and no fsync of /d/journal" in problem
