"""`twinmq audit` / `twinmq audit-ship`: exit codes 0 PASS, 1 FAIL, 2 error; JSON output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("pyspark")

from audit_scenario import Scenario, build
from pyspark.sql import SparkSession

from twinmq.cli.audit import main

pytestmark = [pytest.mark.spark, pytest.mark.slow]  # a JVM: minutes on 2 cores


def _ship(scenario: Scenario, root: Path) -> str:
    store = str(root / "store")
    for directory in scenario.log.write(root / "brokers").values():
        assert main(["audit-ship", "--store", store, "--audit-dir", str(directory)]) == 0
    return store


def test_exit_codes_and_json(
    tmp_path: Path, spark: SparkSession, capsys: pytest.CaptureFixture[str]
) -> None:
    del spark  # the session the CLI gets (getOrCreate) is the tests' one
    faulty = _ship(build(), tmp_path / "faulty")
    assert main(["audit", "--store", faulty, "--bucket-seconds", "2", "--json"]) == 1
    summary = json.loads(capsys.readouterr().out)
    assert summary["verdict"] == "FAIL" and summary["totals"]["lost"] == 2

    clean = Scenario()
    for n in range(1, 20):
        clean.guarded(1, "a", "b", "q", f"p:{n}")
    store = _ship(clean, tmp_path / "clean")
    assert main(["audit", "--store", store]) == 0
    assert capsys.readouterr().out.startswith("PASS: 19 messages, lost 0")

    three = Scenario()
    three.guarded(1, "a", "b", "q", None)
    store = _ship(three, tmp_path / "three")
    other = tmp_path / "three" / "brokers" / "c" / "audit"
    other.mkdir(parents=True)
    (other / "c-e000001-00000001.jsonl").write_text("")
    assert main(["audit-ship", "--store", store, "--audit-dir", str(other)]) == 0
    assert main(["audit", "--store", store]) == 2  # a store holds one pair
    assert main(["nonsense"]) == 2
