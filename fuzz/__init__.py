"""Coverage-guided fuzzing of every parser that reads bytes from outside the broker.

Each target (`twinmq.fuzz.targets.TARGETS`) is one function of arbitrary bytes that
must never raise anything but the error its parser documents, and whose accepted
inputs must satisfy what the rest of the broker relies on (a content header accepted
at publish can be routed, dead-lettered and recovered; definitions a client could
create load back at the next start). `python -m twinmq.fuzz.run` drives a target
with atheris (libFuzzer); `make fuzz` runs them all; `tests/test_fuzz_targets.py`
replays every seed and every past finding (`fuzz/regressions/`) in the unit tests.
"""
