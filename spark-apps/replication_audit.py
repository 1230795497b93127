"""The replication audit as a Spark application (a thin entry point).

    spark-submit spark-apps/replication_audit.py --store s3://bucket/pair-1
    python spark-apps/replication_audit.py --store /var/lib/twinmq-audit   # local[*]
    spark-submit spark-apps/replication_audit.py --store s3://a/site --mirror-store s3://b/site
    spark-submit spark-apps/replication_audit.py --store A --mirror-store B --mirror-store C

The job's logic is the `twinmq.audit` package (install `twinmq[audit]` in the
Spark image); arguments are those of `twinmq audit`. Exit code: 0 PASS,
1 FAIL, 2 error.
"""

from __future__ import annotations

import sys

from twinmq.cli.audit import audit_main

if __name__ == "__main__":
    sys.exit(audit_main(sys.argv[1:]))
