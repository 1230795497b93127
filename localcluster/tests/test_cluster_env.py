"""`.cluster/env` gives a shell everything the demo's last step needs."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from twinmq.localcluster.cluster import PLUGIN, plugin_script, write_env
from twinmq.localcluster.layout import Layout


def test_sourcing_the_env_puts_the_projects_kubectl_plugin_on_path(tmp_path: Path) -> None:
    if plugin_script() is None:
        pytest.skip("kubectl-twinmq is not installed: pip install -e .")
    layout = Layout(tmp_path / ".cluster")
    write_env(layout)
    # A shell whose PATH knows nothing of the venv, as a new terminal's.
    shell = f"source {layout.root / 'env'} && command -v {PLUGIN} && {PLUGIN} --help"
    result = subprocess.run(
        ["bash", "-c", shell], env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
        timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0] == str(layout.root / "bin" / PLUGIN)
    assert "usage: kubectl twinmq" in result.stdout
    assert f"export KUBECONFIG={layout.kubeconfig}" in (layout.root / "env").read_text()
