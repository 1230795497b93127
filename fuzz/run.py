"""Run one fuzz target under atheris (libFuzzer): `python -m twinmq.fuzz.run <target>`.

The broker's modules and pamqp (which decodes most methods) are instrumented for
coverage, and only they (the connection core's target leaves pamqp out, below):
atheris instruments whole top-level packages (`twinmq`), so the fuzzer's own code
(`twinmq.fuzz`, `twinmq.testing`: the harnesses and their checks) is excluded by name;
it is not what is under test, and instrumented it ran several times slower and counted
its own branches as coverage. The corpus folder keeps what the fuzzer learnt between
runs (seeded from the target's valid inputs when empty); a finding is written to the
artifacts folder and the run stops with libFuzzer's exit code. libFuzzer's own limits
make a hang (`-timeout`, seconds per input) and unbounded memory (`-rss_limit_mb`)
findings too.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import pkgutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import atheris

if TYPE_CHECKING:
    from twinmq.fuzz.targets import Target

HARNESS = ("twinmq.fuzz", "twinmq.testing")
"""The fuzzer's own packages: never instrumented."""


def harness_modules() -> list[str]:
    """Every module of the `HARNESS` packages (their `__init__` imported, nothing else)."""
    names = []
    for name in HARNESS:
        package = importlib.import_module(name)
        names.append(name)
        names += [m.name for m in pkgutil.iter_modules(package.__path__, f"{name}.")]
    return names


INSTRUMENTED = ("twinmq.broker", "pamqp")
"""The packages whose branches count as coverage."""

BROKER_ONLY = frozenset({"amqp_connection"})
"""Targets that instrument the broker alone: pamqp's decoding is `amqp_method`'s to
fuzz, and instrumented under the connection core it cost a quarter of each input's time."""


def load_target(name: str) -> Target | None:
    """Import the targets with `name`'s packages instrumented; `None` if no such target."""
    include = ["twinmq.broker"] if name in BROKER_ONLY else list(INSTRUMENTED)
    with atheris.instrument_imports(include=include, exclude=harness_modules()):
        from twinmq.fuzz.targets import TARGETS
    return TARGETS.get(name)


def seed_corpus(folder: Path, seeds: list[bytes]) -> None:
    """Write the target's seeds into an empty corpus folder (named by content)."""
    folder.mkdir(parents=True, exist_ok=True)
    if any(folder.iterdir()):
        return
    for seed in seeds:
        (folder / f"seed-{hashlib.sha1(seed).hexdigest()}").write_bytes(seed)


def main(argv: list[str] | None = None) -> None:
    """Parse the arguments and fuzz; never returns (libFuzzer exits)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # The target's name is read before the broker is imported: which packages are
    # instrumented depends on it.
    parser.add_argument("target")
    parser.add_argument("--runs", type=int, default=10_000_000, help="inputs to try")
    parser.add_argument("--corpus", type=Path, default=Path(".cache/fuzz/corpus"))
    parser.add_argument("--artifacts", type=Path, default=Path(".cache/fuzz/findings"))
    parser.add_argument("--max-len", type=int, default=4096, help="longest input, bytes")
    parser.add_argument("--timeout", type=int, default=10, help="seconds one input may take")
    parser.add_argument("--rss-limit-mb", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0, help="libFuzzer's seed (0: random)")
    args = parser.parse_args(argv)
    target = load_target(args.target)
    if target is None:
        parser.error(f"no fuzz target {args.target!r}")
    corpus = args.corpus / target.name
    artifacts = args.artifacts / target.name
    seed_corpus(corpus, target.seeds())
    artifacts.mkdir(parents=True, exist_ok=True)
    libfuzzer = [
        sys.argv[0],
        f"-runs={args.runs}",
        f"-max_len={args.max_len}",
        f"-timeout={args.timeout}",
        f"-rss_limit_mb={args.rss_limit_mb}",
        f"-seed={args.seed}",
        f"-artifact_prefix={artifacts}/",
        "-print_final_stats=1",
        str(corpus),
    ]
    atheris.Setup(libfuzzer, target.one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
