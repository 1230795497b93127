# Replication audits (docs/audit.md): PySpark 4 needs a Java 17 runtime for the Spark tests.
SYSTEM_PACKAGES += openjdk-17-jre-headless

.PHONY: audit-bench
audit-bench: $(STAMP) system-deps  ## events audited per second, 1 M and 10 M (docs/benchmarks.md)
	$(PY) bench/audit_bench.py --events 1000000 10000000 --increment 0.01
