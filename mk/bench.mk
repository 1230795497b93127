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
