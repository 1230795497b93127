# Coverage-guided fuzzing (atheris, libFuzzer) of every parser of outside bytes: AMQP
# frames, methods, content headers and field tables, the connection core, the
# replication link, journal segments and records, the definitions file, DR mirror
# events, the admin API (fuzz/targets.py, docs/security.md "Fuzzing"). FUZZ_RUNS inputs per target
# (default 10 million, hours for the connection core); FUZZ_TARGETS to choose. The
# corpus stays in .cache/fuzz/corpus between runs; a finding goes to
# .cache/fuzz/findings/<target>/ and stops the run (copy it to fuzz/regressions/<target>/
# once fixed: the unit tests replay it). Each target's final libFuzzer statistics are
# kept in .cache/fuzz/<target>.log; libFuzzer's pulse lines show progress. Ctrl-C stops
# a run, reported as interrupted, not a finding: libFuzzer's exit code 72 (its statistics
# printed) or 130 (the signal taken by the Python code under test: no statistics). To stop
# a long run cleanly with its statistics: `pkill -USR1 -f twinmq.fuzz.run` (exit 0).
#   make fuzz FUZZ_RUNS=100000 FUZZ_TARGETS="amqp_method content_header"
FUZZ_RUNS ?= 10000000
FUZZ_TARGETS ?= $(shell $(PY) -c 'from twinmq.fuzz.targets import TARGETS; print(*TARGETS)' 2>/dev/null)

.PHONY: fuzz
fuzz: $(STAMP)
	@mkdir -p .cache/fuzz
	@for t in $(FUZZ_TARGETS); do \
	  echo "== fuzz $$t: $(FUZZ_RUNS) inputs (full log: .cache/fuzz/$$t.log)"; \
	  $(PY) -m twinmq.fuzz.run $$t --runs $(FUZZ_RUNS) 2>&1 | tee .cache/fuzz/$$t.log \
	    | grep --line-buffered -E 'pulse|DONE|^Done|^stat::|ERROR|Error|Traceback'; \
	  rc=$${PIPESTATUS[0]}; \
	  if [ $$rc -eq 72 ] || [ $$rc -eq 130 ]; then echo "fuzz $$t: interrupted (log: .cache/fuzz/$$t.log)"; exit $$rc; fi; \
	  if [ $$rc -ne 0 ]; then echo "fuzz $$t: a finding (exit $$rc): .cache/fuzz/$$t.log"; exit $$rc; fi; \
	done
