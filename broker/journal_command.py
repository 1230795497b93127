"""`twinmq-broker journal check|repair <data-dir>`: inspect or repair a stopped broker's journal.

`check` is read-only (no lock, no change; safe on a running broker, whose
newest record may then look torn). Exit codes:

    0   clean
    1   a torn tail only (a crash while writing; nothing confirmed is in it: the
        next start truncates it)
    2   corruption in a segment, or the broker is marked damaged (DAMAGED.json):
        read the report, then `repair`
    64  usage error
    65  the journal cannot be read at all (unreadable definitions, unknown format)
        or, for repair, cannot be opened (a broker is running on it)

`repair` does offline what a broker does at start: truncates a torn tail,
re-appends the live messages of damaged segments to a new head segment, moves
the damaged files to `<data-dir>/quarantine` (never deletes them); then it
clears the damaged marker and prints what it did. Exit 0 once repaired.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Literal, NoReturn

from pydantic import BaseModel

from twinmq.broker import damage
from twinmq.broker.journal import Journal, JournalError, Recovered
from twinmq.broker.journal.deflog import LOG
from twinmq.broker.journal.recovery import DEFINITIONS, CheckReport, check
from twinmq.broker.journal.segment import SUFFIX

__all__ = ["CheckOutput", "main"]

EXIT_CLEAN = 0
EXIT_TORN = 1
EXIT_CORRUPT = 2
EXIT_USAGE = 64
EXIT_UNREADABLE = 65


class DamageOutput(BaseModel):
    """An unreadable stretch."""

    offset: int
    length: int
    reason: str


class SegmentOutput(BaseModel):
    """One segment file."""

    name: str
    size: int
    records: int
    header_ok: bool
    torn: DamageOutput | None
    corruption: list[DamageOutput]


class CheckOutput(BaseModel):
    """`journal check --json`."""

    journal: str
    segments: list[SegmentOutput]
    records: int
    live_messages: int
    queues: int
    next_mid: int
    torn_bytes: int
    corrupt_stretches: int
    damaged_marker: bool
    quarantined_files: list[str]
    result: Literal["clean", "torn-tail", "corrupt"]
    exit_code: int


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def journal_dir(data_dir: Path) -> Path:
    """The journal of a broker data dir (`<data-dir>/journal`), or a bare journal directory."""
    nested = data_dir / "journal"
    if nested.is_dir():
        return nested
    stored = (data_dir / DEFINITIONS).exists() or (data_dir / LOG).exists()
    if stored or any(data_dir.glob("*" + SUFFIX)):
        return data_dir
    raise JournalError(f"no journal in {data_dir} (expected {nested})")


def _output(data_dir: Path, report: CheckReport) -> CheckOutput:
    def dmg(offset: int, length: int, reason: str) -> DamageOutput:
        return DamageOutput(offset=offset, length=length, reason=reason)

    marker = damage.load(data_dir) is not None
    qdir = damage.quarantine_dir(data_dir)
    quarantined = sorted(str(p) for p in qdir.iterdir()) if qdir.is_dir() else []
    if report.corruption or marker:
        result: Literal["clean", "torn-tail", "corrupt"] = "corrupt"
        code = EXIT_CORRUPT
    elif report.torn_bytes:
        result, code = "torn-tail", EXIT_TORN
    else:
        result, code = "clean", EXIT_CLEAN
    return CheckOutput(
        journal=str(report.directory),
        segments=[
            SegmentOutput(
                name=s.name,
                size=s.size,
                records=s.records,
                header_ok=s.header_ok,
                torn=None if s.torn is None else dmg(s.torn.offset, s.torn.length, s.torn.reason),
                corruption=[dmg(d.offset, d.length, d.reason) for d in s.corruption],
            )
            for s in report.segments
        ],
        records=report.records,
        live_messages=report.live_messages,
        queues=report.queues,
        next_mid=report.next_mid,
        torn_bytes=report.torn_bytes,
        corrupt_stretches=len(report.corruption),
        damaged_marker=marker,
        quarantined_files=quarantined,
        result=result,
        exit_code=code,
    )


def _print_check(out: CheckOutput, data_dir: Path) -> None:
    print(f"journal {out.journal}")
    for s in out.segments:
        state = "ok" if s.header_ok else "HEADER UNREADABLE"
        print(f"  {s.name}  {s.size} bytes  {s.records} records  {state}")
        for d in s.corruption:
            print(f"    CORRUPT at offset {d.offset}: {d.reason} ({d.length} bytes unreadable)")
        if s.torn is not None:
            print(
                f"    torn tail at offset {s.torn.offset}: {s.torn.reason} "
                f"({s.torn.length} bytes, never confirmed)"
            )
    print(
        f"{out.records} records, {out.live_messages} live messages in {out.queues} queues, "
        f"next mid {out.next_mid}"
    )
    if out.damaged_marker:
        print(f"damaged marker: {data_dir / damage.MARKER} (clear it with `journal repair`)")
    if out.quarantined_files:
        print(f"quarantine: {len(out.quarantined_files)} files")
        for name in out.quarantined_files:
            print(f"  {name}")
    verdict = {
        "clean": "clean",
        "torn-tail": "torn tail only (the next start truncates it; nothing confirmed is lost)",
        "corrupt": "CORRUPT: confirmed messages may be lost; run `journal repair`",
    }
    print(f"result: {verdict[out.result]}")


def _check(data_dir: Path, as_json: bool) -> int:
    try:
        report = check(journal_dir(data_dir))
    except (JournalError, OSError) as exc:
        print(f"journal check: cannot read the journal: {exc}", file=sys.stderr)
        return EXIT_UNREADABLE
    out = _output(data_dir, report)
    if as_json:
        print(out.model_dump_json(indent=1))
    else:
        _print_check(out, data_dir)
    return out.exit_code


def _repair(data_dir: Path) -> int:
    try:
        directory = journal_dir(data_dir)
        journal = Journal(directory, quarantine=damage.quarantine_dir(data_dir))
        recovered = journal.open()
    except (JournalError, OSError) as exc:
        print(f"journal repair: cannot open the journal: {exc}", file=sys.stderr)
        return EXIT_UNREADABLE
    asyncio.run(journal.close())
    _print_repair(directory, recovered)
    marker = damage.load(data_dir)
    if damage.clear(data_dir):
        found = 0 if marker is None else len(marker.corruption)
        print(f"cleared the damaged marker ({found} corruption reports in it)")
    print("repaired: the broker can start (and be activated) normally")
    return EXIT_CLEAN


def _print_repair(directory: Path, rec: Recovered) -> None:
    print(f"journal {directory}")
    print(
        f"{rec.segments} segments, {rec.records} records, "
        f"{sum(len(m) for m in rec.messages.values())} live messages, next mid {rec.next_mid}"
    )
    if rec.torn_bytes and not rec.corruption:
        print(f"truncated a torn tail of {rec.torn_bytes} bytes (never confirmed)")
    for found in rec.corruption:
        print(f"corruption: {found.describe()}")
    if rec.corruption:
        print(f"re-appended {rec.reappended} live messages out of the damaged segments")
    for path in rec.quarantined:
        print(f"quarantined: {path}")


def main(argv: list[str]) -> int:
    """`twinmq-broker journal ...`; returns the exit code."""
    parser = _Parser(
        prog="twinmq-broker journal", description="Inspect or repair a stopped broker's journal"
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p_check = sub.add_parser("check", help="scan and report (read-only)")
    p_check.add_argument("data_dir", type=Path, help="the broker's --data-dir")
    p_check.add_argument("--json", action="store_true", help="print the report as JSON")
    p_repair = sub.add_parser("repair", help="quarantine damage and clear the damaged marker")
    p_repair.add_argument("data_dir", type=Path, help="the broker's --data-dir (broker stopped)")
    args = parser.parse_args(argv)
    if args.command == "check":
        return _check(args.data_dir, args.json)
    return _repair(args.data_dir)
