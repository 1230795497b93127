"""Summarise a py-spy `--format raw` profile (collapsed stacks) of a TwinMQ broker.

Each sample is attributed to the hot-path stage of its leaf-most TwinMQ frame
(frame in, route, deliver, ack in, journal, confirm out, transport, metrics),
and the functions with the most self and inclusive samples are listed.
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

# py-spy raw frames look like "func (path/to/file.py)" or "func (path/to/file.py:123)".
_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::\d+)?\)$")

# (file suffix, function or "*") -> stage; the leaf-most match of a stack wins.
STAGES: list[tuple[str, str, str]] = [
    ("prometheus_client/", "*", "metrics (prometheus-client)"),
    ("broker/auditlog.py", "*", "audit log (JSON record per op, body digest)"),
    ("broker/dedup.py", "*", "dedup window (message ids)"),
    ("broker/replication/", "*", "replication source"),
    ("broker/metrics.py", "*", "metrics (prometheus-client)"),
    ("broker/server.py", "data_received", "frame in"),
    ("broker/connection.py", "receive_data", "frame in"),
    ("broker/connection.py", "_frame", "frame in"),
    ("broker/codec.py", "feed", "frame in"),
    ("broker/codec.py", "decode_method", "frame in"),
    ("broker/codec.py", "_short_str", "frame in"),
    ("broker/codec.py", "decode_content_header", "frame in"),
    ("broker/channel.py", "on_publish", "frame in"),
    ("broker/channel.py", "on_header", "frame in"),
    ("broker/channel.py", "on_body", "frame in"),
    ("broker/channel.py", "_complete", "route + enqueue"),
    ("broker/vhost.py", "exchange_for_publish", "route + enqueue"),
    ("broker/vhost.py", "publish", "route + enqueue"),
    ("broker/vhost.py", "_enqueue", "route + enqueue"),
    ("broker/routing.py", "*", "route + enqueue"),
    ("broker/queue.py", "push", "route + enqueue"),
    ("broker/queue.py", "dispatch", "deliver"),
    ("broker/queue.py", "pop", "deliver"),
    ("broker/queue.py", "expire", "deliver"),
    ("broker/channel.py", "ready", "deliver"),
    ("broker/channel.py", "deliver", "deliver"),
    ("broker/codec.py", "encode_deliver", "deliver"),
    ("broker/codec.py", "encode_content", "deliver"),
    ("broker/channel.py", "on_ack", "ack in + settle"),
    ("broker/channel.py", "_take", "ack in + settle"),
    ("broker/channel.py", "_settle", "ack in + settle"),
    ("broker/channel.py", "_redispatch", "deliver"),
    ("broker/vhost.py", "settle", "ack in + settle"),
    ("broker/vhost.py", "_settle_entries", "ack in + settle"),
    ("broker/commit.py", "add", "journal"),
    ("broker/commit.py", "_flush", "journal"),
    ("broker/journal/", "*", "journal"),
    ("concurrent/futures/", "*", "journal"),
    ("broker/alarms.py", "*", "alarms (once a second)"),
    ("broker/server.py", "heartbeat", "heartbeats (once a second)"),
    ("broker/commit.py", "_sync_once", "confirm out"),
    ("broker/commit.py", "_sync_loop", "confirm out"),
    ("broker/channel.py", "durable", "confirm out"),
    ("broker/channel.py", "_emit", "confirm out"),
    ("broker/channel.py", "_add_pending", "confirm out"),
    ("broker/codec.py", "encode_basic_ack", "confirm out"),
    ("broker/server.py", "_flush", "transport out"),
    ("broker/server.py", "_wake", "transport out"),
    ("broker/connection.py", "send", "transport out"),
    ("broker/connection.py", "data_to_send", "transport out"),
    ("broker/server.py", "resume_writing", "transport out"),
    ("broker/server.py", "pause_writing", "transport out"),
]


def _parse(frame: str) -> tuple[str, str]:
    m = _FRAME.match(frame.strip())
    if m is None:
        return frame.strip(), ""
    return m.group("func"), m.group("file")


def stage_of(frames: list[tuple[str, str]]) -> str:
    """The stage of the leaf-most frame that has one."""
    if any("concurrent/futures/thread.py" in file for _, file in frames):
        return "journal writer thread (write + fdatasync, GIL released in syscalls)"
    leaf_func, leaf_file = frames[-1]
    if leaf_file.startswith(("asyncio/", "uvloop/")) or "/asyncio/" in leaf_file:
        return "event loop: uvloop C code, socket reads, callbacks"
    for func, file in reversed(frames):
        for suffix, name, stage in STAGES:
            if suffix in file and (name == "*" or func == name or func.endswith("." + name)):
                return stage
    return f"other ({leaf_func})"


@dataclass
class Profile:
    """Sample counts by stage and function."""

    total: int
    stages: Counter[str]
    self_time: Counter[str]
    inclusive: Counter[str]

    def report(self, top: int = 15) -> str:
        """Markdown tables: stages, then top functions by self and inclusive samples."""
        lines = [
            f"{self.total} samples (threads that were running, not waiting: py-spy without "
            "--idle); stage = the leaf-most TwinMQ frame of each sample's stack.",
            "",
            "| stage | share of samples |",
            "|---|---:|",
        ]
        for stage, n in self.stages.most_common():
            lines.append(f"| {stage} | {100 * n / self.total:.1f} % |")
        lines += ["", "| function (self) | self | inclusive |", "|---|---:|---:|"]
        for name, n in self.self_time.most_common(top):
            lines.append(
                f"| `{name}` | {100 * n / self.total:.1f} % | "
                f"{100 * self.inclusive[name] / self.total:.1f} % |"
            )
        return "\n".join(lines)


def _short(func: str, file: str) -> str:
    for marker in ("/broker/", "site-packages/", "/lib/python3"):
        if marker in file:
            file = file.split(marker, 1)[1]
            break
    return f"{func} ({file})" if file else func


def summarise(path: Path) -> Profile:
    """Read a py-spy raw profile."""
    stages: Counter[str] = Counter()
    self_time: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [_parse(f) for f in stack.split(";")]
        # py-spy puts "process ..." and "thread ..." pseudo-frames first.
        frames = [f for f in frames if f[1]]
        if not frames:
            continue
        total += count
        stages[stage_of(frames)] += count
        self_time[_short(*frames[-1])] += count
        for name in {_short(*f) for f in frames}:
            inclusive[name] += count
    return Profile(total or 1, stages, self_time, inclusive)


if __name__ == "__main__":
    print(summarise(Path(sys.argv[1])).report(int(sys.argv[2]) if len(sys.argv) > 2 else 15))
