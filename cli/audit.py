"""`twinmq audit` runs the replication audit; `twinmq audit-ship` ships a broker's segments.

    twinmq audit --store URL [--master local[*]] [--full] [--run-id ID] [--json]
    twinmq audit --store URL_A --mirror-store URL_B [--full] [--json]   # across DR sites
    twinmq audit --store URL_A --mirror-store URL_B --mirror-store URL_C [--site-ids A,B,C]
    twinmq audit-ship --store URL --audit-dir DATA_DIR/audit [--every SECONDS]

Exit codes of `audit`: 0 PASS, 1 FAIL, 2 error. The same entry point serves
`spark-apps/replication_audit.py` under `spark-submit` (where spark-submit
chooses the master). Configuration is read here and nowhere else.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

EXIT_PASS, EXIT_FAIL, EXIT_ERROR = 0, 1, 2

log = logging.getLogger("twinmq.audit")

LOCAL_DEFAULTS = {
    "spark.driver.memory": "4g",
    "spark.ui.enabled": "false",
    # One machine: shuffle files stay in the page cache, compressing them only costs CPU.
    "spark.shuffle.compress": "false",
    "spark.shuffle.spill.compress": "false",
    "spark.rdd.compress": "false",
    "spark.sql.inMemoryColumnarStorage.compressed": "false",
}
"""Spark settings of `twinmq audit` in local mode (each overridable with --conf)."""


def _audit_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from twinmq.audit.transforms import DEFAULT_STREAM_PATTERN

    parser.add_argument("--store", required=True, help="audit store URL: a path, file:// or s3://")
    parser.add_argument(
        "--master",
        default=None,
        help="Spark master (default: spark-submit's, else local[*])",
    )
    parser.add_argument(
        "--full", action="store_true", help="ignore the watermark: audit every segment again"
    )
    parser.add_argument("--block-bits", type=int, default=16, help="state block size (2^bits ids)")
    parser.add_argument(
        "--bucket-seconds", type=float, default=60.0, help="time bucket of lag over time"
    )
    parser.add_argument(
        "--stream-pattern",
        default=DEFAULT_STREAM_PATTERN,
        help="regex on message ids: group 1 the publisher stream, group 2 its sequence number",
    )
    parser.add_argument(
        "--conf", action="append", default=[], metavar="KEY=VALUE", help="Spark configuration"
    )
    parser.add_argument("--work-dir", type=Path, help="local copies for an S3 store without s3a")
    parser.add_argument("--run-id", help="name of this run (default: time and a random suffix)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument(
        "--mirror-store",
        action="append",
        default=[],
        help="another DR site's store: audit the sites against each other (every direction) "
        "instead of --store's pair; repeated for a ring or a full mesh (sites b, c, ...)",
    )
    parser.add_argument(
        "--site-ids",
        help="the sites' mirror ids, comma-separated in store order (--store first): needed "
        "where the logs cannot tell which id is whose (a ring of three)",
    )
    return parser


def _ship_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--store", required=True, help="audit store URL: a path, file:// or s3://")
    parser.add_argument(
        "--audit-dir", required=True, type=Path, help="the broker's <data-dir>/audit"
    )
    parser.add_argument("--broker", help="ship only this broker's segments")
    parser.add_argument("--every", type=float, default=0.0, help="repeat every N seconds (0: once)")
    parser.add_argument(
        "--keep-shipped",
        type=float,
        metavar="SECONDS",
        help="delete local segments shipped to this store more than SECONDS ago, each "
        "broker's newest excepted (default: keep them all)",
    )
    return parser


def audit_main(argv: Sequence[str] | None = None) -> int:
    """`twinmq audit`: one audit run; the exit code is the verdict."""
    args = _audit_parser(argparse.ArgumentParser(prog="twinmq audit")).parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        from twinmq.audit.job import AuditParams, build_session, run_audit, summary_json
        from twinmq.audit.store import Store
        from twinmq.audit.summary import Verdict

        conf = dict(kv.split("=", 1) for kv in args.conf)
        master = args.master
        if master is None and "PYSPARK_GATEWAY_PORT" not in os.environ:
            master = "local[*]"  # not under spark-submit: the embedded default
        if master and master.startswith("local"):
            for key, value in LOCAL_DEFAULTS.items():
                conf.setdefault(key, value)
            conf.setdefault("spark.sql.shuffle.partitions", str(2 * (os.cpu_count() or 1)))
        spark = build_session(master, conf=conf)
        params = AuditParams(
            block_bits=args.block_bits,
            bucket_seconds=args.bucket_seconds,
            stream_pattern=args.stream_pattern,
        )
        store = Store(args.store)
        if args.mirror_store:
            return _cross_site(spark, store, [Store(m) for m in args.mirror_store], args)
        summary = run_audit(
            spark, store, params, full=args.full, work_dir=args.work_dir, run_id=args.run_id
        )
    except Exception:
        log.exception("audit failed")
        return EXIT_ERROR
    if args.json:
        print(summary_json(summary))
    else:
        t = summary.totals
        print(
            f"{summary.verdict.value}: {t.messages} messages, lost {t.lost}, "
            f"resent {t.resent}, replicated twice {t.replicated_twice}, "
            f"reordered {t.reordered}, digest mismatches {t.digest_mismatch}, "
            f"unreplicated at end {t.unreplicated_at_end} "
            f"(by design {t.unreplicated_by_design})"
        )
        if summary.lag is not None:
            lag = summary.lag
            print(
                f"lag p50 {lag.p50:.6f}s p95 {lag.p95:.6f}s p99 {lag.p99:.6f}s "
                f"max {lag.max:.6f}s over {lag.count} messages"
            )
        for f in summary.failovers:
            print(f"failover e{f.from_epoch}->e{f.to_epoch} {f.from_active}->{f.to_active}, "
                  f"gap {f.gap_seconds}s")  # fmt: skip
        for reason in summary.failures:
            print(f"FAIL: {reason}")
        print(f"{summary.mode} run {summary.run_id}: {summary.segments_read} segments, "
              f"{summary.events_read} events in {summary.seconds:.1f}s; "
              f"findings: {summary.findings_path}")  # fmt: skip
    return EXIT_PASS if summary.verdict == Verdict.PASS else EXIT_FAIL


def ship_main(argv: Sequence[str] | None = None) -> int:
    """`twinmq audit-ship`: ship closed segments (once, or every N seconds)."""
    args = _ship_parser(argparse.ArgumentParser(prog="twinmq audit-ship")).parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from twinmq.audit.store import Store, prune_shipped, ship

    store = Store(args.store)
    # A sidecar is PID 1 of its container when the pod sets `command` (no init): without a
    # handler SIGTERM is ignored and the pod waits out its grace period. On SIGTERM: one
    # last pass (what the broker closed on its own shutdown), then exit.
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    last = False
    while True:
        try:
            report = ship(args.audit_dir, store, broker=args.broker)
            log.info("shipped %d segments (%d already)", len(report.shipped), len(report.already))
            if args.keep_shipped is not None:
                prune_shipped(args.audit_dir, store, args.keep_shipped, report, time.time())
        except Exception:
            log.exception("shipping failed")
            if not args.every:
                return EXIT_ERROR
        if not args.every or last:
            return EXIT_PASS
        last = stop.wait(args.every)


COMMANDS = {"audit": audit_main, "audit-ship": ship_main}


def main(argv: Sequence[str] | None = None) -> int:
    """`twinmq <command> ...`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: twinmq {{{','.join(COMMANDS)}}} ...", file=sys.stderr)
        return EXIT_ERROR
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())


def _cross_site(spark: Any, store_a: Any, others: list[Any], args: argparse.Namespace) -> int:
    """`twinmq audit --store A --mirror-store B [--mirror-store C ...]`: the cross-site audit;
    exit code the verdict."""
    from twinmq.audit.cross import run_cross_site
    from twinmq.audit.cross_sites import parse_site_ids, site_names
    from twinmq.audit.summary import Verdict

    ids = parse_site_ids(args.site_ids, site_names(1 + len(others)))
    summary = run_cross_site(
        spark, store_a, *others, run_id=args.run_id, full=args.full, site_ids=ids
    )
    if args.json:
        print(summary.model_dump_json(indent=1))
    else:
        t = summary.totals
        print(
            f"{summary.verdict.value}: {t.messages} messages, mirrored {t.mirrored}, "
            f"lost {t.lost}, in flight {t.in_flight}, duplicated {t.duplicated}, "
            f"settled {t.settled}, unsettled on the other site {t.unsettled_on_mirror} "
            f"(in flight {t.settles_in_flight})"
        )
        for d in summary.directions:
            c = d.counts
            print(f"  {d.source} -> {d.target}: {c.messages} messages, lost {c.lost}, "
                  f"in flight {c.in_flight}, duplicated {c.duplicated}, unsettled "
                  f"{c.unsettled_on_mirror}")  # fmt: skip
        if summary.lag is not None:
            lag = summary.lag
            print(f"lag between sites p50 {lag.p50:.6f}s p99 {lag.p99:.6f}s "
                  f"max {lag.max:.6f}s over {lag.count} messages")  # fmt: skip
        for reason in summary.failures:
            print(f"FAIL: {reason}")
    return EXIT_PASS if summary.verdict == Verdict.PASS else EXIT_FAIL
