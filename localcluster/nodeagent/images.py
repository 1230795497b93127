"""Which images and commands the process-backed node can run (pure; no I/O but `exists`)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

PROJECT_IMAGE = "twinmq/twinmq"
"""The project's image, any tag, optionally behind a registry host (docker.io/twinmq/twinmq)."""
AUDIT_IMAGE = "twinmq/twinmq-audit"
"""The Spark audit's image (`make image-audit`: the broker image plus a JRE and PySpark). The
checkout's venv has PySpark and the audit's console scripts, so it maps there as well."""
PROJECT_IMAGES = (PROJECT_IMAGE, AUDIT_IMAGE)

EXTRA_COMMANDS = ("python", "python3", "sh", "sleep", "true", "false")
"""Besides the project's console scripts (`twinmq-*`), what the project's image also carries."""


class ImageError(Exception):
    """The image cannot be "pulled": the pod waits with reason ErrImagePull."""


class CommandError(Exception):
    """The container's command is not in the image: the container fails to start."""


def image_repository(image: str) -> str:
    """Return `image` without tag, digest and the docker.io / library prefixes."""
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    if ":" in last:
        name = name[: len(name) - len(last)] + last.split(":", 1)[0]
    for prefix in ("docker.io/", "index.docker.io/", "registry-1.docker.io/"):
        if name.startswith(prefix):
            name = name[len(prefix) :]
    return name


def check_image(image: str) -> None:
    """Raise ImageError unless `image` is one of the project's images."""
    if image_repository(image) not in PROJECT_IMAGES:
        raise ImageError(
            f'image "{image}" is not available on the process-backed test node '
            f"(it runs only {PROJECT_IMAGE}:<tag> and {AUDIT_IMAGE}:<tag>, whose commands "
            "are this checkout's console scripts)"
        )


@dataclass(frozen=True)
class CommandMap:
    """Maps a container command to an executable in the venv that runs the node agent."""

    bin_dir: Path
    exists: Callable[[Path], bool] = os.path.exists

    @classmethod
    def for_current_venv(cls) -> CommandMap:
        """Map commands to the scripts beside this Python interpreter."""
        import sys

        return cls(Path(sys.executable).parent)

    def resolve(self, command: Sequence[str], args: Sequence[str]) -> list[str]:
        """Return the argv to execute for a container's `command` and `args`."""
        argv = [*command, *args]
        if not argv:
            raise CommandError("the container has no command: the image has no entrypoint")
        name = Path(argv[0]).name
        allowed = name.startswith("twinmq-") or name in EXTRA_COMMANDS
        if name in ("sh", "sleep", "true", "false"):
            for folder in ("/bin", "/usr/bin"):
                candidate = Path(folder) / name
                if self.exists(candidate):
                    return [str(candidate), *argv[1:]]
        candidate = self.bin_dir / name
        if allowed and self.exists(candidate):
            return [str(candidate), *argv[1:]]
        raise CommandError(
            f'exec: "{argv[0]}": executable file not found in the project image '
            f"(console scripts in {self.bin_dir})"
        )
