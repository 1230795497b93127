"""Inputs per CPU second of one fuzz target, replaying a fixed set of inputs.

    .venv/bin/python bench/fuzz_rate.py amqp_connection --count 3000 --corpus DIR

The target runs as `twinmq.fuzz.run` instruments it (atheris), over the files of
`--corpus` (default: the target's seeds), cycled to `--count` inputs; CPU time is
the process's, so a loaded machine changes it less than libFuzzer's `exec/s`. Compare
trees by running it alternately on each (docs/security.md, "Fuzzing").
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def main() -> None:
    """Replay the inputs and print the rate."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("target")
    parser.add_argument("--count", type=int, default=3000)
    parser.add_argument("--corpus", type=Path, help="a folder of inputs (default: the seeds)")
    args = parser.parse_args()
    # Instruments the broker as a fuzzing run does (imported for that side effect first).
    from twinmq.fuzz.run import TARGETS

    target = TARGETS[args.target]
    pool = (
        [p.read_bytes() for p in sorted(args.corpus.iterdir()) if p.is_file()]
        if args.corpus
        else target.seeds()
    )
    inputs = [pool[i % len(pool)] for i in range(args.count)]
    target.one_input(inputs[0])  # set-up outside the measured interval
    cpu, wall = time.process_time(), time.perf_counter()
    for data in inputs:
        target.one_input(data)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    print(
        f"{args.target}: {args.count} inputs ({len(pool)} distinct), {cpu:.2f} s CPU "
        f"({args.count / cpu:.0f}/CPU s), {wall:.2f} s wall ({args.count / wall:.0f}/s)"
    )


if __name__ == "__main__":
    main()
