"""The coordinator's heartbeat fronts (``--heartbeat-fronts N``): N processes that carry the nodes'
heartbeat streams, each node's on one of them (by a hash of its node id), named to the node in its
heartbeat replies (``HeartbeatReply.heartbeat_address``).

Why: a streamed heartbeat costs one Python process some 130 us of its loop thread in gRPC's own
machinery and 60-180 us more in gRPC's core threads, against some tens of us for the coordinator's
own rules; one process tops out near 8,000 heartbeats a second (docs/coordinator.md, "At scale").
A front does gRPC's part (coordinator/heartbeat_front.py) and hands this process the heartbeats
in batches over a Unix socket; this process answers each exactly as a heartbeat on its own
stream (service.front_beat): the same membership, leases, view, ban list and refusals, so no rule
moves and nothing is decided in a front. A beat is answered after it reached this process, as
before: a dead node is known dead as promptly, a restart is seen as before.

A front that dies is started again (its nodes' streams fail once, their next heartbeat goes to
the node address, whose reply names the new front); the fronts end when this process does (their
link closes). The socket is in a directory of this user's only (mode 0700), and it is the only
way into the link: a front's word for a node id is trusted because only a front can reach it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import sys
import zlib
from collections.abc import Callable
from pathlib import Path

from murmur.protocol import coordinator_pb2 as pb
from murmur.protocol.scratch_dirs import make_scratch_dir

from .heartbeat_front import FRAME
from .settings import CoordinatorSettings

START_TIMEOUT_S = 60.0  # a front's start under load (imports grpc and protobuf, binds its port)
RESTART_AFTER_S = 1.0  # between a front's death and its replacement


class FrontError(RuntimeError):
    pass


class HeartbeatFronts:
    def __init__(
        self,
        count: int,
        answer: Callable[[str, bytes], pb.FrontAnswer],
        key_file: Path,
        cert_file: Path,
        settings: CoordinatorSettings,
        log: Callable[[str], None],
    ) -> None:
        self.count = count
        self.answer = answer  # (node id, HeartbeatRequest bytes) -> the answer (service.front_beat)
        self.key_file, self.cert_file = key_file, cert_file
        self.settings = settings
        self.log = log
        self.host = "127.0.0.1"  # what the fronts bind (the node address's host), set by start
        self.advertise = "127.0.0.1"  # the host nodes dial, set by the server once it knows it
        self._ports: list[int] = [0] * count  # 0 while a front is down: its nodes use the node address
        self._procs: list[asyncio.subprocess.Process | None] = [None] * count
        self._dir = ""
        self._link: asyncio.AbstractServer | None = None
        self._watchers: list[asyncio.Task[None]] = []
        self._stopping = False
        self.batches = 0  # batches answered (for tests and the metrics' curious)

    def address_for(self, node_id: str) -> str:
        """The front this node's heartbeat stream goes to ("" none: the node address). A hash of the
        node id (crc32: the same in every process) over the fronts, so a node keeps its front."""
        if not self.count:
            return ""
        port = self._ports[zlib.crc32(node_id.encode()) % self.count]
        return f"{self.advertise}:{port}" if port else ""

    def addresses(self) -> list[str]:
        """Every front's address ("" for one that is down)."""
        return [f"{self.advertise}:{port}" if port else "" for port in self._ports]

    async def start(self, host: str) -> None:
        """Open the link and start every front; each binds ``host`` on a free port."""
        self.host = host
        self._dir = str(make_scratch_dir("murmur-fronts-"))  # mode 0700: this user only
        path = str(Path(self._dir) / "link")
        self._link = await asyncio.start_unix_server(self._serve_link, path)
        for i in range(self.count):
            await self._start_one(i, path)
            self._watchers.append(asyncio.create_task(self._watch(i, path)))

    async def _start_one(self, i: int, path: str) -> None:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "murmur.coordinator.heartbeat_front", "--link", path,
            "--listen", f"{self.host}:0", "--key", str(self.key_file), "--cert", str(self.cert_file),
            "--call-wait", str(self.settings.call_wait_s), "--max-message-bytes", str(self.settings.max_message_bytes),
            "--grace", str(self.settings.grpc_grace_s),
            stdout=asyncio.subprocess.PIPE,
        )
        self._procs[i] = proc
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), START_TIMEOUT_S)  # type: ignore[union-attr]
            self._ports[i] = int(json.loads(line)["port"])
        except (TimeoutError, ValueError, KeyError) as err:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise FrontError(f"heartbeat front {i} did not start ({err!r}); its stderr is above") from None

    async def _watch(self, i: int, path: str) -> None:
        """A front that ends while this process serves is started again (its nodes meanwhile
        heartbeat at the node address: its port is 0 until the new one listens)."""
        while not self._stopping:
            proc = self._procs[i]
            code = await proc.wait() if proc is not None else None
            self._ports[i] = 0
            if self._stopping:
                return
            self.log(f"warning: heartbeat front {i} ended (status {code}); starting another")
            await asyncio.sleep(RESTART_AFTER_S)
            try:
                await self._start_one(i, path)
            except (FrontError, OSError) as err:
                self.log(f"warning: {err}")

    async def _serve_link(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One front's link: a batch of heartbeats in, their answers out, in order."""
        try:
            while True:
                (size,) = FRAME.unpack(await reader.readexactly(FRAME.size))
                batch = pb.FrontBatch.FromString(await reader.readexactly(size))
                answers = pb.FrontAnswers(answers=[self.answer(b.node_id, b.request) for b in batch.beats])
                data = answers.SerializeToString()
                writer.write(FRAME.pack(len(data)) + data)
                self.batches += 1
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the front ended; its watcher starts another
        finally:
            writer.close()

    async def stop(self) -> None:
        """End every front (SIGTERM: each ends its streams with UNAVAILABLE) and the link."""
        self._stopping = True
        for proc in self._procs:
            if proc is not None and proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.terminate()
        for proc in self._procs:
            if proc is not None:
                try:
                    await asyncio.wait_for(proc.wait(), self.settings.grpc_grace_s + 10)
                except TimeoutError:
                    proc.kill()
                    await proc.wait()
        for watcher in self._watchers:
            watcher.cancel()
        if self._link is not None:
            self._link.close()
        shutil.rmtree(self._dir, ignore_errors=True)
