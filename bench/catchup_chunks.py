"""The active's own work in a catch-up: plan and build every chunk, in-process, no I/O.

    .venv/bin/python bench/catchup_chunks.py --messages 200000
    valgrind --tool=callgrind .venv/bin/python bench/catchup_chunks.py --messages N

A `CatchupStream` over one queue of `--messages` x `--size` byte messages (the
passive holds none of them) is stepped to the end, each chunk framed as
`CatchupSender` frames it (`encode_batch`). Every step holds the active's event
loop (and the GIL): the thread CPU time of each step, its maximum and p99, is
how long a confirm can wait behind the catch-up on a core of its own. The
garbage collector's runs during the steps are counted too: the active holds
the whole backlog as objects, and a full collection walks all of them, with
the loop held.
Instructions (callgrind, two sizes, the difference per message) do not depend
on the machine's load; wall time here does.
"""

from __future__ import annotations

import argparse
import gc
import time
from typing import Any

from twinmq.broker.message import Entry, Message
from twinmq.broker.replication.catchup import CatchupStream
from twinmq.broker.replication.protocol import BATCH_CATCHUP, encode_batch


def build_queue(messages: int, size: int) -> list[Entry]:
    """A durable queue's entries: journaled persistent messages."""
    body = b"x" * size
    header = b"\x10\x00\x02"  # delivery_mode=2, as a publisher sends it
    return [
        Entry(Message(mid, "", "backlog", header, body, True, None, None), None, True)
        for mid in range(1, messages + 1)
    ]


def run(entries: list[Entry]) -> tuple[list[float], list[float], int]:
    """Step a catch-up of `entries` to its end: (chunk step seconds, plan step seconds, bytes)."""
    stream = CatchupStream({1: entries}, {}, len(entries) + 1, queue_exists=lambda qid: True)
    chunks: list[float] = []
    plans: list[float] = []
    sent = 0
    while not stream.finished:
        start = time.thread_time()
        chunk = stream.step()
        if chunk is not None:
            frame = encode_batch(len(chunks) + 1, BATCH_CATCHUP, chunk.payload)
            sent += len(frame)
            chunks.append(time.thread_time() - start)
        else:
            plans.append(time.thread_time() - start)
    return chunks, plans, sent


class Collections:
    """The garbage collector's runs (generation, CPU seconds) while `active`."""

    def __init__(self) -> None:
        self.active = False
        self.runs: list[tuple[int, float]] = []
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if not self.active:
            return
        if phase == "start":
            self._started = time.thread_time()
        else:
            self.runs.append((info["generation"], time.thread_time() - self._started))


def quantile(values: list[float], q: float) -> float:
    """Nearest-rank quantile."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--size", type=int, default=1024)
    args = parser.parse_args()
    entries = build_queue(args.messages, args.size)
    collections = Collections()
    gc.callbacks.append(collections)
    collections.active = True
    chunks, plans, sent = run(entries)
    collections.active = False
    total = sum(chunks) + sum(plans)
    ms = {
        "p50": quantile(chunks, 0.5) * 1e3,
        "p99": quantile(chunks, 0.99) * 1e3,
        "max": max(chunks, default=0) * 1e3,
    }
    print(
        f"{args.messages} x {args.size} B: {len(chunks)} chunks, {len(plans)} planning steps, "
        f"{sent} bytes; CPU {total:.3f} s ({total / args.messages * 1e6:.2f} us/message); "
        "chunk step ms " + " ".join(f"{k} {v:.2f}" for k, v in ms.items()) + "; "
        f"plan step ms max {max(plans, default=0) * 1e3:.2f}"
    )
    runs = collections.runs
    print(
        "garbage collections during the steps: "
        + ", ".join(f"gen{g} {sum(1 for r in runs if r[0] == g)}" for g in range(3))
        + f"; longest {max((s for _, s in runs), default=0) * 1e3:.1f} ms"
    )


if __name__ == "__main__":
    main()
