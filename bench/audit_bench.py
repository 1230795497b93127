"""Benchmark of the replication audit: events audited per second, full and incremental.

    .venv/bin/python bench/audit_bench.py --events 1000000 10000000 --increment 0.01

For each size: synthetic logs of a healthy pair (per message: `replicated` on
the passive, `confirmed` on the active 2 ms later, `dequeued` on both 0.5 s
later; 10 queues, numbered publisher message ids, a failover half-way) are
written straight into a fresh filesystem store as shipped Parquet segments of
100 000 records; then a full run (`twinmq audit` in local[*]), then 1 % more
events are shipped and an incremental run reads only them. Times exclude the
data generation; Spark's session start is reported on its own.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from twinmq.audit.job import AuditParams, build_session, run_audit
from twinmq.audit.schema import arrow_schema
from twinmq.audit.store import SegmentName, Store
from twinmq.cli.audit import LOCAL_DEFAULTS

SEGMENT = 100_000
QUEUES = 10
PUBLISHERS = 20
RATE = 10_000.0  # messages per second


def _timeline(messages: int, seed: int = 7) -> dict[str, dict[str, np.ndarray[Any, Any]]]:
    """Every broker's records in log order, as columns."""
    rng = np.random.default_rng(seed)
    n = np.arange(messages, dtype=np.int64)
    half = messages // 2
    epoch = np.where(n < half, 1, 2).astype(np.int64)
    rid = (epoch << 40) | (n + 1)
    t = 1.7e9 + n / RATE + np.where(n < half, 0.0, 3.0)  # a 3 s failover gap
    queue = rng.integers(0, QUEUES, messages)
    publisher = n % PUBLISHERS
    seq = n // PUBLISHERS
    digest = rng.integers(0, 2**63, messages)
    active = np.where(n < half, 0, 1)  # broker a, then b after the failover
    logs: dict[str, dict[str, np.ndarray[Any, Any]]] = {}
    for slot, broker in enumerate(("a", "b")):
        is_active = active == slot
        stored_t = np.where(is_active, t, t - 0.002)
        stored_event = np.where(is_active, 0, 2)  # confirmed / replicated
        times = np.concatenate([stored_t, t + 0.5])
        kinds = np.concatenate([stored_event, np.full(messages, 3)])
        order = np.argsort(times, kind="stable")
        idx = np.concatenate([n, n])[order]
        logs[broker] = {
            "idx": idx,
            "time": times[order],
            "event": kinds[order],
            "epoch": epoch[idx],
            "rid": rid[idx],
            "queue": queue[idx],
            "publisher": publisher[idx],
            "seq": seq[idx],
            "digest": digest[idx],
        }
    return logs


EVENTS = np.array(["confirmed", "confirmed-alone", "replicated", "dequeued"], dtype=object)


def _segment_table(broker: str, cols: dict[str, np.ndarray[Any, Any]], seq: int) -> pa.Table:
    stored = cols["event"] != 3
    queue_names = np.array([f"queue-{i}" for i in range(QUEUES)], dtype=object)
    ids = np.array(
        [
            f"publisher-{p}:{s}" if k else None
            for p, s, k in zip(cols["publisher"], cols["seq"], stored, strict=True)
        ],
        dtype=object,
    )
    digests = np.array(
        [f"{d:016x}" if k else "" for d, k in zip(cols["digest"], stored, strict=True)]
    )
    size = len(cols["rid"])
    return pa.table(
        {
            "broker": pa.array([broker] * size, pa.string()),
            "epoch": cols["epoch"],
            "queue": pa.array(queue_names[cols["queue"]], pa.string()),
            "replication_id": cols["rid"],
            "message_id": pa.array(ids, pa.string()),
            "digest": pa.array(digests, pa.string()),
            "event": pa.array(EVENTS[cols["event"]], pa.string()),
            "time": cols["time"],
            "origin": pa.nulls(size, pa.string()),  # a pair's logs: nothing mirrored
            "message_origin": pa.nulls(size, pa.string()),
            "origin_id": pa.nulls(size, pa.int64()),
            "vhost": pa.nulls(size, pa.string()),  # every queue `/`'s
            "segment_seq": np.full(size, seq, dtype=np.int64),
            "line": np.arange(size, dtype=np.int64),
        },
        schema=arrow_schema(),
    )


def write_segments(
    store: Store, logs: dict[str, dict[str, np.ndarray[Any, Any]]], start: float, stop: float
) -> int:
    """Ship the records between fractions `start` and `stop` of each log; returns records."""
    written = 0
    for broker, cols in logs.items():
        total = len(cols["rid"])
        lo, hi = int(total * start), int(total * stop)
        for first in range(lo, hi, SEGMENT):
            last = min(first + SEGMENT, hi)
            part = {k: v[first:last] for k, v in cols.items()}
            seq = 1 + first // SEGMENT if start == 0 else 1_000_000 + first // SEGMENT
            epoch = int(part["epoch"][0])
            name = SegmentName(broker, seq, epoch)
            out = io.BytesIO()
            pq.write_table(_segment_table(broker, part, seq), out, compression="zstd")
            store.write_bytes(name.key, out.getvalue())
            written += last - first
    return written


def _cpu_seconds(root: int) -> float:
    """CPU time (user + system) of a process and its live descendants (JVM, Python workers)."""
    tick = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    stats: dict[int, list[str]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(entry)] = fields
            children.setdefault(int(fields[1]), []).append(int(entry))
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        if pid in stats:
            total += (int(stats[pid][11]) + int(stats[pid][12])) / tick
        todo += children.get(pid, [])
    return total


def _loadavg() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def bench(events: int, increment: float, master: str, workdir: Path) -> dict[str, Any]:
    """One size: full run, then an incremental run after `increment` more events."""
    messages = int(events * (1 + increment) / 4)
    logs = _timeline(messages)
    store_dir = workdir / f"store-{events}"
    shutil.rmtree(store_dir, ignore_errors=True)
    store = Store(str(store_dir))
    base = 1 / (1 + increment)
    t0 = time.monotonic()
    base_events = write_segments(store, logs, 0.0, base)
    generated = time.monotonic() - t0

    t0 = time.monotonic()
    spark = build_session(
        master,
        conf={**LOCAL_DEFAULTS, "spark.driver.memory": "6g", "spark.sql.shuffle.partitions": "4"},
    )
    session = time.monotonic() - t0
    params = AuditParams()
    jvm = spark.sparkContext._gateway.proc.pid  # type: ignore[union-attr]
    load = [_loadavg()]
    cpu0, t0 = _cpu_seconds(jvm), time.monotonic()
    full = run_audit(spark, store, params)
    full_s, full_cpu = time.monotonic() - t0, _cpu_seconds(jvm) - cpu0
    load.append(_loadavg())
    new_events = write_segments(store, logs, base, 1.0)
    cpu0, t0 = _cpu_seconds(jvm), time.monotonic()
    incremental = run_audit(spark, store, params)
    incremental_s, incremental_cpu = time.monotonic() - t0, _cpu_seconds(jvm) - cpu0
    load.append(_loadavg())
    result = {
        "events": base_events,
        "generate_s": round(generated, 1),
        "session_s": round(session, 1),
        "full_s": round(full_s, 1),
        "full_events_per_s": round(base_events / full_s),
        "full_cpu_s": round(full_cpu, 1),
        "full_verdict": full.verdict.value,
        "new_events": new_events,
        "incremental_s": round(incremental_s, 1),
        "incremental_events_per_s": round(new_events / incremental_s),
        "incremental_cpu_s": round(incremental_cpu, 1),
        "load_average": load,
        "incremental_verdict": incremental.verdict.value,
        "messages_total": incremental.totals.messages,
        "lag_p99": incremental.lag.p99 if incremental.lag else None,
    }
    print(json.dumps(result), flush=True)
    return result


def main() -> None:
    """Parse arguments, run every size."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument("--increment", type=float, default=0.01)
    parser.add_argument("--master", default="local[*]")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "audit-bench")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("py4j").setLevel(logging.WARNING)
    args.workdir.mkdir(parents=True, exist_ok=True)
    for events in args.events:
        bench(events, args.increment, args.master, args.workdir)


if __name__ == "__main__":
    main()
