"""Catch-up of a large backlog: throughput, and the active's confirm latency meanwhile.

    .venv/bin/python bench/catchup_bench.py                       # both cases, 3 runs each
    .venv/bin/python bench/catchup_bench.py --cases 1m --runs 1   # one case, once

Each run starts a fresh active broker on a temporary data directory, fills one
durable queue with persistent messages (publisher confirms, raw pamqp client),
then starts a fresh passive that must catch all of it up over loopback. A probe
client publishes one persistent message at a time to another queue of the
active and times each confirm, during the catch-up and afterwards (the pair in
sync, for as long again, 10 to 20 s): the p99 of both is the cost of a catch-up
to the active's clients. Throughput is the catch-up's bytes (the active's
`/status`) over its duration (the active's log: attach to caught up). Peak RSS
of both brokers is read from /proc. Nothing asserts a timing; docs/benchmarks.md
has the results.

Cases: `1m` = 1,000,000 x 1 KiB; `2g` = 32,768 x 64 KiB (2 GiB); `200k` and
`smoke` (50,000) x 1 KiB for quick looks. `--passive-dir` puts the passive's
data directory on another file system (a second disk, or tmpfs). `--pin` gives the
passive a CPU of its own (the last one) and the active, the probe and the filler the
others, as on a Kubernetes cluster where the pair's pods run on different nodes; the
disk stays shared.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import amqp_raw  # noqa: E402
from pamqp import commands  # noqa: E402

from twinmq.broker.api import CatchupStatus  # noqa: E402
from twinmq.broker.names import PASSIVE, REPLICATION_TOKEN_ENV  # noqa: E402
from twinmq.testing.launcher import BrokerProcess  # noqa: E402
from twinmq.testing.rawamqp import RawClient, publish  # noqa: E402
from twinmq.testing.waiting import wait_for  # noqa: E402

TOKEN = "catchup-bench-token"
CASES = {
    "1m": (1_000_000, 1024),
    "2g": (32_768, 64 * 1024),
    "200k": (200_000, 1024),
    "smoke": (50_000, 1024),
}


@dataclass
class RunResult:
    """One catch-up."""

    case: str
    messages: int
    size: int
    fill_seconds: float
    catchup_seconds: float
    catchup_bytes: int
    chunks: int
    mb_per_s: float
    p50_during_ms: float
    p99_during_ms: float
    p50_normal_ms: float
    p99_normal_ms: float
    probes_during: int
    probes_normal: int
    active_peak_rss_mib: float
    passive_peak_rss_mib: float
    passive_messages: int


@dataclass
class Probe:
    """Confirm latencies of one-at-a-time persistent publishes: (sent at, seconds)."""

    samples: list[tuple[float, float]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)


def peak_rss_mib(broker: BrokerProcess) -> float:
    """VmHWM of the broker process."""
    assert broker.proc is not None
    text = Path(f"/proc/{broker.proc.pid}/status").read_text()
    match = re.search(r"VmHWM:\s+(\d+) kB", text)
    return int(match.group(1)) / 1024 if match else 0.0


def open_channel(broker: BrokerProcess, queue: str) -> RawClient:
    """A connection with channel 1 open, `queue` declared durable, confirms on."""
    return amqp_raw.open_channel(broker.host, broker.port, queue, durable=True)


def fill(broker: BrokerProcess, queue: str, count: int, size: int) -> None:
    """Publish `count` persistent messages with confirms, a window of them in flight."""
    conn = open_channel(broker, queue)
    try:
        window = max(4, min(amqp_raw.WINDOW, (64 << 20) // size))
        amqp_raw.publish_confirmed(conn, queue, count, size, delivery_mode=2, window=window)
    finally:
        amqp_raw.close(conn)


def run_probe(broker: BrokerProcess, probe: Probe, interval: float) -> None:
    """Publish one persistent message at a time until `probe.stop`; time each confirm."""
    conn = open_channel(broker, "probe")
    one = publish(1, "probe", b"x" * 256, properties=commands.Basic.Properties(delivery_mode=2))
    try:
        while not probe.stop.is_set():
            start = time.monotonic()
            conn.send(one)
            conn.expect(commands.Basic.Ack, 1)
            probe.samples.append((start, time.monotonic() - start))
            probe.stop.wait(interval)
    finally:
        amqp_raw.close(conn)


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of `values`, nearest rank."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def one_run(
    case: str,
    root: Path,
    probe_interval: float,
    passive_root: Path | None = None,
    profile: Path | None = None,
    max_rate: float = 0.0,
    passive_cpus: set[int] | None = None,
) -> RunResult:
    """Fill an active, catch a fresh passive up, probe confirms meanwhile and after.

    `profile`: py-spy samples the active during the catch-up (`--format raw`,
    one line per thread and stack) into that file.
    """
    count, size = CASES[case]
    env = {REPLICATION_TOKEN_ENV: TOKEN}
    active_env = {**env, "TWINMQ_CATCHUP_MAX_RATE": str(int(max_rate * 1e6))}
    active = BrokerProcess(root / "a", name="a", env=active_env)
    passive = BrokerProcess((passive_root or root) / "b", name="b", env=dict(env))
    active.extra_args = ["--epoch", "1"]
    passive.extra_args = [
        "--epoch", "1", "--role", PASSIVE, "--replicate-from", active.replication_address,
    ]  # fmt: skip
    active.start()
    try:
        started = time.monotonic()
        fill(active, "backlog", count, size)
        fill_seconds = time.monotonic() - started
        probe = Probe()
        prober = threading.Thread(target=run_probe, args=(active, probe, probe_interval))
        prober.start()
        time.sleep(1.0)  # the probe settles
        assert active.log_path is not None
        log_offset = active.log_path.stat().st_size
        spy = None
        if profile is not None:
            assert active.proc is not None
            spy = subprocess.Popen(
                [
                    str(Path(sys.executable).parent / "py-spy"), "record", "--pid",
                    str(active.proc.pid), "--rate", "250", "--threads", "--nonblocking",
                    "--format", "raw", "--output", str(profile),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        if passive_cpus is None:
            passive.start(timeout=120)
        else:
            # The child inherits the forking thread's mask: only this thread switches.
            own = os.sched_getaffinity(0)
            os.sched_setaffinity(0, passive_cpus)
            try:
                passive.start(timeout=120)
            finally:
                os.sched_setaffinity(0, own)
        attach_at = time.monotonic()  # the passive is up: it attaches at once

        def caught_up() -> CatchupStatus | None:
            state = active.admin.status().replication.catchup
            return state if state is not None and not state.in_progress else None

        state = wait_for("caught up", caught_up, timeout=3600, interval=0.1)
        done_at = time.monotonic()
        if spy is not None:
            spy.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
            spy.wait(60)
        with open(active.log_path) as log:
            log.seek(log_offset)
            text = log.read()
        match = re.search(r"caught up in ([0-9.]+)s", text)
        seconds = float(match.group(1)) if match else done_at - attach_at
        normal_from = time.monotonic()
        time.sleep(min(20.0, max(10.0, done_at - attach_at)))
        probe.stop.set()
        prober.join()
        during = [lat for at, lat in probe.samples if attach_at <= at <= done_at]
        normal = [lat for at, lat in probe.samples if at >= normal_from]
        queues = passive.admin.status().queues
        backlog = [q.messages + q.unacked for q in queues if q.name == "backlog"]
        passive_messages = sum(backlog)
        return RunResult(
            case=case,
            messages=count,
            size=size,
            fill_seconds=round(fill_seconds, 1),
            catchup_seconds=seconds,
            catchup_bytes=state.bytes,
            chunks=state.chunks,
            mb_per_s=round(state.bytes / seconds / 1e6, 1),
            p50_during_ms=round(percentile(during, 0.5) * 1000, 2),
            p99_during_ms=round(percentile(during, 0.99) * 1000, 2),
            p50_normal_ms=round(percentile(normal, 0.5) * 1000, 2),
            p99_normal_ms=round(percentile(normal, 0.99) * 1000, 2),
            probes_during=len(during),
            probes_normal=len(normal),
            active_peak_rss_mib=round(peak_rss_mib(active), 0),
            passive_peak_rss_mib=round(peak_rss_mib(passive), 0),
            passive_messages=passive_messages,
        )
    finally:
        passive.stop()
        active.stop()


def describe() -> str:
    """`git describe` of the tree the brokers run from."""
    out = subprocess.run(
        ["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True
    )
    return out.stdout.strip()


def spread(values: list[float]) -> str:
    """median (min-max) of the runs."""
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default="1m,2g", help="comma-separated: " + ", ".join(CASES))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--probe-interval", type=float, default=0.005, help="seconds")
    parser.add_argument("--json", type=Path, help="write every run's figures here")
    parser.add_argument(
        "--passive-dir",
        type=Path,
        help="parent of the passive's data directory (default: beside the active's, same disk)",
    )
    parser.add_argument(
        "--max-rate",
        type=float,
        default=0.0,
        help="the active's catch-up rate cap, MB/s (--catchup-max-rate; default 0: none)",
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="the passive on the last CPU alone; the active, probe and filler on the others",
    )
    parser.add_argument(
        "--profile-active",
        type=Path,
        help="py-spy the active during each catch-up into this file (run number appended)",
    )
    args = parser.parse_args()
    tree = describe()
    print(f"tree {tree}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    passive_cpus = None
    if args.pin:
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            parser.error("--pin needs at least 2 CPUs")
        passive_cpus = {cpus[-1]}
        os.sched_setaffinity(0, set(cpus[:-1]))  # before any thread or broker starts
        print(f"pinned: passive on CPU {cpus[-1]}, the rest on {cpus[:-1]}", flush=True)
    results: list[RunResult] = []
    for case in args.cases.split(","):
        for _ in range(args.runs):
            with tempfile.TemporaryDirectory(prefix="twinmq-catchup-") as tmp:
                passive_root = None
                if args.passive_dir:
                    passive_root = Path(tempfile.mkdtemp(prefix="catchup-", dir=args.passive_dir))
                profile = None
                if args.profile_active is not None:
                    profile = args.profile_active.with_suffix(f".{case}.{len(results)}.txt")
                result = one_run(
                    case,
                    Path(tmp),
                    args.probe_interval,
                    passive_root,
                    profile,
                    args.max_rate,
                    passive_cpus,
                )
                if passive_root is not None:
                    shutil.rmtree(passive_root, ignore_errors=True)
            results.append(result)
            print(json.dumps(asdict(result)), flush=True)
            if args.json:
                args.json.write_text(json.dumps([asdict(r) for r in results], indent=1))
    print()
    print("| case | runs | catch-up s | MB/s | confirm p99 during (ms) | p99 normal (ms) |")
    print("|---|---|---|---|---|---|")
    for case in args.cases.split(","):
        rs = [r for r in results if r.case == case]
        count, size = CASES[case]
        print(
            f"| {count:,} x {size // 1024} KiB | {len(rs)} "
            f"| {spread([r.catchup_seconds for r in rs])} | {spread([r.mb_per_s for r in rs])} "
            f"| {spread([r.p99_during_ms for r in rs])} | {spread([r.p99_normal_ms for r in rs])} |"
        )


if __name__ == "__main__":
    main()
