"""Regenerate (or check) the protobuf/gRPC stubs of every ``protocol/*.proto``.

    python -m murmur.protocol.generate           # rewrite *_pb2.py, *_pb2_grpc.py, *_pb2.pyi
    python -m murmur.protocol.generate --check   # exit 1, naming the files, if they drifted

The stubs are committed (so a node needs no protoc at run time) and CI runs ``--check`` so they
can never drift from the sources. Reproducible by construction: the .proto files are copied into
a scratch tree as ``murmur/protocol/<name>.proto`` and compiled there with the pinned
grpcio-tools (constraints.txt), so the generated imports read ``from murmur.protocol import
x_pb2`` (importable from the installed package) and nothing in the output depends on where the
checkout lives.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.resources
import shutil
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
PACKAGE_PATH = Path("murmur") / "protocol"  # the import path the stubs must use
SUFFIXES = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")


class GenerateError(RuntimeError):
    pass


def proto_sources(proto_dir: Path = PROTO_DIR) -> list[Path]:
    return sorted(proto_dir.glob("*.proto"))


def generated_names(sources: list[Path]) -> list[str]:
    return [src.stem + suffix for src in sources for suffix in SUFFIXES]


def _tools_version() -> str:
    try:
        from importlib.metadata import version

        return version("grpcio-tools")
    except Exception:  # noqa: BLE001 - only used in a message
        return "unknown"


def generate_into(out_dir: Path, proto_dir: Path = PROTO_DIR) -> dict[str, bytes]:
    """Compile every .proto of ``proto_dir``; return {generated file name: content}."""
    try:
        from grpc_tools import protoc
    except ImportError:
        raise GenerateError("grpcio-tools is not installed: pip install 'murmur[dev]'") from None
    sources = proto_sources(proto_dir)
    if not sources:
        return {}
    src_root = out_dir / "src"
    dst_root = out_dir / "gen"
    (src_root / PACKAGE_PATH).mkdir(parents=True)
    (dst_root / PACKAGE_PATH).mkdir(parents=True)
    for src in sources:
        shutil.copyfile(src, src_root / PACKAGE_PATH / src.name)
    well_known = importlib.resources.files("grpc_tools") / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{src_root}",
        f"-I{well_known}",
        f"--python_out={dst_root}",
        f"--pyi_out={dst_root}",
        f"--grpc_python_out={dst_root}",
        *[str(PACKAGE_PATH / src.name) for src in sources],
    ]
    if protoc.main(args) != 0:
        raise GenerateError("protoc failed on the .proto sources (its message is above)")
    out: dict[str, bytes] = {}
    for name in generated_names(sources):
        path = dst_root / PACKAGE_PATH / name
        if not path.exists():
            raise GenerateError(f"protoc did not produce {name}")
        out[name] = path.read_bytes()
    return out


def stale_files(proto_dir: Path, expected: set[str]) -> list[Path]:
    """Generated files in proto_dir whose .proto no longer exists."""
    found = [p for suffix in SUFFIXES for p in proto_dir.glob(f"*{suffix}")]
    return sorted(p for p in found if p.name not in expected)


def write(proto_dir: Path = PROTO_DIR) -> list[str]:
    with tempfile.TemporaryDirectory(prefix="murmur-protoc-") as tmp:
        files = generate_into(Path(tmp), proto_dir)
    changed = []
    for name, content in files.items():
        path = proto_dir / name
        if not path.exists() or path.read_bytes() != content:
            path.write_bytes(content)
            changed.append(name)
    for path in stale_files(proto_dir, set(files)):
        path.unlink()
        changed.append(f"{path.name} (removed)")
    return changed


def check(proto_dir: Path = PROTO_DIR) -> list[str]:
    """Names of committed stubs that differ from what the sources generate (empty: all good)."""
    with tempfile.TemporaryDirectory(prefix="murmur-protoc-") as tmp:
        files = generate_into(Path(tmp), proto_dir)
    problems = []
    for name, content in files.items():
        path = proto_dir / name
        if not path.exists():
            problems.append(f"{name}: missing")
        elif path.read_bytes() != content:
            diff = difflib.unified_diff(
                path.read_text().splitlines(),
                content.decode().splitlines(),
                "committed",
                "generated",
                lineterm="",
                n=0,
            )
            first = next((line for line in list(diff)[2:] if line[:1] in "+-"), "")
            problems.append(f"{name}: differs from its .proto ({first[:100]})")
    problems += [f"{p.name}: no .proto source any more" for p in stale_files(proto_dir, set(files))]
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m murmur.protocol.generate", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--check", action="store_true", help="do not write; exit 1 if the committed stubs drifted"
    )
    parser.add_argument("--proto-dir", type=Path, default=PROTO_DIR, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        if args.check:
            problems = check(args.proto_dir)
            if problems:
                print(
                    "error: the committed protobuf stubs drifted from the .proto sources "
                    f"(grpcio-tools {_tools_version()}):\n  "
                    + "\n  ".join(problems)
                    + "\nrun: python -m murmur.protocol.generate  (with the grpcio-tools of constraints.txt)",
                    file=sys.stderr,
                )
                return 1
            print(f"protobuf stubs up to date ({len(proto_sources(args.proto_dir))} .proto files)")
            return 0
        changed = write(args.proto_dir)
        print("regenerated: " + (", ".join(changed) if changed else "nothing changed"))
        return 0
    except GenerateError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
