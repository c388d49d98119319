"""Check murmur's import contracts ([tool.importlinter] in pyproject.toml) with import-linter.

import-linter's graph builder (grimp) finds a package's modules by walking the package's folder.
murmur's subpackages live in top-level folders (node/, optim/, ...) that pyproject's
[tool.setuptools] package-dir maps under `murmur`, so the folder of `murmur` alone holds only the
CLI. This script lays the package out as setuptools maps it, out of symlinks in a temporary folder,
and runs lint-imports there on the working tree's files. Exit status: lint-imports' own.

    .venv/bin/python .ci/lint_imports.py              # the working tree
    .venv/bin/python .ci/lint_imports.py --laid-out DIR   # DIR/murmur laid out already (tests)
"""

from __future__ import annotations

import os
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = ROOT / "pyproject.toml"


def lay_out(dest: Path) -> None:
    """Make ``dest/murmur`` the package as installed: the root folder's entries plus one symlink per
    mapped subpackage folder."""
    package_dir: dict[str, str] = tomllib.loads(PYPROJECT.read_text())["tool"]["setuptools"]["package-dir"]
    root_name = "murmur"
    root = dest / root_name
    root.mkdir()
    for entry in (ROOT / package_dir[root_name]).iterdir():
        if entry.name != "__pycache__":
            (root / entry.name).symlink_to(entry)
    for package, folder in package_dir.items():
        parent, _, name = package.rpartition(".")
        if package == root_name:
            continue
        if parent != root_name:  # a deeper mapping would need a real folder for its parent here
            raise SystemExit(f"lint_imports: package-dir maps {package}; only murmur.<name> is supported")
        (root / name).symlink_to(ROOT / folder)


def lint(dest: Path) -> int:
    """lint-imports on ``dest/murmur``; run in a fresh process (one that has not imported murmur)."""
    from importlinter.cli import lint_imports

    # lint-imports puts the working directory first on sys.path: there `murmur` is the laid-out one.
    os.chdir(dest)
    return lint_imports(config_filename=str(PYPROJECT), no_cache=True, no_logo=True)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--laid-out"] and len(argv) == 2:
        return lint(Path(argv[1]).resolve())
    if argv:
        raise SystemExit(__doc__)
    with tempfile.TemporaryDirectory(prefix="murmur-imports-") as tmp:
        lay_out(Path(tmp))
        return lint(Path(tmp))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
