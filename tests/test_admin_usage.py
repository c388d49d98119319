"""`murmur admin` mistakes that never reach a coordinator: a noun without its verb, and a file that
is not the coordinator's admin key. Each is one line that names the fix."""

from __future__ import annotations

import pytest

from murmur.cli import main


def _usage_error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    return err.strip()


def test_a_noun_without_its_verb_lists_the_verbs(capsys):
    verbs = "list, show, ban or unban (e.g. `murmur admin nodes list --output json`)"
    assert _usage_error(capsys, ["admin", "nodes"]) == f"error: `murmur admin nodes` needs a verb first: {verbs}"
    # The options before a verb: argparse would read 'json' as the verb and only say it is an invalid choice.
    assert _usage_error(capsys, ["admin", "nodes", "--output", "json"]).endswith(verbs)
    assert "create, list, show, pause, resume, finish or recover" in _usage_error(capsys, ["admin", "runs"])
    with pytest.raises(SystemExit) as stop:  # the verbs themselves parse as before
        main(["admin", "nodes", "list", "--help"])
    assert stop.value.code == 0 and "--status" in capsys.readouterr().out


def _one_line(capsys, argv: list[str]) -> str:
    assert main(argv) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("error: "), err
    return err.strip()


def test_a_wrong_key_file_says_so_not_a_ca_message(tmp_path, capsys, monkeypatch):
    for name in ("MURMUR_ADMIN_KEY", "MURMUR_ADMIN_KEY_FILE", "MURMUR_CA_CERT"):
        monkeypatch.delenv(name, raising=False)
    pem = tmp_path / "coordinator.db.ca.crt"  # another of the coordinator's files, passed as the key
    pem.write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    err = _one_line(capsys, ["admin", "status", "--admin-key", str(pem)])
    assert err == (f"error: {pem} is not an admin key file (it holds no one-line secret): pass the "
                   "<db>.admin-key file the coordinator wrote next to its database")
    other = tmp_path / "secret.txt"
    other.write_text("x" * 43 + "\n")
    err = _one_line(capsys, ["admin", "status", "--admin-key", str(other)])
    assert err.startswith(f"error: --admin-key {other} is not named <db>.admin-key: pass the coordinator's own")
    lonely = tmp_path / "old.admin-key"  # a key whose coordinator's folder is not here
    lonely.write_text("x" * 43 + "\n")
    err = _one_line(capsys, ["admin", "status", "--admin-key", str(lonely)])
    assert err.startswith(f"error: no CA certificate {tmp_path / 'old.ca.crt'} beside the admin key file {lonely}")
    assert "is it the <db>.admin-key the coordinator wrote" in err
