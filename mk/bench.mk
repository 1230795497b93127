# Benchmarks (issue 2): TwinMQ vs RabbitMQ with RabbitMQ's PerfTest. Included by the
# top-level Makefile; never part of `make test`, and nothing here asserts a timing.
#   make bench                      all cases, memory, 30 s per case; rewrites docs/benchmarks.md
#   make bench BENCH_ARGS='--duration 10 --cases persistent --no-doc'
#   make bench BENCH_ARGS='--profile'   also py-spy TwinMQ under the persistent load
# PerfTest comes from Maven Central into $${TWINMQ_CACHE_DIR:-~/.cache/twinmq}/bench;
# Debian's rabbitmq-server is installed if missing (apt-get, root).

BENCH_ARGS ?=

bench: $(STAMP)
	$(PY) bench/run_perftest.py $(BENCH_ARGS)

# Issue 4: the replicated pair vs a 3-node RabbitMQ cluster (quorum queues), same PerfTest
# parameters, one run, plus kill -9 failover time of the pair; appends/rewrites its own
# section of docs/benchmarks.md. Waits (up to 10 min) until no other benchmark runs.
#   make bench-pair BENCH_PAIR_ARGS='--duration 10 --failover-runs 3 --no-doc'
BENCH_PAIR_ARGS ?=

.PHONY: bench-pair
bench-pair: $(STAMP)
	$(PY) bench/pair_perftest.py $(BENCH_PAIR_ARGS)
