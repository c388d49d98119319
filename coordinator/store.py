"""The ledger: one SQLite file in WAL mode. Every SQL statement of the coordinator lives here.

Durability: WAL, and a transaction is acknowledged only after its WAL frames are written and
fsynced, so an acknowledged commit survives SIGKILL of the process and a power cut. That is what
SQLite's synchronous=FULL does (NORMAL, plus one fsync of the WAL after each commit); here the
connection runs NORMAL and ``sync()`` makes that fsync itself, right after the COMMIT, so the
guarantee is FULL's. Why by hand: a write that is ``durable=False`` leaves the fsync to its caller,
and group commits (coordinator/group_commit.py) make it in a worker thread while the loop goes on
taking calls for the next batch; with FULL the fsync ran inside COMMIT on the loop thread, the loop
stood still for it, and a join storm's batches stayed one call each (one fsync a join).
(NORMAL alone would survive a process kill, the frames being in the OS page cache, but not a power
cut; SQLite itself still syncs the WAL before each checkpoint and the database after it.)

Schema versions: ``schema_version`` holds the version the file is at. A fresh file is created at
the newest version by applying every migration in order; an older file is migrated forward in one
transaction; a file newer than this build knows is refused (never guessed at).

The store is used from the coordinator's one asyncio thread; calls are short (well under a
millisecond without the fsync), so they run inline instead of hopping to a thread pool.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from murmur.errors import MurmurError


class StoreError(MurmurError):
    pass


# Each entry moves the schema from version i to i+1. Never edit a released entry: append one.
MIGRATIONS: list[str] = [
    # v1: the ledger
    """
    CREATE TABLE runs (
        run_id TEXT PRIMARY KEY,
        name TEXT NOT NULL,
        config_toml TEXT NOT NULL,
        manifest_json TEXT NOT NULL,
        state TEXT NOT NULL CHECK (state IN ('active', 'paused', 'finished')),
        created_at REAL NOT NULL
    );
    CREATE TABLE tokens (
        token_id TEXT PRIMARY KEY,
        run_id TEXT NOT NULL REFERENCES runs(run_id),
        secret_hash TEXT NOT NULL,
        created_at REAL NOT NULL,
        expires_at REAL NOT NULL,
        max_uses INTEGER NOT NULL,
        uses_left INTEGER NOT NULL CHECK (uses_left >= 0),
        revoked INTEGER NOT NULL DEFAULT 0,
        note TEXT NOT NULL DEFAULT ''
    );
    CREATE TABLE nodes (
        node_id TEXT PRIMARY KEY,
        run_id TEXT NOT NULL REFERENCES runs(run_id),
        cert_pem TEXT NOT NULL,
        status TEXT NOT NULL CHECK (status IN ('active', 'lost', 'left', 'banned')),
        joined_at REAL NOT NULL,
        last_heartbeat REAL NOT NULL,
        hardware_json TEXT NOT NULL DEFAULT '{}',
        tokens_per_s REAL NOT NULL DEFAULT 0,
        ban_reason TEXT NOT NULL DEFAULT ''
    );
    CREATE TABLE shards (
        run_id TEXT NOT NULL REFERENCES runs(run_id),
        shard_id INTEGER NOT NULL,
        name TEXT NOT NULL,
        tokens INTEGER NOT NULL CHECK (tokens >= 0),
        committed_offset INTEGER NOT NULL DEFAULT 0,
        holder TEXT,
        lease_id TEXT,
        lease_expiry REAL,
        done INTEGER NOT NULL DEFAULT 0,
        PRIMARY KEY (run_id, shard_id),
        CHECK (committed_offset >= 0 AND committed_offset <= tokens)
    );
    CREATE INDEX shards_holder ON shards(holder);
    CREATE TABLE commits (
        lease_id TEXT NOT NULL,
        end_offset INTEGER NOT NULL,
        run_id TEXT NOT NULL,
        shard_id INTEGER NOT NULL,
        node_id TEXT NOT NULL,
        start_offset INTEGER NOT NULL,
        outer_step INTEGER NOT NULL,
        loss REAL NOT NULL,
        bytes_sent INTEGER NOT NULL,
        seconds REAL NOT NULL,
        at REAL NOT NULL,
        PRIMARY KEY (lease_id, end_offset)
    );
    CREATE INDEX commits_run_at ON commits(run_id, at);
    CREATE INDEX commits_node ON commits(node_id);
    CREATE TABLE rounds (
        run_id TEXT NOT NULL,
        outer_step INTEGER NOT NULL,
        commits INTEGER NOT NULL,
        tokens INTEGER NOT NULL,
        loss_sum REAL NOT NULL,
        bytes_sent INTEGER NOT NULL,
        first_at REAL NOT NULL,
        last_at REAL NOT NULL,
        PRIMARY KEY (run_id, outer_step)
    );
    CREATE TABLE events (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        at REAL NOT NULL,
        run_id TEXT NOT NULL DEFAULT '',
        kind TEXT NOT NULL,
        node_id TEXT NOT NULL DEFAULT '',
        detail_json TEXT NOT NULL DEFAULT '{}'
    );
    CREATE TABLE counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
    """,
    # v2: checkpoints, the node's own serving address, event lookups by run
    """
    CREATE TABLE checkpoints (
        run_id TEXT NOT NULL,
        step INTEGER NOT NULL,
        location TEXT NOT NULL,
        sha256 TEXT NOT NULL,
        node_id TEXT NOT NULL,
        at REAL NOT NULL,
        PRIMARY KEY (run_id, step, node_id)
    );
    ALTER TABLE nodes ADD COLUMN peer_address TEXT NOT NULL DEFAULT '';
    CREATE INDEX events_run ON events(run_id, seq);
    """,
    # v3: stage leases of pipelined runs (which stage each stage peer serves, or is moving to)
    """
    CREATE TABLE stage_leases (
        node_id TEXT PRIMARY KEY,
        run_id TEXT NOT NULL,
        stage INTEGER NOT NULL CHECK (stage >= 0),
        state TEXT NOT NULL CHECK (state IN ('joining', 'serving', 'moving')),
        from_stage INTEGER NOT NULL DEFAULT -1,
        reason TEXT NOT NULL DEFAULT '',
        since REAL NOT NULL
    );
    CREATE INDEX stage_leases_run ON stage_leases(run_id);
    """,
    # v4: the name a volunteer gave its node (`murmur node run --name`)
    """
    ALTER TABLE nodes ADD COLUMN name TEXT NOT NULL DEFAULT '';
    """,
    # v5: rounds' validation losses, as the nodes that evaluated the round's state reported them
    """
    ALTER TABLE rounds ADD COLUMN val_sum REAL NOT NULL DEFAULT 0;
    ALTER TABLE rounds ADD COLUMN val_n INTEGER NOT NULL DEFAULT 0;
    """,
    # v6: the free shards in the order free_shard() hands them out, so a lease grant reads one row
    # instead of sorting every free shard (10,000 nodes leasing one after another: 1.15 ms a grant
    # on the loop, against 7 us with the index)
    """
    CREATE INDEX shards_free ON shards(run_id, (committed_offset > 0) DESC, shard_id) WHERE holder IS NULL AND done = 0;
    """,
]
SCHEMA_VERSION = len(MIGRATIONS)


@dataclass(slots=True)
class Shard:
    run_id: str
    shard_id: int
    name: str
    tokens: int
    committed_offset: int
    holder: str | None
    lease_id: str | None
    lease_expiry: float | None
    done: bool


def _shard(row: sqlite3.Row) -> Shard:
    return Shard(
        run_id=row["run_id"],
        shard_id=row["shard_id"],
        name=row["name"],
        tokens=row["tokens"],
        committed_offset=row["committed_offset"],
        holder=row["holder"],
        lease_id=row["lease_id"],
        lease_expiry=row["lease_expiry"],
        done=bool(row["done"]),
    )


class Store:
    def __init__(
        self,
        path: str | Path,
        *,
        migrate_to: int = SCHEMA_VERSION,
        wal_checkpoint_pages: int = 1000,
    ) -> None:
        self.path = Path(path)
        if self.path.exists() and self.path.is_dir():
            raise StoreError(f"--db {self.path} is a folder; give the path of a database file")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._wal_fd: int | None = None  # the WAL, open for sync()'s fsync
        self._wal_lock = threading.Lock()
        try:
            # isolation_level=None: we issue BEGIN/COMMIT ourselves (see write()).
            self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            self.db.row_factory = sqlite3.Row
            self.db.execute("PRAGMA journal_mode=WAL")
            # FULL's fsync after each commit is made by sync() (see the module's docstring).
            self.db.execute("PRAGMA synchronous=NORMAL")
            self.db.execute("PRAGMA foreign_keys=ON")
            self.db.execute("PRAGMA busy_timeout=5000")
            self.db.execute(f"PRAGMA wal_autocheckpoint={int(wal_checkpoint_pages)}")
            self._migrate(migrate_to)
        except sqlite3.DatabaseError as err:
            raise StoreError(
                f"{self.path} is not a usable murmur database ({err}); "
                "point --db at a new file or at the coordinator's own database"
            ) from None
        self._depth = 0
        # Each run's shard totals, kept in step with the writes to its shards (insert_run, advance)
        # and dropped at any rollback (recounted at the next read): every commit's reply carries the
        # run's committed tokens, and counting them over the shards table took 1.4 ms at 10,000
        # shards, more than a second of every second at 1,000 commits a second.
        self._totals: dict[str, dict[str, int]] = {}

    # --- plumbing ------------------------------------------------------------------------------

    def close(self) -> None:
        self.db.close()
        with self._wal_lock:
            if self._wal_fd is not None:
                os.close(self._wal_fd)
                self._wal_fd = None

    def sync(self) -> None:
        """fsync the WAL: every transaction committed so far is on disk (synchronous=FULL's step).
        Safe from another thread while the loop thread goes on using the connection: it touches
        the file only, never SQLite. OSError when the disk fails: nothing after it is promised."""
        wal = f"{self.path}-wal"
        with self._wal_lock:
            fd = self._wal_fd
            # The WAL is created by the first write and kept while the connection is open; check
            # it is still the file this descriptor holds (it is if nobody else removed it).
            if fd is not None and os.fstat(fd).st_ino != os.stat(wal).st_ino:
                os.close(fd)
                fd = self._wal_fd = None
            if fd is None:
                fd = self._wal_fd = os.open(wal, os.O_RDONLY)
                # Its directory entry too, once (SQLite's FULL syncs a new WAL's directory).
                folder = os.open(self.path.parent, os.O_RDONLY)
                try:
                    os.fsync(folder)
                finally:
                    os.close(folder)
        os.fsync(fd)

    @contextmanager
    def write(self, *, durable: bool = True) -> Iterator[sqlite3.Connection]:
        """One write transaction, rolled back on any exception. A nested use is a savepoint of the
        outer one: its exception rolls back its own writes only, and the outer transaction goes on
        (several commits share one transaction, and one fsync, that way: coordinator/group_commit.py;
        a refused one takes back nothing of the others). ``durable=False``: the caller calls
        ``sync()`` itself before it tells anyone the transaction happened (group_commit.py does,
        off the loop thread)."""
        if self._depth:
            savepoint = f"nested{self._depth}"
            self.db.execute(f"SAVEPOINT {savepoint}")
            self._depth += 1
            try:
                yield self.db
            except BaseException:
                self.db.execute(f"ROLLBACK TO {savepoint}")
                self._totals.clear()
                self.db.execute(f"RELEASE {savepoint}")
                raise
            else:
                self.db.execute(f"RELEASE {savepoint}")
            finally:
                self._depth -= 1
            return
        self.db.execute("BEGIN IMMEDIATE")
        self._depth = 1
        try:
            yield self.db
        except BaseException:
            self.db.execute("ROLLBACK")
            self._totals.clear()
            raise
        else:
            self.db.execute("COMMIT")
            if durable:
                self.sync()
        finally:
            self._depth = 0

    def _q(self, sql: str, args: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        return self.db.execute(sql, args).fetchall()

    def _one(self, sql: str, args: tuple[Any, ...] = ()) -> sqlite3.Row | None:
        return self.db.execute(sql, args).fetchone()

    def schema_version(self) -> int:
        has = self._one("SELECT name FROM sqlite_master WHERE type='table' AND name='schema_version'")
        if not has:
            return 0
        row = self._one("SELECT version FROM schema_version")
        return int(row["version"]) if row else 0

    def _migrate(self, target: int) -> None:
        current = self.schema_version()
        self.migrated_from = current
        if current > SCHEMA_VERSION:
            raise StoreError(
                f"{self.path} has schema version {current}, newer than this murmur knows "
                f"({SCHEMA_VERSION}); run a newer murmur against it"
            )
        if current == 0 and self._one("SELECT name FROM sqlite_master WHERE type='table'"):
            raise StoreError(f"{self.path} holds tables that are not a murmur ledger; use another --db path")
        if current >= target:
            return
        self.db.execute("BEGIN IMMEDIATE")
        try:
            if current == 0:
                self.db.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
                self.db.execute("INSERT INTO schema_version VALUES (0)")
            for version in range(current, target):
                for statement in _statements(MIGRATIONS[version]):
                    self.db.execute(statement)
                self.db.execute("UPDATE schema_version SET version = ?", (version + 1,))
            self.db.execute("COMMIT")
            self.sync()
        except BaseException:
            self.db.execute("ROLLBACK")
            raise

    # --- counters and events -------------------------------------------------------------------

    def bump(self, name: str, by: int = 1) -> None:
        self.db.execute(
            "INSERT INTO counters(name, value) VALUES (?, ?) "
            "ON CONFLICT(name) DO UPDATE SET value = value + excluded.value",
            (name, by),
        )

    def set_counter(self, name: str, value: int) -> None:
        self.db.execute(
            "INSERT INTO counters(name, value) VALUES (?, ?) ON CONFLICT(name) DO UPDATE SET value = excluded.value",
            (name, value),
        )

    def counter(self, name: str) -> int:
        row = self._one("SELECT value FROM counters WHERE name = ?", (name,))
        return int(row["value"]) if row else 0

    def counters(self) -> dict[str, int]:
        return {r["name"]: int(r["value"]) for r in self._q("SELECT name, value FROM counters")}

    def event(self, kind: str, *, run_id: str = "", node_id: str = "", at: float | None = None, **detail: Any) -> None:
        self.db.execute(
            "INSERT INTO events(at, run_id, kind, node_id, detail_json) VALUES (?, ?, ?, ?, ?)",
            (time.time() if at is None else at, run_id, kind, node_id, json.dumps(detail, sort_keys=True)),
        )

    def events(self, *, run_id: str = "", after_seq: int = 0, limit: int = 100, kind: str = "") -> list[Any]:
        sql = "SELECT * FROM events WHERE seq > ?"
        args: list[Any] = [after_seq]
        if run_id:
            sql += " AND run_id = ?"
            args.append(run_id)
        if kind:
            sql += " AND kind = ?"
            args.append(kind)
        # The newest `limit` events, shown oldest first.
        rows = self._q(sql + " ORDER BY seq DESC LIMIT ?", (*args, limit))
        return list(reversed(rows))

    # --- stage leases --------------------------------------------------------------------------

    def stage_leases(self, run_id: str = "") -> list[sqlite3.Row]:
        if run_id:
            return self._q("SELECT * FROM stage_leases WHERE run_id = ? ORDER BY node_id", (run_id,))
        return self._q("SELECT * FROM stage_leases ORDER BY node_id")

    def put_stage_lease(
        self, node_id: str, run_id: str, stage: int, state: str, from_stage: int, reason: str, since: float
    ) -> None:
        self.db.execute(
            "INSERT INTO stage_leases(node_id, run_id, stage, state, from_stage, reason, since) "
            "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT(node_id) DO UPDATE SET run_id = excluded.run_id, "
            "stage = excluded.stage, state = excluded.state, from_stage = excluded.from_stage, "
            "reason = excluded.reason, since = excluded.since",
            (node_id, run_id, stage, state, from_stage, reason, since),
        )

    def drop_stage_lease(self, node_id: str) -> None:
        self.db.execute("DELETE FROM stage_leases WHERE node_id = ?", (node_id,))

    # --- runs ----------------------------------------------------------------------------------

    def insert_run(
        self,
        run_id: str,
        name: str,
        config_toml: str,
        manifest_json: str,
        shards: list[tuple[int, str, int]],
        now: float,
    ) -> None:
        self.db.execute(
            "INSERT INTO runs VALUES (?, ?, ?, ?, 'active', ?)",
            (run_id, name, config_toml, manifest_json, now),
        )
        self.db.executemany(
            "INSERT INTO shards(run_id, shard_id, name, tokens, done) VALUES (?, ?, ?, ?, ?)",
            [(run_id, i, n, t, int(t == 0)) for i, n, t in shards],
        )
        self._totals.pop(run_id, None)

    def run(self, run_id: str) -> sqlite3.Row | None:
        return self._one("SELECT * FROM runs WHERE run_id = ?", (run_id,))

    def runs(self) -> list[sqlite3.Row]:
        return self._q("SELECT * FROM runs ORDER BY created_at")

    def set_run_state(self, run_id: str, state: str) -> None:
        self.db.execute("UPDATE runs SET state = ? WHERE run_id = ?", (state, run_id))

    def run_totals(self, run_id: str) -> dict[str, int]:
        """The run's shards_total, shards_done, tokens_total and tokens_committed (a copy)."""
        totals = self._totals.get(run_id)
        if totals is None:
            row = self._one(
                "SELECT COUNT(*) AS shards_total, COALESCE(SUM(done), 0) AS shards_done, "
                "COALESCE(SUM(tokens), 0) AS tokens_total, "
                "COALESCE(SUM(committed_offset), 0) AS tokens_committed "
                "FROM shards WHERE run_id = ?",
                (run_id,),
            )
            assert row is not None
            totals = self._totals[run_id] = {k: int(row[k]) for k in row.keys()}  # noqa: SIM118 - a Row
        return dict(totals)

    def last_round(self, run_id: str) -> sqlite3.Row | None:
        return self._one("SELECT * FROM rounds WHERE run_id = ? ORDER BY outer_step DESC LIMIT 1", (run_id,))

    def round_times(self, run_id: str, limit: int) -> list[float]:
        """When each of the newest ``limit`` rounds completed (its last commit), oldest first."""
        rows = self._q("SELECT last_at FROM rounds WHERE run_id = ? ORDER BY outer_step DESC LIMIT ?", (run_id, limit))
        return sorted(float(r["last_at"]) for r in rows)

    def refusals_since(self, run_id: str, since: float) -> list[sqlite3.Row]:
        """Per kind (round_refused, commit_refused): how many since ``since`` and the newest one's detail."""
        # SQLite's bare column beside MAX(): detail_json comes from the row holding the newest seq.
        return self._q(
            "SELECT kind, COUNT(*) AS n, MAX(seq) AS seq, detail_json FROM events "
            "WHERE run_id = ? AND at >= ? AND kind IN ('round_refused', 'commit_refused') "
            "GROUP BY kind ORDER BY kind DESC",
            (run_id, since),
        )

    def last_val_loss(self, run_id: str) -> float | None:
        """The validation loss of the newest round a node evaluated, or None."""
        row = self._one(
            "SELECT val_sum / val_n AS v FROM rounds WHERE run_id = ? AND val_n > 0 ORDER BY outer_step DESC LIMIT 1",
            (run_id,),
        )
        return float(row["v"]) if row else None

    def round_count(self, run_id: str) -> int:
        row = self._one("SELECT COUNT(*) AS n FROM rounds WHERE run_id = ?", (run_id,))
        return int(row["n"]) if row else 0

    def committed_since(self, run_id: str, since: float) -> tuple[int, float | None]:
        """Tokens committed since ``since`` and the time of the first of those commits."""
        row = self._one(
            "SELECT COALESCE(SUM(end_offset - start_offset), 0) AS n, MIN(at) AS first "
            "FROM commits WHERE run_id = ? AND at >= ?",
            (run_id, since),
        )
        assert row is not None
        return int(row["n"]), row["first"]

    def bytes_sent(self, run_id: str) -> int:
        row = self._one("SELECT COALESCE(SUM(bytes_sent), 0) AS b FROM rounds WHERE run_id = ?", (run_id,))
        return int(row["b"]) if row else 0

    # --- tokens --------------------------------------------------------------------------------

    def insert_token(
        self,
        token_id: str,
        run_id: str,
        secret_hash: str,
        now: float,
        expires_at: float,
        uses: int,
        note: str,
    ) -> None:
        self.db.execute(
            "INSERT INTO tokens VALUES (?, ?, ?, ?, ?, ?, ?, 0, ?)",
            (token_id, run_id, secret_hash, now, expires_at, uses, uses, note),
        )

    def token(self, token_id: str) -> sqlite3.Row | None:
        return self._one("SELECT * FROM tokens WHERE token_id = ?", (token_id,))

    def tokens(self, run_id: str = "") -> list[sqlite3.Row]:
        if run_id:
            return self._q("SELECT * FROM tokens WHERE run_id = ? ORDER BY created_at", (run_id,))
        return self._q("SELECT * FROM tokens ORDER BY created_at")

    def use_token(self, token_id: str) -> None:
        self.db.execute("UPDATE tokens SET uses_left = uses_left - 1 WHERE token_id = ?", (token_id,))

    def revoke_token(self, token_id: str) -> None:
        self.db.execute("UPDATE tokens SET revoked = 1 WHERE token_id = ?", (token_id,))

    # --- nodes ---------------------------------------------------------------------------------

    def upsert_node(
        self, node_id: str, run_id: str, cert_pem: str, hardware_json: str, peer_address: str, now: float,
        name: str = "",
    ) -> None:
        self.db.execute(
            "INSERT INTO nodes(node_id, run_id, cert_pem, status, joined_at, last_heartbeat, hardware_json, "
            "peer_address, name) VALUES (?, ?, ?, 'active', ?, ?, ?, ?, ?) "
            "ON CONFLICT(node_id) DO UPDATE SET run_id = excluded.run_id, cert_pem = excluded.cert_pem, "
            "status = 'active', last_heartbeat = excluded.last_heartbeat, "
            "hardware_json = excluded.hardware_json, peer_address = excluded.peer_address, name = excluded.name",
            (node_id, run_id, cert_pem, now, now, hardware_json, peer_address, name),
        )

    def node(self, node_id: str) -> sqlite3.Row | None:
        return self._one("SELECT * FROM nodes WHERE node_id = ?", (node_id,))

    def nodes(self, run_id: str = "", status: str = "") -> list[sqlite3.Row]:
        sql, args = "SELECT * FROM nodes WHERE 1=1", []
        if run_id:
            sql += " AND run_id = ?"
            args.append(run_id)
        if status:
            sql += " AND status = ?"
            args.append(status)
        return self._q(sql + " ORDER BY joined_at", tuple(args))

    def nodes_by_status(self, run_id: str = "") -> dict[str, int]:
        sql = "SELECT status, COUNT(*) AS n FROM nodes"
        rows = self._q(
            sql + (" WHERE run_id = ? GROUP BY status" if run_id else " GROUP BY status"),
            (run_id,) if run_id else (),
        )
        return {r["status"]: int(r["n"]) for r in rows}

    def heartbeat(self, node_id: str, now: float, tokens_per_s: float) -> None:
        self.db.execute(
            "UPDATE nodes SET last_heartbeat = ?, tokens_per_s = ? WHERE node_id = ?",
            (now, tokens_per_s, node_id),
        )

    def heartbeats(self, rows: list[tuple[str, float, float]], lease_ttl_s: float) -> None:
        """Batch of (node id, last heartbeat, tokens/s); renews the leases those nodes hold."""
        self.db.executemany(
            "UPDATE nodes SET last_heartbeat = ?, tokens_per_s = ? WHERE node_id = ?",
            [(at, tps, node_id) for node_id, at, tps in rows],
        )
        self.db.executemany(
            "UPDATE shards SET lease_expiry = ? WHERE holder = ?",
            [(at + lease_ttl_s, node_id) for node_id, at, _ in rows],
        )

    def set_node_status(self, node_id: str, status: str, ban_reason: str | None = None) -> None:
        if ban_reason is None:
            self.db.execute("UPDATE nodes SET status = ? WHERE node_id = ?", (status, node_id))
        else:
            self.db.execute(
                "UPDATE nodes SET status = ?, ban_reason = ? WHERE node_id = ?", (status, ban_reason, node_id)
            )

    def banned(self) -> dict[str, str]:
        return {
            r["node_id"]: r["ban_reason"]
            for r in self._q("SELECT node_id, ban_reason FROM nodes WHERE status = 'banned' ORDER BY node_id")
        }

    def node_rounds(self, node_id: str) -> int:
        """The rounds (outer steps) in which this node's commits were accepted."""
        row = self._one("SELECT COUNT(DISTINCT outer_step) AS n FROM commits WHERE node_id = ?", (node_id,))
        return int(row["n"]) if row else 0

    def node_totals(self, node_id: str) -> tuple[int, int]:
        row = self._one(
            "SELECT COALESCE(SUM(end_offset - start_offset), 0) AS t, COALESCE(SUM(bytes_sent), 0) AS b "
            "FROM commits WHERE node_id = ?",
            (node_id,),
        )
        assert row is not None
        return int(row["t"]), int(row["b"])

    def record_rejections(self, run_id: str, reporter: str, rejected: list[tuple[str, int, str]]) -> int:
        """(sender, round, reason) of updates ``reporter`` refused, as ``update_rejected`` events of
        the sender; senders that are not nodes of ``run_id`` are skipped. Call inside write()."""
        members = {r["node_id"] for r in self._q("SELECT node_id FROM nodes WHERE run_id = ?", (run_id,))}
        kept = [(sender, rnd, why) for sender, rnd, why in rejected if sender in members]
        now = time.time()
        for sender, rnd, why in kept:
            self.event("update_rejected", run_id=run_id, node_id=sender, at=now, round=rnd, reason=why, by=reporter)
        if kept:
            self.bump("updates_rejected", len(kept))
        return len(kept)

    def updates_rejected(self, node_id: str) -> int:
        """In how many rounds some owner refused this node's update (reports of one round count once)."""
        row = self._one(
            "SELECT COUNT(DISTINCT json_extract(detail_json, '$.round')) AS n FROM events "
            "WHERE kind = 'update_rejected' AND node_id = ?",
            (node_id,),
        )
        return int(row["n"]) if row else 0

    def push_deadlines(self, now: float, grace: float) -> None:
        """After a restart: nobody could heartbeat while we were down, so nobody is late yet."""
        self.db.execute("UPDATE nodes SET last_heartbeat = MAX(last_heartbeat, ?) WHERE status = 'active'", (now,))
        self.db.execute(
            "UPDATE shards SET lease_expiry = MAX(lease_expiry, ?) WHERE lease_id IS NOT NULL", (now + grace,)
        )

    # --- shards and leases ---------------------------------------------------------------------

    def shard(self, run_id: str, shard_id: int) -> Shard | None:
        row = self._one("SELECT * FROM shards WHERE run_id = ? AND shard_id = ?", (run_id, shard_id))
        return _shard(row) if row else None

    def shards(self, run_id: str) -> list[Shard]:
        return [_shard(r) for r in self._q("SELECT * FROM shards WHERE run_id = ? ORDER BY shard_id", (run_id,))]

    def shards_held(self, node_id: str) -> list[Shard]:
        return [_shard(r) for r in self._q("SELECT * FROM shards WHERE holder = ? ORDER BY shard_id", (node_id,))]

    def free_shard(self, run_id: str) -> Shard | None:
        """A shard nobody holds that is not done. Interrupted shards first (a lost node's work is
        resumed before fresh shards are opened, so partly trained shards do not pile up), then by id.
        The index shards_free (v6) holds exactly this order: keep the two in step."""
        row = self._one(
            "SELECT * FROM shards WHERE run_id = ? AND holder IS NULL AND done = 0 "
            "ORDER BY committed_offset > 0 DESC, shard_id LIMIT 1",
            (run_id,),
        )
        return _shard(row) if row else None

    def set_lease(self, run_id: str, shard_id: int, holder: str, lease_id: str, expiry: float) -> None:
        self.db.execute(
            "UPDATE shards SET holder = ?, lease_id = ?, lease_expiry = ? WHERE run_id = ? AND shard_id = ?",
            (holder, lease_id, expiry, run_id, shard_id),
        )

    def clear_lease(self, run_id: str, shard_id: int) -> None:
        self.db.execute(
            "UPDATE shards SET holder = NULL, lease_id = NULL, lease_expiry = NULL WHERE run_id = ? AND shard_id = ?",
            (run_id, shard_id),
        )

    def expired_leases(self, now: float) -> list[Shard]:
        return [
            _shard(r) for r in self._q("SELECT * FROM shards WHERE lease_id IS NOT NULL AND lease_expiry < ?", (now,))
        ]

    def advance(self, shard: Shard, end_offset: int, done: bool) -> None:
        """``shard`` (as its caller read it in this transaction) committed up to ``end_offset``."""
        self.db.execute(
            "UPDATE shards SET committed_offset = ?, done = ? WHERE run_id = ? AND shard_id = ?",
            (end_offset, int(done), shard.run_id, shard.shard_id),
        )
        totals = self._totals.get(shard.run_id)
        if totals is not None:
            totals["tokens_committed"] += end_offset - shard.committed_offset
            totals["shards_done"] += int(done) - int(shard.done)

    # --- commits, rounds, checkpoints ----------------------------------------------------------

    def commit_record(self, lease_id: str, end_offset: int) -> sqlite3.Row | None:
        return self._one("SELECT * FROM commits WHERE lease_id = ? AND end_offset = ?", (lease_id, end_offset))

    def insert_commit(
        self,
        *,
        lease_id: str,
        end_offset: int,
        run_id: str,
        shard_id: int,
        node_id: str,
        start_offset: int,
        outer_step: int,
        loss: float,
        bytes_sent: int,
        seconds: float,
        at: float,
        val_loss: float | None = None,
    ) -> None:
        self.db.execute(
            "INSERT INTO commits VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                lease_id,
                end_offset,
                run_id,
                shard_id,
                node_id,
                start_offset,
                outer_step,
                loss,
                bytes_sent,
                seconds,
                at,
            ),
        )
        self.db.execute(
            "INSERT INTO rounds(run_id, outer_step, commits, tokens, loss_sum, bytes_sent, first_at, last_at, "
            "val_sum, val_n) VALUES (?, ?, 1, ?, ?, ?, ?, ?, ?, ?) "
            "ON CONFLICT(run_id, outer_step) DO UPDATE SET commits = commits + 1, "
            "tokens = tokens + excluded.tokens, loss_sum = loss_sum + excluded.loss_sum, "
            "bytes_sent = bytes_sent + excluded.bytes_sent, last_at = excluded.last_at, "
            "val_sum = val_sum + excluded.val_sum, val_n = val_n + excluded.val_n",
            (run_id, outer_step, end_offset - start_offset, loss, bytes_sent, at, at,
             val_loss or 0.0, int(val_loss is not None)),
        )

    def commits_of_shard(self, run_id: str, shard_id: int) -> list[sqlite3.Row]:
        return self._q(
            "SELECT * FROM commits WHERE run_id = ? AND shard_id = ? ORDER BY start_offset",
            (run_id, shard_id),
        )

    def insert_checkpoint(self, run_id: str, step: int, location: str, sha256: str, node_id: str, at: float) -> None:
        self.db.execute(
            "INSERT OR REPLACE INTO checkpoints VALUES (?, ?, ?, ?, ?, ?)",
            (run_id, step, location, sha256, node_id, at),
        )

    def checkpoints(self, run_id: str) -> list[sqlite3.Row]:
        return self._q("SELECT * FROM checkpoints WHERE run_id = ? ORDER BY step", (run_id,))

    # --- read-only views for the status page and /metrics ---------------------------------------

    def rounds_total(self) -> int:
        row = self._one("SELECT COUNT(*) AS n FROM rounds")
        return int(row["n"]) if row else 0

    def leases_held(self) -> int:
        row = self._one("SELECT COUNT(*) AS n FROM shards WHERE lease_id IS NOT NULL")
        return int(row["n"]) if row else 0

    def bytes_sent_by_run(self) -> list[sqlite3.Row]:
        """(run_id, config_toml, bytes_sent) of every run, the bytes its commits reported."""
        return self._q(
            "SELECT r.run_id, r.config_toml, COALESCE(SUM(o.bytes_sent), 0) AS bytes_sent "
            "FROM runs r LEFT JOIN rounds o ON o.run_id = r.run_id GROUP BY r.run_id ORDER BY r.created_at"
        )

    def node_summaries(self, run_id: str = "") -> list[sqlite3.Row]:
        """One row per node: its ledger row's fields plus what its commits and events add up to
        (tokens, bytes_sent, round: the highest outer step it committed, joins, commits_refused)."""
        return self._q(
            "SELECT n.node_id, n.run_id, n.status, n.joined_at, n.last_heartbeat, n.tokens_per_s, "
            "COALESCE(c.tokens, 0) AS tokens, COALESCE(c.bytes_sent, 0) AS bytes_sent, "
            "COALESCE(c.round, 0) AS round, COALESCE(e.joins, 0) AS joins, "
            "COALESCE(e.refused, 0) AS commits_refused "
            "FROM nodes n "
            "LEFT JOIN (SELECT node_id, SUM(end_offset - start_offset) AS tokens, SUM(bytes_sent) AS bytes_sent, "
            "MAX(outer_step) AS round FROM commits GROUP BY node_id) c ON c.node_id = n.node_id "
            "LEFT JOIN (SELECT node_id, SUM(kind = 'join') AS joins, SUM(kind = 'commit_refused') AS refused "
            "FROM events WHERE kind IN ('join', 'commit_refused') GROUP BY node_id) e ON e.node_id = n.node_id "
            "WHERE ? = '' OR n.run_id = ? ORDER BY n.joined_at",
            (run_id, run_id),
        )

    def round_history(self, run_id: str, limit: int = 500) -> list[sqlite3.Row]:
        """The newest ``limit`` rounds of a run, oldest first: step, mean loss, tokens, bytes, time."""
        rows = self._q(
            "SELECT outer_step, loss_sum / commits AS loss, tokens, bytes_sent, commits, last_at, "
            "CASE WHEN val_n > 0 THEN val_sum / val_n END AS val_loss "
            "FROM rounds WHERE run_id = ? ORDER BY outer_step DESC LIMIT ?",
            (run_id, limit),
        )
        return list(reversed(rows))

    def node_round_losses(self, run_id: str, from_step: int) -> list[sqlite3.Row]:
        """Each node's mean training loss per round from ``from_step`` on: (node_id, outer_step, loss),
        by round. The page draws one thin line per node beside the run's mean."""
        return self._q(
            "SELECT node_id, outer_step, AVG(loss) AS loss FROM commits WHERE run_id = ? AND outer_step >= ? "
            "GROUP BY node_id, outer_step ORDER BY outer_step",
            (run_id, from_step),
        )

    # --- consistency ---------------------------------------------------------------------------

    def check_consistency(self) -> list[str]:
        """Invariants of the ledger; empty when it is consistent (tests and `serve` at start use it)."""
        problems = []
        for shard in self._q("SELECT * FROM shards"):
            commits = self.commits_of_shard(shard["run_id"], shard["shard_id"])
            offset = 0
            for c in commits:
                if c["start_offset"] != offset:
                    problems.append(
                        f"shard {shard['run_id']}/{shard['shard_id']}: commit {c['start_offset']}.."
                        f"{c['end_offset']} does not follow offset {offset}"
                    )
                offset = c["end_offset"]
            if offset != shard["committed_offset"]:
                problems.append(
                    f"shard {shard['run_id']}/{shard['shard_id']}: commits reach {offset}, "
                    f"committed_offset is {shard['committed_offset']}"
                )
            if (shard["holder"] is None) != (shard["lease_id"] is None):
                problems.append(f"shard {shard['run_id']}/{shard['shard_id']}: holder and lease disagree")
        return problems


def _statements(script: str) -> list[str]:
    # executescript() would COMMIT our transaction; split and run the statements one by one instead.
    return [s.strip() for s in script.split(";") if s.strip()]
