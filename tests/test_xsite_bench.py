"""The cross-site benchmarks run end to end on a tiny load (their numbers are not checked).

`bench/federation_vs_rabbitmq.py` and `bench/mirror_vs_shovel.py` start TwinMQ sites
and RabbitMQ nodes from Debian's rabbitmq-server; skipped where it is not installed
(the benchmarks install it themselves, a test does not).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RABBITMQ = Path("/usr/lib/rabbitmq/bin/rabbitmq-server")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not RABBITMQ.exists(), reason="Debian's rabbitmq-server not installed"),
]


def run(script: str, *args: str) -> str:
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), "--runs", "1", *args],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_the_federation_benchmark_reports_every_measure_for_both_brokers() -> None:
    out = run(
        "federation_vs_rabbitmq.py",
        "--seconds",
        "1",
        "--queues",
        "2",
        "--trials",
        "2",
        "--bindings",
        "20",
        "--cut-messages",
        "300",
        "--cut-gap",
        "0.2",
    )
    for row in (
        "confirms/s upstream",
        "bind propagation p99 ms",
        "resync after a link cut",
        "cut: confirmed but lost",
        "cut: delivered twice",
    ):
        assert row in out, out
    assert "TwinMQ run by run" in out and "RabbitMQ run by run" in out


def test_the_mirror_benchmark_reports_every_measure_for_both_brokers() -> None:
    out = run("mirror_vs_shovel.py", "--seconds", "1", "--cut-messages", "300", "--cut-gap", "0.2")
    for row in ("confirms/s on A", "lag p99 ms", "cut: confirmed but lost on B", "cut: twice on B"):
        assert row in out, out
    assert "TwinMQ run by run" in out and "RabbitMQ run by run" in out
