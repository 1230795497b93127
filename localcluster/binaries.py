"""Build the local cluster's binaries with the machine's `go`, cached by version.

The cache lives outside the repository so that a fresh clone on the same
machine reuses it: ``${TWINMQ_CACHE_DIR:-$HOME/.cache/twinmq}/k8s/<version>/bin``.
A binary is built only when missing; each build runs under ``nice -n 10``,
one at a time, and prints progress while it runs.

Kubernetes' own binaries come from a throw-away main module that requires
``k8s.io/kubernetes`` and replaces every ``k8s.io/*`` staging module (read
from the release's own go.mod) with the matching ``v0.X.Y``. A binary with
``upgrades`` gets those modules required on top of its own go.mod (the wrapper module
bumps vulnerable dependencies).

Run ``python -m twinmq.localcluster.binaries [NAME ...]``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from twinmq.localcluster.layout import node_mode
from twinmq.localcluster.versions import BINARIES, Binary, staging_version


def cache_dir() -> Path:
    """Return the root of TwinMQ's build cache (outside the repository)."""
    root = os.environ.get("TWINMQ_CACHE_DIR") or str(Path.home() / ".cache" / "twinmq")
    return Path(root) / "k8s"


def binary_path(binary: Binary) -> Path:
    """Return where the cached executable for `binary` lives (whether built or not)."""
    return cache_dir() / binary.cache_key / "bin" / binary.name


def find(name: str) -> Path:
    """Return the cached executable called `name`; raise FileNotFoundError if not built."""
    for binary in BINARIES:
        if binary.name == name:
            path = binary_path(binary)
            if not path.exists():
                raise FileNotFoundError(
                    f"{name} {binary.version} is not built yet: run `make cluster-binaries`"
                )
            return path
    raise KeyError(name)


def _log(message: str) -> None:
    print(f"[cluster-binaries] {message}", flush=True)


def _run(cmd: Sequence[str], cwd: Path, env: dict[str, str], log: Path) -> None:
    with log.open("a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}); log {log}:\n{tail}")


def _staging_replaces(version: str, env: dict[str, str], workdir: Path, log: Path) -> list[str]:
    """Return the staging module paths that `k8s.io/kubernetes@version` replaces locally."""
    with log.open("a") as out:
        proc = subprocess.run(
            ["go", "mod", "download", "-json", f"k8s.io/kubernetes@{version}"],
            cwd=workdir,
            env=env,
            stdout=subprocess.PIPE,
            stderr=out,
            text=True,
            check=True,
        )
    gomod = Path(json.loads(proc.stdout)["GoMod"]).read_text()
    return sorted(set(re.findall(r"^\s*(k8s\.io/[\w.-]+)\s+=>\s+\./staging/", gomod, re.M)))


def _progress(name: str, log: Path, started: float, done: threading.Event) -> None:
    while not done.wait(20):
        lines = log.read_text(errors="replace").count("\n") if log.exists() else 0
        _log(f"  ... {name}: {time.monotonic() - started:.0f}s, {lines} log lines ({log})")


def build(binary: Binary, *, force: bool = False) -> Path:
    """Build `binary` into the cache unless it is already there; return its path."""
    target = binary_path(binary)
    if target.exists() and not force:
        _log(f"{binary.name} {binary.version}: cached at {target}")
        return target
    workdir = cache_dir() / "build" / binary.cache_key / binary.name
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    log = workdir / "build.log"
    env = dict(os.environ, CGO_ENABLED="0", GOFLAGS="-mod=mod -buildvcs=false", GOWORK="off")
    started = time.monotonic()
    _log(f"{binary.name} {binary.version}: building (log {log})")
    done = threading.Event()
    ticker = threading.Thread(target=_progress, args=(binary.name, log, started, done), daemon=True)
    ticker.start()
    try:
        _run(["go", "mod", "init", "twinmq.local/build"], workdir, env, log)
        if binary.kubernetes_staging:
            staging = staging_version(binary.version)
            modules = _staging_replaces(binary.version, env, workdir, log)
            replaces = "".join(f"\t{m} => {m} {staging}\n" for m in modules)
            with (workdir / "go.mod").open("a") as gomod:
                gomod.write(f"\nreplace (\n{replaces})\n")
        _run(["go", "get", f"{binary.module}@{binary.version}"], workdir, env, log)
        if binary.upgrades:
            _run(["go", "get", *binary.upgrades], workdir, env, log)
        tmp = target.with_name(f".{binary.name}.tmp")
        tmp.parent.mkdir(parents=True, exist_ok=True)
        ldflags = " ".join(("-s", "-w", *binary.ldflags))
        cmd = ["nice", "-n", "10", "go", "build", "-v", "-trimpath", "-ldflags", ldflags]
        _run([*cmd, "-o", str(tmp), binary.package], workdir, env, log)
        tmp.replace(target)
    finally:
        done.set()
    _log(f"{binary.name} {binary.version}: built in {time.monotonic() - started:.0f}s -> {target}")
    shutil.rmtree(workdir, ignore_errors=True)
    return target


def needed(mode: str) -> list[Binary]:
    """Return the binaries a cluster with node `mode` runs (the kubelet only for `kubelet`;
    none built on demand only)."""
    return [b for b in BINARIES if b.node_mode in (None, mode) and not b.on_demand]


def main(argv: Sequence[str] | None = None) -> int:
    """Build the named binaries (default: all the cluster's node mode needs) that are
    missing from the cache."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="binaries to build (default: all)")
    parser.add_argument("--force", action="store_true", help="rebuild even if cached")
    args = parser.parse_args(argv)
    known = {b.name: b for b in BINARIES}
    unknown = [n for n in args.names if n not in known]
    if unknown:
        parser.error(f"unknown binaries {unknown}; known: {sorted(known)}")
    if shutil.which("go") is None:
        _log("`go` is not on PATH")
        return 2
    wanted = [known[n] for n in args.names] if args.names else needed(node_mode())
    started = time.monotonic()
    for index, binary in enumerate(wanted, 1):
        _log(f"[{index}/{len(wanted)}] {binary.name}")
        build(binary, force=args.force)
    _log(f"all {len(wanted)} binaries ready in {time.monotonic() - started:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
