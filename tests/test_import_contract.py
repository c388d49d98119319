"""The import contracts of pyproject.toml ([tool.importlinter]) hold, and a broken one is caught.

The check itself is `.ci/lint_imports.py` (CI runs it too); it lays the package out as setuptools
maps it and runs import-linter there. Each run is a fresh process: import-linter finds `murmur` by
import machinery, which must not see this process's already imported package.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / ".ci" / "lint_imports.py"


def _script():
    spec = importlib.util.spec_from_file_location("lint_imports", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=240)


def test_the_tree_keeps_its_import_contracts():
    proc = _run()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "BROKEN" not in proc.stdout  # each contract line ends in KEPT or BROKEN


def _unlink_into_folder(link: Path) -> None:
    """Replace a symlinked folder of the laid-out package by a real one linking each entry, so a
    module can be added to the copy without touching the repository."""
    target = link.resolve()
    link.unlink()
    link.mkdir()
    for entry in target.iterdir():
        (link / entry.name).symlink_to(entry)


def test_a_model_module_importing_the_network_breaks_the_contract(tmp_path):
    _script().lay_out(tmp_path)
    node = tmp_path / "murmur" / "node"
    _unlink_into_folder(node)
    _unlink_into_folder(node / "model")
    (node / "model" / "leak.py").write_text("from murmur.node.net import server  # noqa: F401\n")
    proc = _run("--laid-out", str(tmp_path))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "the model is free of communication BROKEN" in proc.stdout
    assert "murmur.node.model.leak -> murmur.node.net.server" in proc.stdout


def test_a_cycle_between_two_modules_breaks_the_contract(tmp_path):
    _script().lay_out(tmp_path)
    optim = tmp_path / "murmur" / "optim"
    _unlink_into_folder(optim)
    (optim / "cycle_a.py").write_text("from murmur.optim import cycle_b  # noqa: F401\n")
    (optim / "cycle_b.py").write_text("from murmur.optim import cycle_a  # noqa: F401\n")
    proc = _run("--laid-out", str(tmp_path))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "No cycles are allowed in murmur.optim" in proc.stdout
