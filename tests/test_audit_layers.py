"""The audit's pure layers import no Spark: the broker, shipper and operator can use them."""

from __future__ import annotations

import subprocess
import sys


def test_records_summary_schema_and_store_do_not_import_spark() -> None:
    code = (
        "import sys\n"
        "import twinmq.audit.records, twinmq.audit.summary, twinmq.audit.schema\n"
        "import twinmq.audit.store, twinmq.audit.synthetic\n"
        "assert not [m for m in sys.modules if m.startswith('pyspark')], 'pyspark imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_lag_bins_round_trip() -> None:
    from twinmq.audit.summary import bin_value, lag_bin, lag_stats

    for lag in (-2.5, -0.002, 0.0, 3e-7, 0.0015, 1.0, 42.0):
        value = bin_value(lag_bin(lag))
        assert abs(value - lag) <= max(abs(lag) * 0.0051, 1e-6)
    stats = lag_stats([(lag_bin(x), 1) for x in (0.001, 0.002, 0.003, 0.004)], 0.001, 0.004)
    assert stats is not None and stats.count == 4
    assert abs(stats.p50 - 0.002) < 0.00002 and abs(stats.p99 - 0.004) < 0.00004
    assert lag_stats([], 0.0, 0.0) is None
