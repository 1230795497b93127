"""Build TwinMQ's images without a container engine daemon (`make image`, `make image-audit`).

    .venv/bin/python image/build.py [--target broker|audit] [--force]

The Containerfile at the top of the repository, run by buildah (vfs storage, chroot
isolation) on Debian bookworm roots made by mmdebstrap; the same file builds with
`docker build` or `podman build`. Steps, each cached by the content of its inputs:

1. the Debian roots (runtime, build; the audit's adds a JRE): `mmdebstrap` of the pinned
   suite, imported into buildah's store as `localhost/twinmq-base-<name>:<key>`;
2. the wheels of image/*.lock, downloaded with the host's pip (hash-checked) into a folder
   the build mounts: the build itself never reaches PyPI;
3. `buildah bud`, then `buildah push` to an OCI archive `.cache/image/<image>-<version>.tar`
   (reference `docker.io/twinmq/<image>:<version>`, the chart's default image), with a
   CycloneDX SBOM beside it (`.cdx.json`: Debian packages and wheels with versions).

Nothing is rebuilt when the hash of every input (Containerfile, build context, locks,
bases) matches the one recorded beside the archive. Output: one JSON line describing the
image (archive, SBOM, sizes, seconds).
"""

from __future__ import annotations

import argparse
import contextlib
import email.parser
import fcntl
import hashlib
import json
import os
import re
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lock import SDISTS

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("TWINMQ_IMAGE_CACHE", ROOT / ".cache" / "image"))
SUITE = "bookworm"
MIRROR = os.environ.get("TWINMQ_DEBIAN_MIRROR", "http://deb.debian.org/debian")
SECURITY_MIRROR = os.environ.get(
    "TWINMQ_DEBIAN_SECURITY_MIRROR", "http://deb.debian.org/debian-security"
)
"""Debian's mirrors. No snapshot by default (snapshot.debian.org is unreachable from the
build machines); set both to snapshot.debian.org/archive/... URLs to pin a date."""

# libstdc++6: pyarrow's C++ libraries (manylinux wheels do not carry it).
RUNTIME_PACKAGES = ["python3", "tini", "ca-certificates", "libstdc++6"]
BASES = {
    "runtime": RUNTIME_PACKAGES,
    "build": ["python3", "python3-venv"],
    "audit": [*RUNTIME_PACKAGES, "openjdk-17-jre-headless"],
}
"""The Debian roots and their packages (no recommends): the Containerfile's stages install
the same ones when a base lacks them (image/debian-packages.sh)."""
BASE_HOOKS = {
    # The JRE's postinst links its manual page into /usr/share/man/man1, which the
    # path-exclude of MMDEBSTRAP_OPTIONS never creates: without it dpkg fails (exit 25).
    "audit": ['--setup-hook=mkdir -p "$1"/usr/share/man/man1'],
}
"""Extra mmdebstrap options of one root (part of its cache key)."""

IMAGES = {"broker": "twinmq", "audit": "twinmq-audit"}
"""Containerfile target -> image name."""
TARGET_BASES = {"broker": ["runtime", "build"], "audit": ["audit", "build"]}
BUILD_ARGS = {"runtime": "BASE", "build": "BUILD_BASE", "audit": "AUDIT_BASE"}
LOCKS = {
    "broker": ["requirements-build.lock", "requirements.lock"],
    "audit": ["requirements-build.lock", "requirements.lock", "requirements-audit.lock"],
}
LOCK_LINE = re.compile(r"^(\S+==\S+) \\\n\s+--hash=sha256:([0-9a-f]+)", re.M)
"""A pinned requirement of a lock file and its hash."""
IGNORED_PARTS = {"__pycache__", "tests"}
"""Folders .containerignore keeps out of the context (`**/__pycache__`, `**/tests`)."""

MMDEBSTRAP_OPTIONS = [
    "--variant=essential",
    "--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr",
    # No manuals, locales or documentation but the copyright files.
    "--dpkgopt=path-exclude=/usr/share/man/*",
    "--dpkgopt=path-exclude=/usr/share/info/*",
    "--dpkgopt=path-exclude=/usr/share/locale/*",
    "--dpkgopt=path-exclude=/usr/share/doc/*",
    "--dpkgopt=path-include=/usr/share/doc/*/copyright",
]


def digest(*parts: str | bytes) -> str:
    """A short sha256 of the parts, in order."""
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode() if isinstance(part, str) else part)
        h.update(b"\0")
    return h.hexdigest()[:16]


def run(*cmd: str, quiet: bool = False) -> str:
    """Run a command, fail loudly; its standard output."""
    result = subprocess.run(cmd, check=False, text=True, capture_output=True)
    if result.returncode:
        sys.stderr.write(result.stdout[-4000:] + result.stderr[-4000:])
        raise SystemExit(f"image: {' '.join(cmd[:4])}... failed ({result.returncode})")
    if not quiet and result.stderr.strip():
        sys.stderr.write(result.stderr[-2000:])
    return result.stdout


def buildah(*args: str) -> list[str]:
    """A buildah command line on the project's own store (vfs: no overlay mounts needed)."""
    return [
        "buildah", "--root", str(CACHE / "storage"), "--runroot", str(CACHE / "run"),
        "--storage-driver", "vfs", *args,
    ]  # fmt: skip


def version() -> str:
    """The project's version (pyproject.toml): the images' tag."""
    project: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return str(project["version"])


# -- step 1: the Debian roots -------------------------------------------------------------


def sources() -> list[str]:
    """The apt sources of the roots: the suite, its updates, its security updates."""
    return [
        f"deb {MIRROR} {SUITE} main",
        f"deb {MIRROR} {SUITE}-updates main",
        f"deb {SECURITY_MIRROR} {SUITE}-security main",
    ]


def base_key(name: str) -> str:
    """What a root is made of: suite, mirrors, packages, mmdebstrap and its options."""
    tool = run("mmdebstrap", "--version").strip()
    extra = BASE_HOOKS.get(name, [])
    return digest(SUITE, *sources(), *BASES[name], *MMDEBSTRAP_OPTIONS, *extra, tool)


def base_image(name: str) -> str:
    """The named Debian root as an image in buildah's store, made when missing."""
    key = base_key(name)
    ref = f"localhost/twinmq-base-{name}:{key}"
    if subprocess.run(buildah("inspect", ref), capture_output=True).returncode == 0:
        return ref
    rootfs = CACHE / f"rootfs-{name}-{key}.tar"
    if not rootfs.exists():
        debs = CACHE / "debs"  # downloaded packages, kept for the next root
        debs.mkdir(parents=True, exist_ok=True)
        partial = rootfs.with_suffix(".partial.tar")
        run(
            "mmdebstrap", *MMDEBSTRAP_OPTIONS, *BASE_HOOKS.get(name, []),
            f"--include={','.join(BASES[name])}",
            "--skip=download/empty", "--skip=essential/unlink",
            '--setup-hook=mkdir -p "$1"/var/cache/apt/archives/',
            f"--setup-hook=sync-in {debs} /var/cache/apt/archives/",
            f"--customize-hook=sync-out /var/cache/apt/archives {debs}",
            '--customize-hook=rm -f "$1"/var/cache/apt/archives/*.deb',
            SUITE, str(partial), *sources(),
            quiet=True,
        )  # fmt: skip
        partial.rename(rootfs)
    container = run(*buildah("from", "scratch")).strip()
    try:
        run(*buildah("add", container, str(rootfs), "/"))
        run(*buildah("commit", "-q", "--timestamp", "0", container, ref))
    finally:
        run(*buildah("rm", container))
    rootfs.unlink()  # the image in the store is the cache now
    return ref


# -- step 2: the wheels --------------------------------------------------------------------


def download_wheels(target: str) -> Path:
    """The locked wheels of a target in CACHE/wheels (pip reuses the files already there)."""
    wheels = CACHE / "wheels"
    for lock in LOCKS[target]:
        run(
            sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
            *[f"--no-binary={n}" for n in SDISTS], "--require-hashes", "-d", str(wheels),
            "-r", str(ROOT / "image" / lock),
        )  # fmt: skip
    return wheels


# -- step 3: the build ---------------------------------------------------------------------


def context_files() -> Iterator[Path]:
    """The files of the build context: the `!` lines (globs) of .containerignore, less what
    its `**/` lines exclude. (A superset of buildah's view is harmless here: it only widens the
    cache key.)"""
    for line in (ROOT / ".containerignore").read_text().splitlines():
        if not line.startswith("!"):
            continue
        for top in sorted(ROOT.glob(line[1:])):
            for path in [top] if top.is_file() else sorted(top.rglob("*")):
                parts = set(path.relative_to(ROOT).parts)
                if path.is_file() and not parts & IGNORED_PARTS and path.suffix != ".pyc":
                    yield path


def inputs_key(target: str, bases: dict[str, str]) -> str:
    """The hash of everything the image is built from."""
    files: list[str | bytes] = []
    for path in [ROOT / "Containerfile", ROOT / ".containerignore", *context_files()]:
        files += [str(path.relative_to(ROOT)), path.read_bytes()]
    return digest(target, version(), *sorted(bases.values()), *files)


def source_date_epoch() -> str:
    """The last commit's time: the images' creation time (reproducible metadata)."""
    out = subprocess.run(
        ["git", "-C", str(ROOT), "log", "-1", "--format=%ct"], capture_output=True, text=True
    )
    return out.stdout.strip() or "0"


@contextlib.contextmanager
def exclusive() -> Iterator[None]:
    """One build at a time per cache: `make test` builds the images in the background while
    tests/test_image.py asks for the same archive, and both use one buildah store."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def build(target: str, force: bool = False) -> dict[str, Any]:
    """Build (or find up to date) the target's image; a description of it."""
    with exclusive():
        return _build(target, force)


def _build(target: str, force: bool) -> dict[str, Any]:
    started = time.monotonic()
    name, tag = IMAGES[target], version()
    archive = CACHE / f"{name}-{tag}.tar"
    sbom = archive.with_suffix(".cdx.json")
    stamp = archive.with_suffix(".inputs")
    bases = {b: base_image(b) for b in TARGET_BASES[target]}
    key = inputs_key(target, bases)
    reference = f"docker.io/twinmq/{name}:{tag}"
    fresh = force or not (archive.exists() and sbom.exists() and stamp.exists())
    if fresh or stamp.read_text().strip() != key:
        stamp.unlink(missing_ok=True)
        wheels = download_wheels(target)
        args = [f"--build-arg={BUILD_ARGS[b]}={ref}" for b, ref in bases.items()]
        run(
            *buildah(
                "bud", "--isolation", "chroot", "--pull=never",
                "--target", target, "--timestamp", source_date_epoch(),
                f"--volume={wheels}:/wheels:ro", "--build-arg=WHEELS=/wheels", *args,
                "-t", f"localhost/{name}:{tag}", "-t", reference,
                "-f", str(ROOT / "Containerfile"), str(ROOT),
            ),
            quiet=True,
        )  # fmt: skip
        archive.unlink(missing_ok=True)
        run(*buildah("push", "-q", reference, f"oci-archive:{archive}:{reference}"))
        sbom.write_text(json.dumps(make_sbom(reference, name, tag), indent=1) + "\n")
        # The previous build's image, untagged now: vfs keeps a full copy of every layer.
        subprocess.run(buildah("rmi", "--prune"), capture_output=True)
        stamp.write_text(key + "\n")
        built = True
    else:
        built = False
    return {
        "image": reference,
        "archive": str(archive),
        "sbom": str(sbom),
        "built": built,
        "archive_mb": round(archive.stat().st_size / 1e6, 1),
        "rootfs_mb": float(json.loads(sbom.read_text())["metadata"]["properties"][0]["value"]),
        "seconds": round(time.monotonic() - started, 1),
    }


# -- the SBOM ------------------------------------------------------------------------------


@contextlib.contextmanager
def mounted(reference: str) -> Iterator[Path]:
    """The image's root filesystem, mounted read-write from a throw-away container."""
    container = run(*buildah("from", "--pull=never", reference)).strip()
    try:
        yield Path(run(*buildah("mount", container)).strip())
    finally:
        subprocess.run(buildah("umount", container), capture_output=True)
        run(*buildah("rm", container))


def debian_packages(root: Path) -> list[dict[str, Any]]:
    """The image's Debian packages (dpkg's status file) as CycloneDX components."""
    components = []
    parser = email.parser.Parser()
    for stanza in (root / "var/lib/dpkg/status").read_text().split("\n\n"):
        fields = parser.parsestr(stanza)
        if not fields["Package"] or "installed" not in (fields["Status"] or ""):
            continue
        name, ver, arch = fields["Package"], fields["Version"], fields["Architecture"]
        components.append(
            {
                "type": "library" if name.startswith("lib") else "application",
                "name": name,
                "version": ver,
                "purl": f"pkg:deb/debian/{name}@{ver}?arch={arch}&distro=debian-12",
            }
        )
    return components


def python_packages(root: Path) -> list[dict[str, Any]]:
    """The image's Python distributions (their METADATA), with the locks' wheel hashes."""
    hashes = {}
    for lock in sorted((ROOT / "image").glob("requirements*.lock")):
        for pin, sha in LOCK_LINE.findall(lock.read_text()):
            hashes[pin.lower()] = sha
    components = []
    for meta in sorted(root.glob("opt/twinmq/lib/python3*/site-packages/*.dist-info/METADATA")):
        fields = email.parser.Parser().parsestr(meta.read_text(errors="replace"))
        name, ver = fields["Name"], fields["Version"]
        normalized = name.lower().replace("_", "-").replace(".", "-")
        component: dict[str, Any] = {
            "type": "library",
            "name": name,
            "version": ver,
            "purl": f"pkg:pypi/{normalized}@{ver}",
        }
        sha = hashes.get(f"{normalized}=={ver}".lower())
        if sha:
            component["hashes"] = [{"alg": "SHA-256", "content": sha}]
        components.append(component)
    return components


def tree_mb(root: Path) -> float:
    """The size of a file tree (regular files, hard links counted once), in MB."""
    seen, total = set(), 0
    for dirpath, _, names in os.walk(root):
        for n in names:
            st = os.lstat(os.path.join(dirpath, n))
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return round(total / 1e6, 1)


def make_sbom(reference: str, name: str, tag: str) -> dict[str, Any]:
    """A CycloneDX 1.5 SBOM of the image, read from its own files (dpkg, dist-info)."""
    with mounted(reference) as root:
        components = debian_packages(root) + python_packages(root)
        size = tree_mb(root)
    return {
        "bomFormat": "CycloneDX",
        "specVersion": "1.5",
        "version": 1,
        "metadata": {
            "component": {"type": "container", "name": name, "version": tag},
            "properties": [
                {"name": "twinmq:rootfs-mb", "value": str(size)},
                {"name": "twinmq:debian-suite", "value": SUITE},
                {"name": "twinmq:debian-mirror", "value": MIRROR},
            ],
        },
        "components": components,
    }


def main() -> None:
    """Command line: build one target, print its description as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", choices=sorted(IMAGES), default="broker")
    parser.add_argument("--force", action="store_true", help="rebuild even when up to date")
    args = parser.parse_args()
    print(json.dumps(build(args.target, args.force)))


if __name__ == "__main__":
    main()
