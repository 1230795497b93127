"""The product wheel holds the product only: no local cluster, no test rig, no demo.

Those are the dev distribution's (dev/pyproject.toml), installed by `make venv` beside the
product; the image installs this wheel (Containerfile), so whatever it holds reaches users.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DEV_PACKAGES = ("twinmq.localcluster", "twinmq.testing", "twinmq.demo")
IMPORT = re.compile(r"^\s*(?:from|import)\s+(twinmq\.\w+)", re.MULTILINE)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    """The product wheel, built as the image builds it (pip wheel, no dependencies) from a
    copy of the checkout: a build in place would leave build/ and *.egg-info behind."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "src"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".*", "__pycache__", "build"))
    out = root / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(out), str(source)],
        check=True, capture_output=True,
    )  # fmt: skip
    (built,) = out.glob("twinmq-*.whl")
    return zipfile.ZipFile(built)


def test_the_product_wheel_holds_no_local_cluster_test_rig_or_demo(
    wheel: zipfile.ZipFile,
) -> None:
    names = wheel.namelist()
    modules = {n.removesuffix(".py").replace("/", ".") for n in names if n.endswith(".py")}
    assert "twinmq.broker.main" in modules  # the wheel is the product's
    shipped = sorted(m for m in modules if m.startswith(tuple(p + "." for p in DEV_PACKAGES)))
    assert shipped == []
    assert not [n for n in names if "/tests/" in n or n.split("/")[-1].startswith("test_")]


def test_nothing_in_the_product_wheel_imports_a_dev_package(wheel: zipfile.ZipFile) -> None:
    importers = {
        name: sorted(set(IMPORT.findall(wheel.read(name).decode())) & set(DEV_PACKAGES))
        for name in wheel.namelist()
        if name.endswith(".py")
    }
    assert {name: found for name, found in importers.items() if found} == {}
    entry_points = next(n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt"))
    text = wheel.read(entry_points).decode()
    assert "twinmq.broker.main:main" in text
    assert not [p for p in DEV_PACKAGES if p in text]


def test_every_product_package_in_the_checkout_is_in_the_wheel(wheel: zipfile.ZipFile) -> None:
    """A package folder missing from pyproject's list works from the checkout and crashes
    the image (`twinmq.broker.mirror` once did)."""
    import tomllib

    dirs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    expected = {
        f"{package}.{'.'.join(init.parent.relative_to(REPO / folder).parts)}".rstrip(".")
        for package, folder in dirs.items()
        for init in (REPO / folder).rglob("__init__.py")
        if "tests" not in init.parts and "__pycache__" not in init.parts
    }
    shipped = {
        n.removesuffix("/__init__.py").replace("/", ".")
        for n in wheel.namelist()
        if n.endswith("/__init__.py")
    }
    assert sorted(expected - shipped) == []
