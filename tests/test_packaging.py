"""pyproject.toml lists every package folder, so a wheel (the Docker image installs one) carries the
same modules as the editable install the tests run on."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_folder_is_listed():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    found = set()
    for package, folder in setuptools["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((package, *parts)))
    assert sorted(found - listed) == [], "pyproject.toml [tool.setuptools] packages lacks these"
    data_folders = {p for p in listed if p.startswith("murmur.assets")}  # no __init__.py, listed for their files
    assert sorted(listed - found - data_folders) == [], "listed in pyproject.toml, but no such package folder"
