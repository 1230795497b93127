# The fault matrix of issue 11 (docs/reliability.md). Included by the top-level Makefile.
# tests/test_fsync_order.py attaches strace to real broker processes to prove that every
# confirm, tx.commit-ok and passive ACK follows a completed fdatasync (it skips without it).
SYSTEM_PACKAGES += strace
# libfaketime moves a broker's clock for the clock-jump class (skipped without it).
SYSTEM_PACKAGES += faketime

# The long fault matrix: TWINMQ_FAULT_CYCLES cycles per fault class (default 100), each
# class on a pair of its own under confirms and transactions; the disk classes need root
# (a tmpfs per broker). The results table (JSON + markdown) goes to TWINMQ_FAULT_RESULTS
# (default .cache/faults/matrix-<time>); the path is printed. Optional:
# TWINMQ_FAULT_CLASSES=kill-active,corruption runs only those, TWINMQ_FAULT_SEED; the brokers'
# logs of a class that fails go to <results>-<class>-logs/ (of every class with
# TWINMQ_FAULT_KEEP_LOGS=1).
#   make faults TWINMQ_FAULT_CYCLES=20
TWINMQ_FAULT_CYCLES ?= 100

.PHONY: faults
faults: $(STAMP) system-deps
	TWINMQ_FAULT_CYCLES=$(TWINMQ_FAULT_CYCLES) $(VENV)/bin/pytest -q -s -m faults \
	  tests/test_replication_faults.py
