# The fault matrix of issue 11 (docs/reliability.md). Included by the top-level Makefile.
# tests/test_fsync_order.py attaches strace to real broker processes to prove that every
# confirm, tx.commit-ok and passive ACK follows a completed fdatasync (it skips without it).
SYSTEM_PACKAGES += strace
