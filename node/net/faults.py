"""Fault injection owned by production code, keyed by (peer, round) (after torchft's EventInjector).

Tests, the chaos tool and ``--fault`` of the peer process arm faults here; the exchange strikes
them at its fault points, which are methods of the injector (delays) and of `CallFaults`, the
faults one call of one peer took when it started (everything else). Nothing subclasses or patches
the exchange to make it misbehave. An unarmed injector costs one list test per point.

Faults of a call (what this peer does wrong, as an attacker or a broken machine would):
  nan            the first chunk of its input carries a NaN
  wrong_shape    its payload declares another shape than the round's tensors
  corrupt        the payload bytes are garbage (not a protobuf)
  oversize       it declares and streams a payload beyond the receivers' size limit
  wrong_version  it speaks another protocol version
  stall          it still sends its inputs but never answers another member (a hung machine)
  lose_result    it loses the first reduced chunk it receives (a network cut), so it must catch up
  exit           it dies at once (SIGKILL) after sending its inputs: a SIGKILL seen from outside
  exit_midstream it dies (SIGKILL) halfway through streaming its input to the owners: a machine
                 lost mid-transfer.
  exit_before_input it dies (SIGKILL) once the round's members are met, before any input goes out:
                 a machine lost between announcing itself and sending, which the owners can only
                 learn from its address refusing them.
  exit_holding_input it dies (SIGKILL) when an ``open_input`` delay ends, before its stream to that
                 owner opens: with the delay armed for every owner (``delay:open_input:S@RxN``) it
                 answers the owners' calls for its own span meanwhile but never reaches them, so no
                 call of theirs to it fails and no stream of it breaks.
                 For the exits, peers that share one test process set ``die`` to a stand-in
                 (stop the server, close the channels): the call then ends with ExchangeError.
Poisoning (a hostile node; its whole update, before it is encoded; every chunk, every owner, the
span it owns itself included; a gather's payloads, encoded by the caller already, in the float
parts of their wire tensors). Its own error feedback stays that of its honest update:
  poison_scale   its update multiplied by 1e4
  poison_nan     its update all NaN (owners refuse it: the decoded values are not finite)
  poison_sign    its update sign-flipped
  poison_flip    its update sign-flipped and scaled 8x: the strongest flip that the norm pre-filter
                 (optim/aggregate.py drops 10x the round's median norm) lets through
  poison_random  its update replaced by Gaussian noise of the same RMS (seeded by peer, round and
                 position, so every owner sees the same noise)
Delays (``delay``: sleep SECONDS at a named point, each time the point is reached while armed):
  rendezvous     before this peer asks its group who is in the round
  open_input     before this peer opens its stream to one owner (``target``: that owner only)
  send_input     before this peer streams its input to one owner, the stream open (``target`` too)
  snapshot_piece before each piece of a reduce's update is copied (node/exchange/snapshot.py)
  stage_compute  before a stage peer computes a Forward or Backward (node/pipeline/service.py)
  peer_lookup    before a node looks its peers' records up in the DHT (node/daemon/peer_dataplane.py):
                 a joiner whose DHT is slow or unreachable sees nobody in time
  checkpoint     before a node writes the local checkpoint that holds a round (its own, or a newer
                 round's that replaced it: node/daemon/round_handoff.py): a slow disk between a
                 round's end and its commit
  lost_rounds    after the coordinator granted a node the number of rounds lost with their holders,
                 before it goes on as that round and publishes its state (node/daemon/resume.py):
                 a restart slow enough that another one, back at the same moment, claims too
  group_gather   before this peer joins its group's gather (phase C of a grouped round,
                 node/exchange/hierarchy.py): a column holder too slow for its group-mates, who
                 then fetch its columns' results from the other groups' holders
  build_model    before a node builds its model and optimizer (node/daemon/training_thread.py's
                 prepare, beside its DHT's start): a large model on a slow machine

A slow machine (``slow``: each inner step of a node's training takes FACTOR times as long; after
each step the node sleeps FACTOR - 1 times the step's own time, node/daemon/training_thread.py):
  slow:FACTOR    ``slow:3@x*`` a node 3x slower for the whole run; ``slow:3@x40`` for its first 40
                 steps, then at its own speed (a volunteer whose machine got busy, then free)

A delay sleeps its SECONDS, or until the process gets SIGUSR1 (``--fault`` arms it; `release`):
a test holds a point with a long delay and lets it go once what it waits for has happened.

Spec strings (the command line, `FaultInjector.parse`): ``fault[@ROUND][xTIMES]`` and, for a
delay, ``delay:POINT:SECONDS[@ROUND][xTIMES]``; TIMES ``*`` fires every time. For example
``exit_midstream@2``, ``lose_result@1x2``, ``poison_sign@1x*``, ``delay:rendezvous:5@1``.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from murmur.optim.exchange import ExchangeError
from murmur.optim.wire import WireTensor
from murmur.protocol import peer_pb2

POISONS = ("poison_scale", "poison_nan", "poison_sign", "poison_flip", "poison_random")
CALL_FAULTS = (
    "nan",
    "wrong_shape",
    "corrupt",
    "oversize",
    "wrong_version",
    "stall",
    "lose_result",
    "exit",
    "exit_midstream",
    "exit_before_input",
    "exit_holding_input",
    *POISONS,
)
FAULTS = (*CALL_FAULTS, "delay", "slow")
DELAY_POINTS = (
    "rendezvous", "open_input", "send_input", "snapshot_piece", "stage_compute", "peer_lookup", "checkpoint",
    "build_model", "lost_rounds", "group_gather",
)
ANY = "*"
RELEASE_POLL_S = 0.1  # how soon a sleeping delay sees `release` (a signal handler cannot notify)
POISON_SCALE = 1e4
POISON_FLIP_SCALE = 8.0  # under the pre-filter's 10x the median norm, so the plain rules take it in
NAN_BYTES = {"float32": b"\x00\x00\xc0\x7f", "float16": b"\x00\x7e", "bfloat16": b"\xc0\x7f"}
FLOAT_PARTS = {"float32", "float16", "bfloat16"}

log = logging.getLogger(__name__)


class FaultError(ValueError):
    pass


@dataclass(slots=True)
class _Armed:
    fault: str
    peer: str
    round: int | str
    times: int  # how many more times it fires; -1: always
    point: str = ""  # delay: where
    seconds: float = 0.0  # delay: how long
    target: str = ANY  # delay: the peer on the other side of the point


class FaultInjector:
    def __init__(self, stall_seconds: float = 3600.0) -> None:
        self.stall_seconds = stall_seconds
        self._armed: list[_Armed] = []
        self._lock = threading.Lock()
        self.fired: list[tuple[str, str, int]] = []
        self.die: Callable[[], None] | None = None  # the exit faults: None is a real SIGKILL
        self._released = 0  # bumped by `release`: the delays sleeping then end

    def arm(
        self,
        fault: str,
        *,
        peer: str = ANY,
        round: int | str = ANY,
        times: int = 1,
        point: str = "",
        seconds: float = 0.0,
        target: str = ANY,
    ) -> None:
        if fault not in FAULTS:
            raise FaultError(f"unknown fault {fault!r}; known: {', '.join(FAULTS)}")
        if fault == "delay" and point not in DELAY_POINTS:
            raise FaultError(f"unknown delay point {point!r}; known: {', '.join(DELAY_POINTS)}")
        if fault == "delay" and not (math.isfinite(seconds) and seconds > 0):
            raise FaultError(f"a delay needs a positive number of seconds, got {seconds!r}")
        if fault == "slow" and not (math.isfinite(seconds) and seconds >= 1):
            raise FaultError(f"a slowdown needs a factor of at least 1, got {seconds!r}")
        with self._lock:
            self._armed.append(_Armed(fault, peer, round, times, point, seconds, target))

    def take(self, fault: str, peer: str, round_id: int, *, point: str = "", target: str = ANY) -> _Armed | None:
        """The armed entry (counted as fired once) if ``fault`` is armed for this peer and round."""
        if not self._armed:
            return None
        with self._lock:
            for armed in self._armed:
                if armed.fault != fault or armed.times == 0 or armed.point != point:
                    continue
                if armed.peer not in (ANY, peer) or armed.round not in (ANY, round_id):
                    continue
                if armed.target not in (ANY, target):
                    continue
                if armed.times > 0:
                    armed.times -= 1
                self.fired.append((fault, peer, round_id))
                return armed
        return None

    def call_faults(self, peer: str, round_id: int) -> CallFaults:
        """The faults that strike this peer's call of this round (each armed one taken once)."""
        taken = {f for f in CALL_FAULTS if self.take(f, peer, round_id) is not None}
        return CallFaults(self, peer, round_id, taken)

    async def delay(self, point: str, peer: str, round_id: int, *, target: str = ANY) -> float:
        """The ``delay`` fault point ``point``: sleep if a delay is armed here (until `release`);
        the seconds it was armed for."""
        released = self._released  # before the log line: a release after it ends this delay
        seconds = self._delay_armed(point, peer, round_id, target)
        for step in self._sleeps(point, round_id, released, seconds):
            await asyncio.sleep(step)
        return seconds

    def pause(self, point: str, peer: str, round_id: int) -> float:
        """`delay` for a point on a plain thread (no event loop there): block it; the seconds it
        was armed for."""
        released = self._released  # before the log line: a release after it ends this delay
        seconds = self._delay_armed(point, peer, round_id, ANY)
        for step in self._sleeps(point, round_id, released, seconds):
            time.sleep(step)
        return seconds

    def release(self) -> None:
        """End every delay sleeping now, early. ``--fault`` makes SIGUSR1 call this
        (`release_on_signal`), so a test holds a point until the event it waits for rather than for a
        length it must guess: long enough for a loaded machine, and no longer than needed on an
        idle one. A plain counter, so a signal handler may bump it while a sleeper reads it."""
        self._released += 1

    def release_on_signal(self, signum: int = signal.SIGUSR1) -> None:
        """Let ``signum`` end the delays sleeping now (from the main thread: `signal.signal` works
        there alone; elsewhere nothing is armed)."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signum, lambda *_: self.release())

    def _sleeps(self, point: str, round_id: int, released: int, seconds: float) -> Iterator[float]:
        """The steps a delay of ``seconds`` sleeps (``delay`` awaits them, ``pause`` blocks on them):
        until its length is out or `release` bumped the counter past ``released``."""
        started = time.monotonic()
        end = started + seconds
        while released == self._released and (left := end - time.monotonic()) > 0:
            yield min(RELEASE_POLL_S, left)
        if seconds and released != self._released:
            log.warning("injected fault: %s delay released after %.1f s (round %d)", point,
                        time.monotonic() - started, round_id)

    def slow_step(self, peer: str, round_id: int, step_seconds: float) -> float:
        """The ``slow`` fault, after one inner step that took ``step_seconds``: sleep so that it
        took FACTOR times as long (training thread). The seconds slept."""
        armed = self.take("slow", peer, round_id) if self._armed else None
        if armed is None:
            return 0.0
        extra = (armed.seconds - 1.0) * max(0.0, step_seconds)
        time.sleep(extra)
        return extra

    def _delay_armed(self, point: str, peer: str, round_id: int, target: str) -> float:
        """The seconds of the delay armed at ``point`` (taken once), or 0."""
        armed = self.take("delay", peer, round_id, point=point, target=target)
        if armed is None:
            return 0.0
        # In the log, so a test can act while the delay lasts (a signal mid-exchange).
        log.warning("injected fault: %s delayed %.1f s (round %d)", point, armed.seconds, round_id)
        return armed.seconds

    def exit(self, when: str) -> None:
        """Die as a SIGKILL would (or as the stand-in ``die`` does, then end the call)."""
        if self.die is None:
            os.kill(os.getpid(), signal.SIGKILL)
        self.die()
        raise ExchangeError(f"killed {when} (injected fault)")

    @classmethod
    def parse(cls, specs: list[str]) -> FaultInjector:
        """From spec strings (see the module docstring), for this process's peer."""
        inj = cls()
        for spec in specs:
            head, _, rest = spec.partition("@")
            fault, _, args = head.partition(":")
            rnd, _, times = rest.partition("x")
            point, _, seconds = args.partition(":")
            if fault == "slow":  # slow:FACTOR
                point, seconds = "", point
            try:
                count = -1 if times == "*" else int(times) if times else 1
                inj.arm(
                    fault,
                    round=int(rnd) if rnd else ANY,
                    times=count,
                    point=point,
                    seconds=float(seconds) if seconds else 0.0,
                )
            except ValueError as err:
                raise FaultError(f"bad fault spec {spec!r}: {err}") from None
        return inj


class CallFaults:
    """The faults that strike one call of one peer; the exchange calls these at its fault points.
    Pure functions of their inputs except ``lose_result`` (once per call) and the exits."""

    def __init__(self, injector: FaultInjector, peer: str, round_id: int, taken: set[str]) -> None:
        self.injector, self.peer, self.round_id = injector, peer, round_id
        self._taken = taken
        self.poison_kind = next((f for f in POISONS if f in taken), "")

    def __contains__(self, fault: str) -> bool:
        return fault in self._taken

    @property
    def stalls(self) -> bool:
        return "stall" in self._taken

    @property
    def oversize(self) -> bool:
        return "oversize" in self._taken

    def protocol_version(self, version: int) -> int:
        return version + 1 if "wrong_version" in self._taken else version

    def declared_bytes(self, declared: int, limit: int) -> int:
        return limit + 1 if self.oversize else declared

    def input_piece(self, piece: torch.Tensor, offset: int, first: bool) -> torch.Tensor:
        """What this peer sends for the piece of its update at ``offset`` (``piece`` if honest)."""
        out = poisoned(self.poison_kind, piece, self._seed(offset)) if self.poison_kind else piece
        if first and "nan" in self._taken and out.numel():
            out = out.clone()
            out[0] = float("nan")
        return out

    def input_wire(self, wire: WireTensor, first: bool) -> WireTensor:
        if first and "wrong_shape" in self._taken:
            wire.shape = (math.prod(wire.shape) + 1,)
        return wire

    def input_payload(self, payload: bytes, first: bool) -> bytes:
        if first and "corrupt" in self._taken:
            return b"\xff" * max(len(payload), 1)  # field 31 with wire type 7: never a valid message
        return payload

    def gather_wires(self, wires: list[WireTensor]) -> list[WireTensor]:
        """A gather's wire tensors as this peer sends them: poisoned in their float parts."""
        if not self.poison_kind:
            return wires
        out = []
        for i, w in enumerate(wires):
            parts = {n: self._poison_part(t, i) for n, t in w.parts.items()}
            out.append(WireTensor(w.codec, w.shape, w.dtype, parts, w.meta))
        return out

    def _poison_part(self, part: torch.Tensor, i: int) -> torch.Tensor:
        is_float = str(part.dtype).removeprefix("torch.") in FLOAT_PARTS
        return poisoned(self.poison_kind, part, self._seed(i)) if is_float else part

    def gather_payload(self, payload: bytes) -> bytes:
        """A gather's serialized payload as this peer sends it (NaN, wrong shape, garbage)."""
        if "nan" in self._taken or "wrong_shape" in self._taken:
            msg = peer_pb2.Payload.FromString(payload)
            for t in msg.tensors:
                if "wrong_shape" in self._taken:
                    t.shape.append(1)
                for part in t.parts:
                    if part.dtype in NAN_BYTES and len(part.data) >= 4:
                        part.data = NAN_BYTES[part.dtype] + part.data[len(NAN_BYTES[part.dtype]) :]
            payload = msg.SerializeToString()
        return self.input_payload(payload, first=True)

    def lose_result(self) -> bool:
        """True once per call with ``lose_result``: the first reduced chunk this peer receives."""
        if "lose_result" in self._taken:
            self._taken.discard("lose_result")
            return True
        return False

    def before_input(self) -> None:
        """An attempt's members are met and none of our input is out: ``exit_before_input``."""
        if "exit_before_input" in self._taken:
            self.injector.exit("after meeting the round's members, before sending its input")

    def input_delivered(self) -> None:
        """Every owner has our whole input: the ``exit`` fault strikes here."""
        if "exit" in self._taken:
            self.injector.exit("after sending its input")

    def chunk_sent(self, sent: int, chunks: int) -> None:
        """``sent`` of ``chunks`` input chunks are out to one owner: ``exit_midstream`` strikes halfway."""
        if "exit_midstream" in self._taken and sent == max(1, chunks // 2):
            self.injector.exit(f"halfway through its input ({sent} of {chunks} chunks)")

    async def delay(self, point: str, *, target: str = ANY) -> float:
        return await self.injector.delay(point, self.peer, self.round_id, target=target)

    def held_input(self) -> None:
        """An ``open_input`` delay just ended, the stream to that owner not open: ``exit_holding_input``."""
        if "exit_holding_input" in self._taken:
            self.injector.exit("holding its input back from an owner")

    def _seed(self, offset: int) -> int:
        digest = hashlib.sha256(f"{self.peer}/{self.round_id}/{offset}".encode()).digest()
        return int.from_bytes(digest[:8], "little")


def poisoned(kind: str, x: torch.Tensor, seed: int) -> torch.Tensor:
    """``x`` as a poisoner of ``kind`` sends it (a new tensor; ``x`` is left alone)."""
    if kind == "poison_scale":
        return x * POISON_SCALE
    if kind == "poison_nan":
        return torch.full_like(x, float("nan"))
    if kind == "poison_sign":
        return -x
    if kind == "poison_flip":
        return x * -POISON_FLIP_SCALE
    if kind == "poison_random":
        rms = float(x.float().pow(2).mean().sqrt()) if x.numel() else 0.0
        noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed))
        return (noise * (rms or 1.0)).to(x.dtype)
    raise FaultError(f"unknown poison {kind!r}; known: {', '.join(POISONS)}")
