"""The node's state folder: what survives a SIGKILL and a restart.

    STATE_DIR/
      identity/node.key      the node's key pair, made once (the node id derives from it)
      identity/node.crt      the certificate the coordinator issued on join, and its CA (ca.crt)
      join.json              the join reply: run id, node id, addresses, intervals
      run.json               whose state this is: the run id and its coordinator's CA (sha256), kept
                             across a clean leave; a join to another run sets the state aside
      config.toml            the run configuration the coordinator handed out
      checkpoint.pt          model, inner optimizer, sync state (global copy, outer momentum,
                             round counters), the codec's error-feedback residual, data position:
                             written atomically after a round
      commits.jsonl          progress commits not yet acknowledged by the coordinator (journal)
      rounds.jsonl           one JSON line per outer round: loss, hash of the global state, peers
      node.lock              held while a daemon runs on this folder

The identity, join record, run.json, config.toml and the lock are a member folder's
(node/net/member_folder.py), which the stage peers and drivers keep too.

Every write goes to a temporary file first and is renamed into place, so a kill at any instant
leaves either the old file or the new one, never a torn one.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from murmur.node.net.member_folder import JoinRecord, MemberFolder, MemberFolderError, atomic_write, run_owner

# JoinRecord too: the daemon's modules find it here, beside the folder that keeps it.
__all__ = ["JoinRecord", "PendingCommit", "StateDir", "StateDirError", "read_rounds"]


CHECKPOINT_FIX = (
    "move it aside (mv it out of {root}) or delete it, and start the node again: it takes the run's "
    "state from its peers"
)


class StateDirError(MemberFolderError):
    """The state folder cannot be used (locked, unwritable, a damaged file). Not to be confused with
    node/net/state_transfer.py's StateError: a training state that could not be fetched from peers."""


@dataclass(slots=True)
class PendingCommit:
    """A commit the coordinator has not acknowledged yet; replayed in order until it has."""

    lease_id: str
    shard_id: int
    start_offset: int
    end_offset: int
    outer_step: int
    loss: float
    bytes_sent: int
    seconds: float
    round_members: list[str] = field(default_factory=list)  # the round's group (the split check)
    val_loss: float | None = None  # the round's validation loss, on the round's first commit only


class StateDir(MemberFolder):
    """A member folder (node/net/member_folder.py: the lock, the identity, the join record) with the
    node's training state beside it."""

    error = StateDirError
    _verified: tuple[int, int] | None = None  # (size, mtime) of the checkpoint verify_checkpoint passed

    def set_aside_other_run(self, run_id: str, ca_pem: bytes) -> Path | None:
        """Move the training state of another run (another run id, or the same name under another
        coordinator's CA) out of the way of a join to ``run_id``: a run's checkpoint, journal and
        round records belong to that run of that coordinator alone, and a node that resumed another
        run's checkpoint of the same name trained nothing ("the run's schedule is done"). Nothing
        is deleted: it goes to ``other-run-<id>-<time>/``, which this returns (None: nothing to move)."""
        theirs = self._run_owner()
        kept = [p for p in (self.checkpoint_path, self.journal_path, self.rounds_path) if p.exists()]
        if theirs is None or theirs == run_owner(run_id, ca_pem) or not kept:
            return None
        name = re.sub(r"[^A-Za-z0-9._-]", "_", theirs["run_id"])
        aside = self.root / f"other-run-{name}-{time.strftime('%Y%m%d-%H%M%S')}"
        aside.mkdir()
        for path in kept:
            path.rename(aside / path.name)
        return aside

    def _run_owner(self) -> dict[str, str] | None:
        """Whose state the folder holds; folders from before run.json: the CA it joined with and its
        last join record's or round record's run id."""
        try:
            return json.loads((self.root / "run.json").read_text())
        except (OSError, json.JSONDecodeError):
            pass
        try:
            ca_pem = (self.identity_dir / "ca.crt").read_bytes()
        except OSError:
            return None
        try:
            run_id = json.loads((self.root / "join.json").read_text())["run_id"]
        except (OSError, KeyError, json.JSONDecodeError):
            run_id = next((r["run"] for r in reversed(read_rounds(self.root)) if r.get("run")), "")
        return run_owner(run_id, ca_pem)

    # -- checkpoint --------------------------------------------------------------------------------

    @property
    def checkpoint_path(self) -> Path:
        return self.root / "checkpoint.pt"

    # The checkpoint file's module imports torch: only these two methods need it, so the folder's
    # other readers (the testnet's and the tests' round records, `murmur testnet`) stay free of it.

    def save_checkpoint(self, state: dict[str, Any]) -> None:
        from murmur.node.daemon import checkpoint_file

        tmp = self.checkpoint_path.with_name("checkpoint.pt.tmp")
        checkpoint_file.save(state, tmp)  # fsynced
        tmp.replace(self.checkpoint_path)

    def verify_checkpoint(self) -> bool | None:
        """Check the checkpoint against its checksum (a streaming hash: no memory for it), before the
        node joins: None when there is none, True when it matches, False for a file written before
        checksums (read unchecked). StateDirError, one line naming the file and what to do, when
        it is corrupt or cut short: nothing is trained from it and the ledger is not touched."""
        if not self.checkpoint_path.is_file():
            return None
        from murmur.node.daemon import checkpoint_file
        from murmur.protocol.integrity import IntegrityError

        try:
            ok = checkpoint_file.verify(self.checkpoint_path, fix=CHECKPOINT_FIX.format(root=self.root))
        except IntegrityError as err:
            raise StateDirError(str(err)) from None
        stat = self.checkpoint_path.stat()
        self._verified = (stat.st_size, stat.st_mtime_ns)
        return ok

    def load_checkpoint(self) -> dict[str, Any] | None:
        if not self.checkpoint_path.is_file():
            return None
        from murmur.node.daemon import checkpoint_file

        stat = self.checkpoint_path.stat()
        if self._verified != (stat.st_size, stat.st_mtime_ns):
            self.verify_checkpoint()  # the same file is not hashed twice in one start
        try:
            return checkpoint_file.load(self.checkpoint_path, verified=True)
        except Exception as err:  # noqa: BLE001 - any unreadable file is the same user error
            raise StateDirError(
                f"checkpoint {self.checkpoint_path} cannot be read ({type(err).__name__}); delete it and "
                "the node will fetch the state from its peers"
            ) from None

    # -- commit journal ----------------------------------------------------------------------------

    @property
    def journal_path(self) -> Path:
        return self.root / "commits.jsonl"

    def save_pending(self, pending: list[PendingCommit]) -> None:
        data = "".join(json.dumps(asdict(c)) + "\n" for c in pending)
        atomic_write(self.journal_path, data.encode())

    def load_pending(self) -> list[PendingCommit]:
        if not self.journal_path.is_file():
            return []
        out = []
        for line in self.journal_path.read_text().splitlines():
            if line.strip():
                try:
                    out.append(PendingCommit(**json.loads(line)))
                except (TypeError, json.JSONDecodeError):
                    continue  # a torn last line of an older format: the lease re-leases it anyway
        return out

    # -- round log ---------------------------------------------------------------------------------

    @property
    def rounds_path(self) -> Path:
        return self.root / "rounds.jsonl"

    def append_round(self, record: dict[str, Any]) -> None:
        with open(self.rounds_path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()


def read_rounds(root: str | Path) -> list[dict[str, Any]]:
    path = Path(root) / "rounds.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # the line being written when the node was killed
    return out

