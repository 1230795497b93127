"""Build the krew package of `kubectl twinmq` (`make krew-package`, docs/kubectl-plugin.md).

    .venv/bin/python plugins/build.py [--out dist/krew] [--uri-base URL]

The plugin is Python (cli/kubectl.py) and krew installs archives, not Python packages, so
the archive carries everything it runs: `lib/` holds the plugin's modules from this
checkout and its dependencies (the Kubernetes client, pydantic; versions from
constraints.txt, installed by pip for this platform and this Python), and the executable
`kubectl-twinmq` is a launcher that runs them with that Python version. krew links it onto
PATH as `kubectl-twinmq`, so `kubectl twinmq ...` works as after `pip install twinmq`.

Output: `<out>/kubectl-twinmq_<version>_<os>_<arch>.tar.gz` (deterministic: sorted
entries, fixed times and owners) and `<out>/twinmq.yaml`, the krew manifest of
plugins/twinmq.yaml with this archive as its platform (uri under --uri-base, sha256).
Only the build machine's platform and Python minor version are built (pydantic-core is
compiled): one archive per (os, arch) built where it runs.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
TEMPLATE = REPO / "plugins" / "twinmq.yaml"
DEPENDENCIES = ("kubernetes", "pydantic", "pyyaml")
"""What cli/kubectl.py imports beyond the standard library (tests/test_krew.py runs the
built plugin from an empty environment: a missing one fails it)."""
MODULES = {
    "twinmq/cli/__init__.py": "cli/__init__.py",
    "twinmq/cli/kubectl.py": "cli/kubectl.py",
    "twinmq/broker/__init__.py": "broker/__init__.py",
    "twinmq/broker/names.py": "broker/names.py",
    "twinmq/operator/models.py": "operator/models.py",
    "twinmq/operator/ownership.py": "operator/ownership.py",
}
"""The plugin's modules in the archive's lib/ -> their source in the checkout."""
ARCH = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}
LAUNCHER = """#!/bin/sh
# kubectl twinmq (krew package): the plugin and its dependencies are in lib/ beside this
# file, built for Python {major}.{minor}.
here=$(dirname "$(readlink -f "$0")")
# -S: no site-packages of that Python, only lib/ (PYTHONPATH).
PYTHONPATH="$here/lib" exec python{major}.{minor} -S -m twinmq.cli.kubectl "$@"
"""


def project_version() -> str:
    """The package version (pyproject.toml); the plugin's is `v` + it."""
    with (REPO / "pyproject.toml").open("rb") as file:
        return str(tomllib.load(file)["project"]["version"])


def platform_labels() -> dict[str, str]:
    """krew's selector labels of this machine."""
    return {"os": sys.platform, "arch": ARCH[platform.machine()]}


def stage(root: Path) -> None:
    """Lay out the archive's files under `root`: the launcher, lib/ and the licence."""
    lib = root / "lib"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-compile", "--target",
         str(lib), "-c", str(REPO / "constraints.txt"), *DEPENDENCIES],
        check=True,
    )  # fmt: skip
    shutil.rmtree(lib / "bin", ignore_errors=True)  # console scripts of the dependencies
    for target, source in MODULES.items():
        (lib / target).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(REPO / source, lib / target)
    launcher = root / "kubectl-twinmq"
    launcher.write_text(LAUNCHER.format(major=sys.version_info.major, minor=sys.version_info.minor))
    launcher.chmod(0o755)


def deterministic_tar(root: Path, archive: Path) -> None:
    """A gzipped tar of `root`'s contents: sorted, mtime 0, owner root, modes kept."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(root.rglob("*")):
            info = tar.gettarinfo(str(path), arcname=str(path.relative_to(root)))
            info.mtime = 0
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            if path.is_file():
                with path.open("rb") as file:
                    tar.addfile(info, file)
            else:
                tar.addfile(info)
    with archive.open("wb") as out, gzip.GzipFile(fileobj=out, mode="wb", mtime=0) as gz:
        gz.write(buffer.getvalue())


def manifest(archive: Path, uri_base: str, labels: dict[str, str]) -> dict[str, Any]:
    """plugins/twinmq.yaml with the version of this checkout and `archive` as its platform."""
    plugin: dict[str, Any] = yaml.safe_load(TEMPLATE.read_text())
    plugin["spec"]["version"] = "v" + project_version()
    plugin["spec"]["platforms"] = [
        {
            "selector": {"matchLabels": labels},
            "uri": f"{uri_base.rstrip('/')}/{archive.name}",
            "sha256": hashlib.sha256(archive.read_bytes()).hexdigest(),
            "bin": "kubectl-twinmq",
        }
    ]
    return plugin


def build(out: Path, uri_base: str) -> tuple[Path, Path]:
    """The archive and the manifest, in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    labels = platform_labels()
    archive = out / f"kubectl-twinmq_{project_version()}_{labels['os']}_{labels['arch']}.tar.gz"
    with tempfile.TemporaryDirectory() as tmp:
        stage(Path(tmp))
        deterministic_tar(Path(tmp), archive)
    manifest_path = out / "twinmq.yaml"
    manifest_path.write_text(yaml.safe_dump(manifest(archive, uri_base, labels), sort_keys=False))
    return archive, manifest_path


def main() -> None:
    """Build, print the archive and manifest paths."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "dist" / "krew")
    parser.add_argument(
        "--uri-base",
        default="https://github.com/twinmq/twinmq/releases/download/v" + project_version(),
        help="where the archive will be downloaded from (a release's assets)",
    )
    args = parser.parse_args()
    archive, manifest_path = build(args.out, args.uri_base)
    print(archive)
    print(manifest_path)


if __name__ == "__main__":
    main()
