"""The krew package of `kubectl twinmq` (plugins/): the manifest follows krew's rules and
the archive installs and runs as krew would install it.

krew's own validator (sigs.k8s.io/krew, `validate-krew-manifest`) is not available as a
module here, so `krew_errors` states its rules (internal/index/validation, and the
manifest file checks of validate-krew-manifest: file name, unknown fields, overlapping
platforms); `test_the_rules_refuse_what_krew_refuses` proves each one can fail.
"""

from __future__ import annotations

import copy
import hashlib
import os
import re
import subprocess
import sys
import tarfile
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
TEMPLATE = REPO / "plugins" / "twinmq.yaml"
sys.path.insert(0, str(REPO / "plugins"))
import build as krew_build  # noqa: E402  (plugins/build.py is a script, not a package)

Obj = dict[str, Any]

API_VERSION = "krew.googlecontainertools.github.com/v1alpha2"
WINDOWS_RESERVED = {"CON", "PRN", "AUX", "NUL"} | {
    f"{p}{n}" for p in ("COM", "LPT") for n in range(1, 10)
}
SEMVER = re.compile(
    r"^v(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"  # vMAJOR.MINOR.PATCH
    r"(-[0-9A-Za-z.-]+)?(\+[0-9A-Za-z.-]+)?$"  # -prerelease, +build
)
KNOWN_PLATFORMS = [
    (os_, arch)
    for os_ in ("linux", "darwin", "windows")
    for arch in ("amd64", "arm64", "386", "arm")
]
# The fields krew's types have (it reads manifests strictly: any other key is an error).
FIELDS = {
    "": {"apiVersion", "kind", "metadata", "spec"},
    "metadata": {"name", "namespace", "labels", "annotations", "creationTimestamp"},
    "spec": {"version", "shortDescription", "description", "caveats", "homepage", "platforms"},
    "platform": {"uri", "sha256", "selector", "files", "bin"},
    "file": {"from", "to"},
    "selector": {"matchLabels", "matchExpressions"},
}


def unknown(obj: Obj, kind: str) -> list[str]:
    """Keys of `obj` krew's type `kind` does not have."""
    return [f"unknown field {key!r} in {kind or 'the manifest'}" for key in set(obj) - FIELDS[kind]]


def selects(selector: Obj, os_: str, arch: str) -> bool:
    """Whether a platform selector matches a machine (matchLabels and In/NotIn)."""
    labels = {"os": os_, "arch": arch}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expression in selector.get("matchExpressions") or []:
        value, values = labels.get(expression["key"]), expression.get("values", [])
        if (expression["operator"] == "In") != (value in values):
            return False
    return True


def platform_errors(platform: Obj) -> list[str]:
    """krew's rules for one platform."""
    errors = unknown(platform, "platform")
    if not platform.get("uri"):
        errors.append("`uri` has to be set")
    if not re.fullmatch(r"[a-f0-9]{64}", platform.get("sha256") or ""):
        errors.append("`sha256` must be 64 lower-case hex digits")
    if not platform.get("bin"):
        errors.append("`bin` has to be set")
    files = platform.get("files")
    if files is not None:
        if not files:
            errors.append("`files` has to be unspecified or non-empty")
        for operation in files:
            errors += unknown(operation, "file")
            if not operation.get("from") or not operation.get("to"):
                errors.append("`files` entries need `from` and `to`")
    selector = platform.get("selector")
    if not selector or (not selector.get("matchLabels") and not selector.get("matchExpressions")):
        errors.append("an empty or missing selector is not supported")
    else:
        errors += unknown(selector, "selector")
        keys = list(selector.get("matchLabels") or {})
        keys += [e["key"] for e in selector.get("matchExpressions") or []]
        errors += [
            f"selector key {key!r} not supported" for key in keys if key not in ("os", "arch")
        ]
    return errors


def krew_errors(plugin: Obj, file_name: str) -> list[str]:
    """Why krew would refuse the manifest in a file called `file_name` (empty: it would not)."""
    errors = unknown(plugin, "")
    if plugin.get("apiVersion") != API_VERSION:
        errors.append(f"apiVersion {plugin.get('apiVersion')!r} is not supported")
    if plugin.get("kind") != "Plugin":
        errors.append(f"kind {plugin.get('kind')!r}: only 'Plugin' is supported")
    metadata, spec = plugin.get("metadata") or {}, plugin.get("spec") or {}
    errors += unknown(metadata, "metadata") + unknown(spec, "spec")
    name = metadata.get("name", "")
    if not re.fullmatch(r"[\w-]+", name) or name.upper() in WINDOWS_RESERVED:
        errors.append(f"the plugin name {name!r} is not allowed")
    if file_name != f"{name}.yaml":
        errors.append(f"the file of plugin {name!r} must be named {name}.yaml")
    short = spec.get("shortDescription") or ""
    if not short or "\n" in short or "\r" in short:
        errors.append("one line of short description is required")
    if not SEMVER.match(spec.get("version") or ""):
        errors.append(f"version {spec.get('version')!r} is not a semantic version with a v")
    platforms = spec.get("platforms") or []
    if not platforms:
        errors.append("should have a platform specified")
    for platform in platforms:
        errors += platform_errors(platform)
    for os_, arch in KNOWN_PLATFORMS:
        matching = [p for p in platforms if p.get("selector") and selects(p["selector"], os_, arch)]
        if len(matching) > 1:
            errors.append(f"{len(matching)} platforms match {os_}/{arch}")
    return errors


def with_platform(plugin: Obj) -> Obj:
    """The template with one well-formed platform (the template leaves them to the build)."""
    plugin = copy.deepcopy(plugin)
    plugin["spec"]["platforms"] = [
        {
            "selector": {"matchLabels": {"os": "linux", "arch": "amd64"}},
            "uri": "https://example.org/kubectl-twinmq.tar.gz",
            "sha256": "0" * 64,
            "bin": "kubectl-twinmq",
        }
    ]
    return plugin


def template() -> Obj:
    """plugins/twinmq.yaml."""
    plugin: Obj = yaml.safe_load(TEMPLATE.read_text())
    return plugin


def test_the_template_follows_krews_rules_and_the_projects_version() -> None:
    assert krew_errors(with_platform(template()), TEMPLATE.name) == []
    with (REPO / "pyproject.toml").open("rb") as file:
        version = tomllib.load(file)["project"]["version"]
    assert template()["spec"]["version"] == f"v{version}"


MUTATIONS: dict[str, tuple[Callable[[Obj], None], str]] = {
    "api-version": (lambda p: p.update(apiVersion="krew/v1"), "apiVersion"),
    "kind": (lambda p: p.update(kind="Plugins"), "kind"),
    "name-unlike-file": (lambda p: p["metadata"].update(name="twin-mq"), "must be named"),
    "reserved-name": (lambda p: p["metadata"].update(name="con"), "not allowed"),
    "version-without-v": (lambda p: p["spec"].update(version="0.1.0"), "semantic version"),
    "two-line-summary": (lambda p: p["spec"].update(shortDescription="a\nb"), "one line"),
    "no-platform": (lambda p: p["spec"].update(platforms=[]), "platform specified"),
    "upper-case-sha": (lambda p: p["spec"]["platforms"][0].update(sha256="A" * 64), "sha256"),
    "no-bin": (lambda p: p["spec"]["platforms"][0].pop("bin"), "`bin`"),
    "empty-files": (lambda p: p["spec"]["platforms"][0].update(files=[]), "`files`"),
    "distro-selector": (
        lambda p: p["spec"]["platforms"][0]["selector"]["matchLabels"].update(distro="debian"),
        "selector key 'distro'",
    ),
    "misspelt-field": (lambda p: p["spec"].update(homePage="x"), "unknown field 'homePage'"),
    "overlapping-platforms": (
        lambda p: p["spec"]["platforms"].append(
            {**p["spec"]["platforms"][0], "selector": {"matchLabels": {"os": "linux"}}}
        ),
        "2 platforms match linux/amd64",
    ),
}


@pytest.mark.parametrize("mutate,message", MUTATIONS.values(), ids=MUTATIONS.keys())
def test_the_rules_refuse_what_krew_refuses(mutate: Callable[[Obj], None], message: str) -> None:
    plugin = with_platform(template())
    mutate(plugin)
    errors = krew_errors(plugin, TEMPLATE.name)
    assert any(message in error for error in errors), errors


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """`make krew-package` into a temporary folder: (archive, manifest)."""
    return krew_build.build(tmp_path_factory.mktemp("krew"), "https://example.org/releases")


@pytest.mark.slow
def test_the_built_manifest_names_the_archive_and_krew_would_accept_it(
    built: tuple[Path, Path],
) -> None:
    archive, manifest_path = built
    plugin = yaml.safe_load(manifest_path.read_text())
    assert krew_errors(plugin, manifest_path.name) == []
    (platform,) = plugin["spec"]["platforms"]
    assert platform["sha256"] == hashlib.sha256(archive.read_bytes()).hexdigest()
    assert platform["uri"] == f"https://example.org/releases/{archive.name}"
    assert platform["selector"]["matchLabels"] == krew_build.platform_labels()


@pytest.mark.slow
def test_the_archive_installed_as_krew_does_runs_the_plugin_without_the_project(
    built: tuple[Path, Path], tmp_path: Path
) -> None:
    archive, manifest_path = built
    (platform,) = yaml.safe_load(manifest_path.read_text())["spec"]["platforms"]
    store = tmp_path / "store" / "twinmq" / "v0"
    with tarfile.open(archive) as tar:
        tar.extractall(store, filter="data")
    binary = store / platform["bin"]
    assert os.access(binary, os.X_OK)
    # krew links the bin onto PATH as kubectl-<name>; nothing of this checkout or its venv
    # is reachable from the plugin's environment.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "kubectl-twinmq").symlink_to(binary)
    python_dir = Path(sys.executable).resolve().parent  # a python3.X of the build's version
    env = {"PATH": f"{bin_dir}:{python_dir}:/usr/bin:/bin", "HOME": str(tmp_path)}
    proc = subprocess.run(
        ["kubectl-twinmq", "status", "--help"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "usage: kubectl twinmq status" in proc.stdout
    proc = subprocess.run(
        ["kubectl-twinmq", "status"],
        env={**env, "KUBECONFIG": str(tmp_path / "none")},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1 and "cannot load the kubeconfig" in proc.stderr


@pytest.mark.slow
def test_the_archive_is_the_same_when_built_again(built: tuple[Path, Path], tmp_path: Path) -> None:
    archive, _ = built
    again, _ = krew_build.build(tmp_path, "https://example.org/releases")
    assert (
        hashlib.sha256(again.read_bytes()).digest() == hashlib.sha256(archive.read_bytes()).digest()
    )
