"""One container's shim: mounts its volumes, runs its command, records how it ended.

Started by the runtime as ``ip netns exec <netns> python -m ...shim`` in its own
session, so it lives in the pod's network namespace and in a private mount
namespace (where /etc/resolv.conf and /etc/hosts are the pod's), and it
survives the node agent: a restarted agent adopts running containers by
their pid files and reads the exit file of those that ended meanwhile.
The container runs in its own process group (pgid == its pid), which is what
the agent and the fault tools signal.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _stat_start(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]


def mount_order(specs: list[str]) -> list[str]:
    """The mounts (SRC:DST[:ro]) in an order where none hides another's source: a mount
    over a folder that holds another mount's source (the pod's emptyDir over /tmp, when the
    node's own folders live under /tmp) comes after it."""

    def shadows(spec: str) -> bool:
        dst = Path(spec.split(":")[1])
        return any(
            Path(other.split(":")[0]).is_relative_to(dst) for other in specs if other != spec
        )

    return sorted(specs, key=shadows)  # stable: the others keep their order


def hidden_by_mounts(specs: list[str], keep: list[Path]) -> list[Path]:
    """The folders of `keep` (the checkout, its venv, this container's state) that a mount
    would hide, outermost first: a pod's emptyDir over /tmp hides a checkout under /tmp,
    and with it the commands and the state folder the shim writes to."""
    targets = [Path(spec.split(":")[1]) for spec in specs]
    hidden: list[Path] = []
    for folder in sorted({k.resolve() for k in keep}, key=lambda k: len(k.parts)):
        if any(folder.is_relative_to(h) for h in hidden):
            continue  # already kept with its parent
        if any(folder.is_relative_to(t) for t in targets):
            hidden.append(folder)
    return hidden


def main() -> int:
    """Entry point: see the module docstring."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--state", required=True, type=Path, help="the container's folder")
    parser.add_argument("--log", required=True, type=Path)
    parser.add_argument("--cwd", default="/")
    parser.add_argument("--hostname", default="")
    parser.add_argument(
        "--record-created", type=Path, help="file listing host folders made as mount points"
    )
    parser.add_argument("--mount", action="append", default=[], help="SRC:DST[:ro]")
    parser.add_argument("argv", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    exit_file = args.state / "exit"
    if args.hostname:
        socket.sethostname(args.hostname)  # in the UTS namespace `unshare --uts` gave us
    # Held open across the mounts (O_PATH), then bound back in place over them.
    keep = [Path(__file__).resolve().parents[2], Path(sys.prefix), args.state, args.log.parent]
    held = {folder: os.open(folder, os.O_PATH) for folder in hidden_by_mounts(args.mount, keep)}
    for spec in mount_order(args.mount):
        src, dst, *mode = spec.split(":")
        _record_created(Path(dst), args.record_created)
        if Path(src).is_dir():
            Path(dst).mkdir(parents=True, exist_ok=True)
        else:
            Path(dst).parent.mkdir(parents=True, exist_ok=True)
            Path(dst).touch(exist_ok=True)
        subprocess.run(["mount", "--bind", src, dst], check=True)
        if mode == ["ro"]:
            subprocess.run(["mount", "-o", "remount,bind,ro", dst], check=True)
    for folder, fd in held.items():
        folder.mkdir(parents=True, exist_ok=True)  # inside the mount that hid it
        # --no-canonicalize: resolved as a path, the fd's link names the hiding folder.
        source = f"/proc/{os.getpid()}/fd/{fd}"
        subprocess.run(["mount", "--bind", "--no-canonicalize", source, str(folder)], check=True)
        os.close(fd)
    args.log.parent.mkdir(parents=True, exist_ok=True)
    with args.log.open("ab") as log:
        try:
            child = subprocess.Popen(
                argv,
                cwd=args.cwd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_default_signals,
            )
        except OSError as error:
            _write_atomic(
                exit_file,
                json.dumps(
                    {
                        "code": 128,
                        "reason": "StartError",
                        "message": str(error),
                        "finished": time.time(),
                    }
                ),
            )
            return 0
        _write_atomic(args.state / "pid", f"{child.pid} {_stat_start(child.pid)}\n")
        code = child.wait()
    if code < 0:
        result: dict[str, object] = {"code": 128 - code, "signal": -code, "reason": "Error"}
    else:
        result = {"code": code, "reason": "Completed" if code == 0 else "Error"}
    result["finished"] = time.time()
    _write_atomic(exit_file, json.dumps(result))
    return 0


def _record_created(target: Path, record: Path | None) -> None:
    """Note the top-most folder that making `target` will create, so cluster-down removes it."""
    if record is None:
        return
    top = None
    for folder in (target.parent, *target.parent.parents):
        if folder.exists():
            break
        top = folder
    if not target.exists() and top is None:
        top = target
    if top is not None:
        with record.open("a") as out:
            out.write(f"{top}\n")


def _default_signals() -> None:
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


if __name__ == "__main__":
    sys.exit(main())
