import argparse
import importlib
import subprocess
import sys

from murmur.cli import SUBCOMMANDS, main


def test_help_lists_every_noun(capsys):
    assert main([]) == 2
    out = capsys.readouterr().out
    for noun in SUBCOMMANDS:
        assert noun in out


def test_every_subcommand_module_registers():
    """Each noun's module exists and mounts a parser that runs something."""
    for noun, (module, _) in SUBCOMMANDS.items():
        mod = importlib.import_module(module)
        parser = argparse.ArgumentParser(prog="murmur")
        mod.register(parser.add_subparsers())
        assert noun in parser.format_help(), noun
        proc = subprocess.run([sys.executable, "-m", "murmur.cli", noun, "--help"], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0 and f"usage: murmur {noun}" in proc.stdout, (noun, proc.stderr)
