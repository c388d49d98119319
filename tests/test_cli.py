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


def _parsers(parser: argparse.ArgumentParser, path: str = "murmur"):
    """Every parser under ``parser`` with its command path, each once."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, f"{path} {name}")


def test_every_sub_app_names_its_positional_arguments_one_way():
    """Sub-command slots read COMMAND, NOUN or VERB (never a {a,b,c} list), and a value a command
    takes by position is an upper-case name (DIR, RUN, NODE_ID), as its --help shows it."""
    parser = argparse.ArgumentParser(prog="murmur")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module, _ in SUBCOMMANDS.values():
        importlib.import_module(module).register(sub)
    seen = 0
    for path, p in _parsers(parser):
        for action in p._actions:
            if action.option_strings:
                continue
            seen += 1
            if isinstance(action, argparse._SubParsersAction):
                assert action.metavar in ("COMMAND", "NOUN", "VERB"), (path, action.metavar)
            else:
                name = action.metavar or action.dest
                assert name == name.upper(), (path, name)
    assert seen > 15


def test_testnet_help_keeps_its_examples_one_to_a_line():
    proc = subprocess.run([sys.executable, "-m", "murmur.cli", "testnet", "up", "--help"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "    murmur testnet up --nodes 3 --config configs/testnet-small.toml --duration 180" in lines
    assert "    murmur testnet chaos --nodes 4 --mtbf 30 --duration 300" in lines
