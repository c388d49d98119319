"""The docs must match the code: every run key with its default and choices, every environment
variable we read, every exchange setting, every file, test and module they cite; and no file may
point at notes outside the repository."""

import ast
import dataclasses
import functools
import re
import subprocess
import tomllib
import typing
from pathlib import Path

from pydantic import BaseModel

from murmur.protocol.runconfig import RunConfig

ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs" / "configuration.md").read_text()


def _table(annotation):
    """The table a field holds, an optional one (``PipelineSection | None``) included; else None."""
    options = typing.get_args(annotation) or (annotation,)
    return next((t for t in options if isinstance(t, type) and issubclass(t, BaseModel)), None)


def _keys(cls, prefix=""):
    for name, field in cls.model_fields.items():
        table = _table(field.annotation)
        if table is not None:
            yield from _keys(table, f"{prefix}{name}.")
        else:
            yield prefix + name


def test_the_key_walk_sees_every_section():
    keys = list(_keys(RunConfig))
    assert {"name", "model.preset", "train.steps", "sync.exchange_chunk_mb", "pipeline.stages"} <= set(keys)


def test_every_config_key_is_documented():
    missing = [k for k in _keys(RunConfig) if f"`{k}`" not in DOC]
    assert not missing, f"docs/configuration.md lacks {missing}"


# A row of a key table: | `section.key` | default | meaning |
_ROW = re.compile(r"^\| `([a-z_][a-z0-9_.]*)` \| ([^|]+) \| ([^\n]+) \|$", re.M)


def _default(key):
    *sections, name = key.split(".")
    cls = RunConfig
    for section in sections:
        cls = _table(cls.model_fields[section].annotation)
    return getattr(cls(), name)  # an optional table's keys: their defaults once the table is there


def _field(key):
    *sections, name = key.split(".")
    cls = RunConfig
    for section in sections:
        cls = _table(cls.model_fields[section].annotation)
    return cls.model_fields[name]


def test_the_documented_defaults_and_choices_are_the_schemas():
    rows = {key: (default.strip(), meaning) for key, default, meaning in _ROW.findall(DOC)}
    keys = list(_keys(RunConfig))
    assert sorted(rows) == sorted(keys), "docs/configuration.md's key tables name other keys than the schema"
    for key, (written, meaning) in rows.items():
        default = _default(key)
        if default is None:  # taken from the preset or the dataset: said in words
            assert not written.startswith("`"), key
        else:
            assert written.startswith("`") and written.endswith("`"), f"{key}: default {written} not in backticks"
            assert tomllib.loads(f"v = {written.strip('`')}")["v"] == default, f"{key}: docs say {written}"
        annotation = _field(key).annotation
        if typing.get_origin(annotation) is typing.Literal:
            undocumented = [c for c in typing.get_args(annotation) if f"`{c}`" not in meaning and c != default]
            assert not undocumented, f"{key}: docs/configuration.md does not name {undocumented}"


def test_every_environment_variable_is_documented():
    used = set()
    for folder in ("murmur", "node", "optim", "kernels", "protocol", "coordinator", "tests"):
        for path in (ROOT / folder).rglob("*.py"):
            used |= set(re.findall(r"\bMURMUR_[A-Z_]+\b", path.read_text()))
    documented = set(re.findall(r"`(MURMUR_[A-Z_]+)`", DOC))
    # A name that only stands as the prefix of documented ones (a filter in a test) is fine.
    missing = sorted(v for v in used if v not in documented and not any(d.startswith(v) for d in documented))
    assert not missing, f"docs/configuration.md lacks {missing}"


def test_every_exchange_setting_is_documented():
    from murmur.node.exchange.group import RendezvousSettings
    from murmur.node.exchange.settings import ExchangeSettings
    from murmur.node.net.server import PeerServerSettings
    from murmur.node.net.state_transfer import StateFetchSettings

    doc = (ROOT / "docs" / "protocol.md").read_text()
    classes = (ExchangeSettings, PeerServerSettings, RendezvousSettings, StateFetchSettings)
    names = [f"{c.__name__}.{f.name}" for c in classes for f in dataclasses.fields(c)]
    missing = [n for n in names if f"`{n}`" not in doc]
    assert not missing, f"docs/protocol.md lacks {missing}"


def test_no_tracked_file_points_outside_the_repository():
    # Spelled in pieces so that this file does not name them itself.
    outside = ["DESIGN" + ".md", "NOTES" + ".md", "../" + "shared"]
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    offenders = []
    for name in listed.decode().split("\0"):
        path = ROOT / name
        if not name or not path.is_file() or path.stat().st_size > 2_000_000:
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue  # binary
        offenders += [f"{name}: {word}" for word in outside if word in text]
    assert not offenders, f"files that name notes outside the repository: {offenders}"


# -- citations: every test, test function and module a doc names must exist ----------------------
#
# Docs cite code to back a claim ("the guarantee holds: `test_x.py::test_y`") or to send the reader
# somewhere ("`node/pipeline/router.py`"). A rename or a removed test leaves such a citation
# pointing at nothing, and nobody notices until a reader looks. These checks read what the docs
# cite and look for it in the tree.

# Top-level folders of the tree: a path starting with one of them is a citation of a file there.
_TOP = r"(?:\.ci|benchmarks|configs|coordinator|deploy|docs|kernels|murmur|node|optim|protocol|tests)"
# Not after a word, a dot, a slash or a dash (a URL, /run/run.toml, data/x); a path that runs into
# a placeholder (benchmarks/results/<name>.json, murmur/<run>/peers: a DHT key) is no file: the
# possessive *+ keeps the match from backing off the placeholder to the folder before it.
_PATH = re.compile(rf"(?<![\w./-])({_TOP}/[\w./*-]*+)(?!<)")
_TEST_FILE = re.compile(r"(?<![\w/.-])(?:tests/)?(test_\w+\.py)\b")
_TEST_FN = re.compile(r"(?:(?<![\w/])(?:tests/)?(test_\w+\.py))?::(test_\w+)")
_BARE_TEST_FN = re.compile(r"(?<![\w:])`(test_\w+)`")
_BARE_MODULE = re.compile(r"(?<![\w/.-])`(\w+\.py)`")
_DOTTED = re.compile(r"(?<![\w.])murmur(?:\.\w+)+")
# protocol/*.proto declare `package murmur.v1`: message names (murmur.v1.WireTensor), not modules.
_PROTO_PACKAGE = "murmur.v1"


def _cited_texts():
    """(name, text) of every doc that cites code: docs/*.md, the READMEs, and the benchmarks'
    module docstrings (each script says what it measures and with what)."""
    for path in [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md", ROOT / "deploy" / "README.md"]:
        yield str(path.relative_to(ROOT)), path.read_text()
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        yield str(path.relative_to(ROOT)), ast.get_docstring(ast.parse(path.read_text())) or ""


def _blocks(text):
    """(first line number, text) of each block a citation belongs with: a table row, or a
    paragraph (lines up to a blank one). A bare `x.py` is looked for in the folders its block cites."""
    block, start = [], 1
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("|"):
            if block:
                yield start, "\n".join(block)
                block = []
            yield number, line
        elif line.strip():
            if not block:
                start = number
            block.append(line)
        elif block:
            yield start, "\n".join(block)
            block = []
    if block:
        yield start, "\n".join(block)


@functools.cache
def _tracked_files():
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return tuple(name for name in listed.decode().split("\0") if name)


def _defines(test_file, name):
    return re.search(rf"^\s*(?:async\s+)?def {name}\(", test_file.read_text(), re.M) is not None


def _module_file(dotted):
    """The file a dotted name starting with ``murmur`` lives in, and what is left of the name past
    that module (an attribute: ``murmur.kernels.quantize_blockwise``); (None, rest) when no module
    of the tree has the name. Folders come from pyproject's package-dir, as the install maps them."""
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):  # the longest mapped package the name starts with
        if ".".join(parts[:n]) in package_dir:
            folder, rest = ROOT / package_dir[".".join(parts[:n])], parts[n:]
            break
    else:
        return None, parts
    while rest:
        if (folder / rest[0] / "__init__.py").is_file():
            folder, rest = folder / rest[0], rest[1:]
        elif (folder / f"{rest[0]}.py").is_file():
            return folder / f"{rest[0]}.py", rest[1:]
        else:
            break
    return folder / "__init__.py", rest


def broken_citations(name, text):
    """Every citation in ``text`` (the doc ``name``) of a file, a test or a module that does not
    exist, each as 'name:line: what is cited: why it is broken'."""
    broken = []
    tracked = {Path(p).name for p in _tracked_files()}
    for start, block in _blocks(text):
        folders = set()
        for offset, line in enumerate(block.splitlines()):
            where = f"{name}:{start + offset}"
            for path in _PATH.findall(line):
                path = path.rstrip(".,")
                if not (list(ROOT.glob(path)) if "*" in path else (ROOT / path).exists()):
                    broken.append(f"{where}: {path}: no such file")
                else:
                    folders.add(path if (ROOT / path).is_dir() else str(Path(path).parent))
            line_tests = []  # the test files this line cites, in order: ``::name`` means the last one
            for m in re.finditer(rf"{_TEST_FILE.pattern}|{_TEST_FN.pattern}", line):
                file = m.group(1) or m.group(2)
                if file:
                    if not (ROOT / "tests" / file).is_file():
                        broken.append(f"{where}: {file}: no such test file in tests/")
                        continue
                    line_tests.append(ROOT / "tests" / file)
                fn = m.group(3)
                if fn:
                    if not line_tests:
                        broken.append(f"{where}: ::{fn}: no test file before it on the line")
                    elif not _defines(line_tests[-1], fn):
                        broken.append(f"{where}: {line_tests[-1].name}::{fn}: no such test in that file")
            for fn in _BARE_TEST_FN.findall(line):
                # A test named alone belongs to a test file its line cites; with none, to any.
                candidates = line_tests or sorted((ROOT / "tests").glob("test_*.py"))
                if not any(_defines(f, fn) for f in candidates):
                    files = ", ".join(f.name for f in line_tests) or "tests/"
                    broken.append(f"{where}: {fn}: defined in none of {files}")
            for dotted in _DOTTED.findall(line):
                if dotted == _PROTO_PACKAGE or dotted.startswith(_PROTO_PACKAGE + "."):
                    continue
                file, rest = _module_file(dotted)
                if file is None or not file.is_file():
                    broken.append(f"{where}: {dotted}: no such module")
                elif rest and not re.search(rf"\b{rest[0]}\b", file.read_text()):
                    broken.append(f"{where}: {dotted}: no such module, nor a name {rest[0]} in "
                                  f"{file.relative_to(ROOT)}")
        for offset, line in enumerate(block.splitlines()):
            for module in _BARE_MODULE.findall(line):
                if module.startswith("test_"):
                    continue  # a test file: checked above
                # `store.py` beside `coordinator/`: in a folder its block cites; with none, anywhere.
                found = any((ROOT / f / module).is_file() for f in folders) if folders else module in tracked
                if not found:
                    places = ", ".join(sorted(folders)) or "the tree"
                    broken.append(f"{name}:{start + offset}: {module}: not in {places}")
    return broken


def test_every_cited_file_test_and_module_exists():
    broken = [b for name, text in _cited_texts() for b in broken_citations(name, text)]
    assert not broken, "docs cite what does not exist:\n" + "\n".join(broken)


def test_the_citation_check_finds_each_kind_of_broken_citation():
    # A check that finds nothing passes as well as one that looks: one broken citation of each kind
    # must each be reported, by doc and line, and one good citation of each kind must pass.
    doc = "\n".join([
        "| row | `node/pipeline/nothing.py` |",
        "| row | `test_docs.py::test_nothing_here` |",
        "| row | `test_no_such_file.py` |",
        "| row | `test_docs.py`, `::test_nothing_either` |",
        "| row | `test_cli.py`, and `test_every_cited_file_test_and_module_exists` alone |",
        "| row | `tests/test_cli.py`, `::test_every_config_key_is_documented` |",
        "`python -m murmur.node.pipeline.nothing`, `murmur.kernels.no_such_kernel`",
        "",
        "In `coordinator/`: `no_such_module.py`.",
    ])
    broken = broken_citations("made-up.md", doc)
    expected = [
        "made-up.md:1: node/pipeline/nothing.py: no such file",
        "made-up.md:2: test_docs.py::test_nothing_here: no such test in that file",
        "made-up.md:3: test_no_such_file.py: no such test file in tests/",
        "made-up.md:4: test_docs.py::test_nothing_either: no such test in that file",
        "made-up.md:5: test_every_cited_file_test_and_module_exists: defined in none of test_cli.py",
        "made-up.md:6: test_cli.py::test_every_config_key_is_documented: no such test in that file",
        "made-up.md:7: murmur.node.pipeline.nothing: no such module, nor a name nothing in node/pipeline/__init__.py",
        "made-up.md:7: murmur.kernels.no_such_kernel: no such module, nor a name no_such_kernel in"
        " kernels/__init__.py",
        "made-up.md:9: no_such_module.py: not in coordinator/",
    ]
    assert broken == expected
    # And what exists passes: the same kinds, each pointing at something real.
    real = "\n".join([
        "| row | `node/pipeline/router.py`, `tests/test_docs.py`, `tests/test_coordinator_*` |",
        "| row | `test_docs.py::test_every_cited_file_test_and_module_exists`,"
        " `::test_the_key_walk_sees_every_section` |",
        "| row | `test_docs.py` and `test_every_config_key_is_documented` |",
        "| row | `tests/test_docs.py` and `::test_the_key_walk_sees_every_section`, `tests/test_cli.py` |",
        "`python -m murmur.node.pipeline.router`, `murmur.kernels.quantize_blockwise`, `murmur.v1.WireTensor`",
        "",
        "In `coordinator/`: `store.py`; `benchmarks/results/<name>.json` is a pattern.",
    ])
    assert broken_citations("real.md", real) == []


def test_every_module_a_package_docstring_lists_exists():
    # A package's docstring lists its modules ("Modules: config (...), worker (...), ..."); a rename
    # that leaves the old name there sends the reader to a module that is gone.
    broken = []
    for init in (ROOT / p for p in _tracked_files() if Path(p).name == "__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        if "Modules:" not in doc:
            continue
        listing, depth = [], 0
        for ch in doc.split("Modules:", 1)[1]:  # the names outside the parentheses
            depth += (ch == "(") - (ch == ")")
            listing.append(ch if depth == 0 and ch != ")" else " ")
        names = [w for w in re.split(r"[\s,.]+", "".join(listing)) if w and w != "and"]
        folder = init.parent
        broken += [f"{init.relative_to(ROOT)}: {n}" for n in names
                   if not ((folder / f"{n}.py").is_file() or (folder / n / "__init__.py").is_file())]
    assert not broken, "package docstrings list modules that do not exist: " + ", ".join(broken)
