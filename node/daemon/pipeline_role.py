"""`murmur node run` against a pipelined run: the volunteer serves a stage or drives, never the
whole model data parallel.

A run whose config has a ``[pipeline]`` section is trained by stage peers and drivers
(docs/pipeline.md). The node joins as it always does (node/daemon/node.py: the device and data
checks first, the token once, the identity in the state folder), sees the run config's
``[pipeline]`` section and hands over; instead of training data parallel, this runs the stage peer
(node/pipeline/stage_peer_process.py) or the driver (node/pipeline/driver_process.py) in this
process, with the membership it holds. ``--role`` chooses:

- ``stage``: serve a stage; the coordinator assigns which one and may move it later.
- ``driver``: lease shards and send their microbatches through the stages (needs the data).
- ``auto`` (default): the coordinator decides. The volunteer asks for a lease; the coordinator
  grants leases of a pipelined run to at most ``pipeline.drivers`` nodes at once
  (coordinator/leases.py), so it drives when it gets one and serves a stage when it is refused
  (or when the run wants no drivers from volunteers, ``pipeline.drivers = 0``).

A data-parallel run is left to the node as before (``--role auto``); ``--role stage`` or
``driver`` against it is an error. SIGTERM or Ctrl+C: the stage peer stops serving, or the driver
stops with what it committed; then the volunteer leaves the run, as a data-parallel node does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
from pathlib import Path

from murmur.errors import MurmurError
from murmur.node.daemon.node import NodeOptions, PipelinedRun, run_node
from murmur.node.daemon.session import contribution
from murmur.node.daemon.state_dir import JoinRecord, StateDir
from murmur.node.model.data import Dataset
from murmur.node.net.addresses import advertised
from murmur.protocol import identity
from murmur.protocol.coordinator_client import CoordinatorError, MemberClient
from murmur.protocol.runconfig import RunConfig, parse_config

ROLES = ("auto", "stage", "driver")
COMMITS_LOG_EVERY_S = 10.0  # a driver commits every microbatch range: one summary line this often
QUIET_EVENTS = ("microbatch",)  # one a microbatch: the driver's commits and val lines say how it goes


class RoleError(MurmurError):
    pass


def run_volunteer(options: NodeOptions) -> int:
    """The node (node/daemon/node.py) joins and trains a data-parallel run; a pipelined one it
    hands over, its membership saved, to a stage peer or a driver here."""
    try:
        return run_node(options)
    except PipelinedRun as handed:
        # SIGTERM from here on ends the pipeline role cleanly (the node's loop, which held the
        # signal while it joined, is gone).
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        stopped, run_id, rejoined = handed.stopped, handed.run_id, handed.rejoined
    state = StateDir(options.state_dir)
    saved = state.load_join()
    if saved is None:  # the node saves its join before it reads the run config
        raise RoleError(f"{state.root} lost the membership of run {run_id}")
    info, ident, config_toml = saved
    cfg = parse_config(config_toml, "the run configuration")
    state.lock()
    try:
        volunteer = PipelineVolunteer(options, state, info, ident, cfg, config_toml, rejoined=rejoined)
        if stopped:  # a SIGTERM while it joined: leave at once, as the node does
            volunteer.log("stopping: SIGTERM while joining")
            asyncio.run(volunteer.leave("stopped while joining"))
            return 0
        if options.gpus > 1:
            raise RoleError(f"run {info.run_id} is pipelined: one process serves one stage or drives, "
                            f"so --gpus {options.gpus} has no use; start one node per GPU (--device cuda:N)")
        return volunteer.run(options.role)
    finally:
        state.unlock()


class PipelineVolunteer:
    def __init__(self, options: NodeOptions, state: StateDir, info: JoinRecord, ident: identity.Identity,
                 cfg: RunConfig, config_toml: str, *, rejoined: bool = False) -> None:
        self.o, self.state, self.record, self.ident, self.cfg = options, state, info, ident, cfg
        self.rejoined = rejoined  # a restart: the coordinator lists this node id at its old addresses
        self.stopped_by = ""  # a signal the role's own loop took (the driver's SIGTERM)
        self.log = options.log
        self.info = info.join_info(config_toml)
        self._commits = {"ranges": 0, "tokens": 0, "logged_at": 0.0}

    def run(self, role: str) -> int:
        stop = {"signal": ""}

        def interrupted(signum, frame):  # until the stage peer's loop takes the signal over
            stop["signal"] = signal.Signals(signum).name
            raise KeyboardInterrupt

        # SIGTERM ends the driver as Ctrl+C does (its own main does the same); a stage peer's loop
        # takes SIGTERM over once it serves.
        signal.signal(signal.SIGTERM, interrupted)
        try:
            if role == "auto":
                role = asyncio.run(self._choose())
            code = self._drive() if role == "driver" else self._serve_stage()
        except KeyboardInterrupt:
            code = 130
        if code == 130:  # stopped by SIGTERM or Ctrl+C: a clean stop, as the data-parallel node's
            self.log("stopping: " + (stop["signal"] or self.stopped_by or "interrupted"))
            code = 0
        asyncio.run(self.leave("stopped" if code == 0 else f"the {role} failed"))
        return code

    # -- the role ---------------------------------------------------------------------------------

    def _client(self) -> MemberClient:
        return MemberClient(self.info.node_address, self.ident, server_name=self.info.tls_server_name,
                            reconnect_backoff_s=self.info.heartbeat_interval_s)

    async def _choose(self) -> str:
        """``--role auto``: a lease under the coordinator's cap makes a driver, else a stage peer."""
        wanted = self.cfg.pipeline.drivers
        if not wanted:
            self.log("role: stage peer (the run wants no drivers from volunteers: pipeline.drivers = 0)")
            return "stage"
        client = self._client()
        try:
            reply = await client.acquire()
        except CoordinatorError as err:
            raise RoleError(f"cannot ask the coordinator for a lease to choose this node's role: {err}") from None
        finally:
            await client.close()
        if reply.granted:  # the driver's first acquire gets this lease back (coordinator/leases.py)
            self.log(f"role: driver (the coordinator granted a lease: the run wants {wanted} driver(s))")
            return "driver"
        self.log(f"role: stage peer (no lease: {reply.reason})")
        return "stage"

    def _stage_addresses(self) -> list[str]:
        """Where the stage peer's two servers bind and what they advertise: the ``--listen`` host,
        the stage service on its port and the peer server on the next one (both the kernel's choice
        for port 0), reported under ``--advertise-host`` (node/net/addresses.py's rule). One flag a
        volunteer already sets for a data-parallel run, and a pair of adjacent ports to forward
        (compose's node exposes 7800 and 7801)."""
        host, _, port = self.o.listen.rpartition(":")
        try:
            p = int(port or 0)
        except ValueError:
            raise RoleError(f"--listen {self.o.listen}: {port!r} is not a port") from None
        if not 0 <= p <= 65534:  # the peer server takes the next one
            raise RoleError(f"--listen {self.o.listen}: the stage service's port must be 0-65534 (the peer server "
                            "takes the next one)")
        return ["--host", host or "127.0.0.1", "--port", str(p), "--state-port", str(p + 1 if p else 0),
                "--advertise-host", advertised(host, self.o.advertise_host)]

    def _common(self) -> list[str]:
        import torch  # loaded already by the node

        # --threads 0 means torch's default here as for a data-parallel node (the stage peer's and
        # the driver's own default is 1, for tests that crowd processes on a machine)
        return ["--coordinator", self.o.coordinator, "--device", self.o.device,
                "--threads", str(self.o.threads or torch.get_num_threads())]

    def _joined(self):
        from murmur.node.pipeline.member import PipelineMember

        def member() -> PipelineMember:
            m = PipelineMember.joined(self.ident, self.info)
            # A stage peer restarted with its folder reports "no stage yet" before it loads its
            # stage, so no driver dials the killed process's address meanwhile (node/pipeline/stage_peer.py).
            m.rejoined = self.rejoined
            return m

        return member

    def _serve_stage(self) -> int:
        from murmur.node.pipeline import stage_peer_process

        self.log(f"serving a stage of run {self.info.run_id} on {self.o.device} "
                 f"({self.cfg.pipeline.stages} stages; the coordinator assigns this node's)")
        stage_peer_process.SINK = self._record
        # The node's own state folder keeps its stage's checkpoints: a volunteer restarted with it
        # takes its stage back from disk when every other peer of it is gone.
        argv = self._common() + [*self._stage_addresses(), "--state-dir", str(self.state.root)]
        return stage_peer_process.main(argv, joined=self._joined())

    def _drive(self) -> int:
        from murmur.node.pipeline import driver_process

        data = self.o.data or Path(self.cfg.data.path)
        dataset = Dataset.open(data)
        if dataset.tokenizer != self.cfg.data.tokenizer:
            raise RoleError(f"{data} holds {dataset.tokenizer} tokens but the run uses {self.cfg.data.tokenizer}")
        self.log(f"driving run {self.info.run_id} with the data in {data} ({self.cfg.pipeline.stages} stages)")
        driver_process.SINK = self._record
        argv = self._common() + ["--data", str(data)]  # the microbatch size and the rest: the run config's
        code = driver_process.main(argv, joined=self._joined())
        self.stopped_by = driver_process.STOPPED_BY
        return code

    # -- log lines ----------------------------------------------------------------------------------

    def _record(self, record: dict) -> None:
        """A stage peer's or driver's record as one stamped log line (``EVENT {json}``); a driver's
        commits are summed into a line every COMMITS_LOG_EVERY_S."""
        event = str(record.get("event", "?"))
        if event in QUIET_EVENTS:
            return
        if event == "commit":
            c = self._commits
            c["ranges"] += 1
            c["tokens"] += int(record.get("tokens", 0))
            now = time.monotonic()
            if now - c["logged_at"] < COMMITS_LOG_EVERY_S and record.get("val_loss") is None:
                return
            c["logged_at"] = now
            record = {**record, "committed_tokens": c["tokens"], "committed_ranges": c["ranges"]}
        rest = {k: v for k, v in record.items() if k != "event"}
        self.log(f"{event} {json.dumps(rest)}")

    # -- leaving ------------------------------------------------------------------------------------

    async def leave(self, reason: str) -> None:
        client = self._client()
        try:
            reply = await asyncio.wait_for(client.leave(reason), self.o.settings.shutdown_grace_s)
            self.state.forget_join()  # a left node joins afresh next time, as a data-parallel node does
            self.log("left the run: " + contribution(reply))
        except (TimeoutError, CoordinatorError) as err:
            self.log(f"could not say goodbye to the coordinator ({err}); its membership expires on its own")
        finally:
            with contextlib.suppress(Exception):
                await client.close()

