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


def test_a_reader_that_goes_away_ends_the_command_quietly(tmp_path):
    from _coordinator_helpers import closed_pipe_run
    from _node_helpers import small_dataset

    from murmur.cli import EXIT_BROKEN_PIPE

    done = closed_pipe_run(["data", "info", str(small_dataset(tmp_path))])
    assert done.stderr == "" and done.returncode == EXIT_BROKEN_PIPE, (done.returncode, done.stderr)
    for args in (["--help"], ["--version"], ["admin", "--help"]):  # argparse's own printing, too
        done = closed_pipe_run(args)
        assert done.stderr == "" and done.returncode in (0, EXIT_BROKEN_PIPE), (args, done.returncode, done.stderr)


def test_admin_help_names_the_variables_that_exist():
    proc = subprocess.run([sys.executable, "-m", "murmur.cli", "admin", "status", "--help"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert "$MURMUR_ADMIN_KEY_FILE" in text and "$MURMUR_CA_CERT" in text, text
