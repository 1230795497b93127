"""A throw-away RabbitMQ node (Debian's `rabbitmq-server`) on loopback ports of its own.

Everything it writes lives in one temporary directory: Mnesia, logs, the
Erlang cookie (HOME), config files and the pid file. It has its own epmd on its
own port, so nothing clashes with a RabbitMQ or Erlang node already on the
machine, and it is stopped (SIGTERM, then SIGKILL) and removed afterwards.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from twinmq.testing.waiting import wait_for

RABBITMQ_SERVER = Path("/usr/lib/rabbitmq/bin/rabbitmq-server")
RABBITMQCTL = Path("/usr/lib/rabbitmq/bin/rabbitmqctl")


def free_port(host: str = "127.0.0.1") -> int:
    """An unused TCP port on loopback."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def ensure_installed() -> None:
    """Install Debian's rabbitmq-server if it is missing (needs root; idempotent)."""
    if RABBITMQ_SERVER.exists():
        return
    print("installing Debian's rabbitmq-server ...", flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=False, env=env)
    subprocess.run(
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "rabbitmq-server"],
        check=True,
        env=env,
        stdout=subprocess.DEVNULL,
    )
    if not RABBITMQ_SERVER.exists():
        raise RuntimeError(f"rabbitmq-server installed but {RABBITMQ_SERVER} is missing")


def package_version(name: str) -> str:
    """The installed Debian package version, or '?'."""
    out = subprocess.run(
        ["dpkg-query", "-W", "-f=${Version}", name], capture_output=True, text=True, check=False
    )
    return out.stdout.strip() or "?"


def _port_open(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


@dataclass
class RabbitNode:
    """One RabbitMQ node in a temporary directory."""

    host: str = "127.0.0.1"
    port: int = field(default_factory=free_port)
    dist_port: int = field(default_factory=free_port)
    epmd_port: int = field(default_factory=free_port)
    # Plugins enabled at boot (written to the node's own enabled_plugins file), e.g.
    # ("rabbitmq_federation",): the ones Debian's package ships need no download.
    plugins: tuple[str, ...] = ()
    base: Path | None = None
    script: subprocess.Popen[bytes] | None = None
    epmd: subprocess.Popen[bytes] | None = None

    @property
    def nodename(self) -> str:
        """The Erlang node name (unique per process and port)."""
        return f"twinmq-bench-{os.getpid()}-{self.port}@localhost"

    @property
    def url(self) -> str:
        """AMQP URI for guest on loopback."""
        return f"amqp://guest:guest@{self.host}:{self.port}"

    def _env(self, base: Path) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RABBITMQ_", "ERL_"))}
        env.update(
            HOME=str(base),  # the Erlang cookie goes here, not into ~/.erlang.cookie
            ERL_EPMD_PORT=str(self.epmd_port),
            ERL_EPMD_ADDRESS="127.0.0.1",
            ERL_CRASH_DUMP=str(base / "erl_crash.dump"),  # not into the caller's directory
            RABBITMQ_NODENAME=self.nodename,
            RABBITMQ_NODE_IP_ADDRESS=self.host,
            RABBITMQ_NODE_PORT=str(self.port),
            RABBITMQ_DIST_PORT=str(self.dist_port),
            RABBITMQ_MNESIA_BASE=str(base / "mnesia"),
            RABBITMQ_LOG_BASE=str(base / "log"),
            RABBITMQ_PID_FILE=str(base / "rabbit.pid"),
            RABBITMQ_CONF_ENV_FILE=str(base / "rabbitmq-env.conf"),
            RABBITMQ_CONFIG_FILE=str(base / "rabbitmq.conf"),
            RABBITMQ_ADVANCED_CONFIG_FILE=str(base / "advanced.config"),
            RABBITMQ_ENABLED_PLUGINS_FILE=str(base / "enabled_plugins"),
            RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}",
        )
        return env

    def start(self, timeout: float = 90.0, parent: Path | None = None) -> RabbitNode:
        """Start epmd and the node; return once the AMQP port answers.

        A free port is only free until someone binds it: a node that finds one of its
        ports taken meanwhile (`dist_port_already_used`, `eaddrinuse`) is started again on
        new ports, up to three times."""
        for attempt in range(3):
            try:
                return self._start_once(timeout, parent)
            except RuntimeError as exc:
                lost_race = "already_used" in str(exc) or "eaddrinuse" in str(exc).lower()
                if not lost_race or attempt == 2:
                    raise
                self.port, self.dist_port, self.epmd_port = free_port(), free_port(), free_port()
        raise AssertionError("unreachable")

    def _start_once(self, timeout: float, parent: Path | None) -> RabbitNode:
        ensure_installed()
        base = Path(tempfile.mkdtemp(prefix="twinmq-bench-rabbit-", dir=parent))
        self.base = base
        (base / "rabbitmq-env.conf").write_text("")
        (base / "rabbitmq.conf").write_text("loopback_users.guest = true\n")
        (base / "advanced.config").write_text("[].\n")
        (base / "enabled_plugins").write_text(f"[{','.join(self.plugins)}].\n")
        log = open(base / "server.out", "wb")  # noqa: SIM115 - handed to the children
        self.epmd = subprocess.Popen(
            ["epmd", "-port", str(self.epmd_port), "-address", "127.0.0.1"],
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
        self.script = subprocess.Popen(
            [str(RABBITMQ_SERVER)],
            env=self._env(base),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
        log.close()
        script = self.script

        def up() -> bool:
            if script.poll() is not None:
                out = (base / "server.out").read_text(errors="replace")[-3000:]
                self.stop()
                raise RuntimeError(f"rabbitmq-server exited:\n{out}")
            return bool(self.beam_pid()) and _port_open(self.host, self.port)

        try:
            wait_for("the RabbitMQ node", up, timeout, interval=0.25)
        except TimeoutError:
            self.stop()
            raise
        return self

    def ctl(self, *args: str, timeout: float = 120.0) -> str:
        """Run `rabbitmqctl <args>` against this node (its name, cookie and epmd); stdout."""
        if self.base is None:
            raise RuntimeError("the node is not started")
        out = subprocess.run(
            [str(RABBITMQCTL), "-n", self.nodename, *args],
            env=self._env(self.base),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if out.returncode != 0:
            raise RuntimeError(f"rabbitmqctl {' '.join(args)}: {out.stdout}{out.stderr}")
        return out.stdout

    def beam_pid(self) -> int | None:
        """The pid of the node's Erlang VM (beam.smp), once it wrote its pid file."""
        if self.base is None:
            return None
        try:
            return int((self.base / "rabbit.pid").read_text().strip())
        except (OSError, ValueError):
            return None

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the node (the start script forwards SIGTERM), then epmd; remove the files."""
        beam = self.beam_pid()
        if self.script is not None and self.script.poll() is None:
            self.script.send_signal(signal.SIGTERM)
            try:
                self.script.wait(timeout)
            except subprocess.TimeoutExpired:
                if beam:
                    _kill(beam)
                self.script.kill()
                self.script.wait()
        if beam:
            with contextlib.suppress(TimeoutError):
                wait_for("beam.smp to exit", lambda: not _alive(beam), timeout)
            if _alive(beam):
                _kill(beam)
        if self.epmd is not None and self.epmd.poll() is None:
            self.epmd.terminate()
            try:
                self.epmd.wait(5)
            except subprocess.TimeoutExpired:
                self.epmd.kill()
                self.epmd.wait()
        if self.base is not None:
            shutil.rmtree(self.base, ignore_errors=True)
            self.base = None

    def __enter__(self) -> RabbitNode:
        return self.start() if self.script is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child of someone else's still counts as gone once it is not running.
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
