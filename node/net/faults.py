"""Fault injection owned by production code, keyed by (peer, round) (after torchft's EventInjector).

The exchange asks ``faults.take(point, peer, round)`` at a few named points; tests (and the chaos
tool) arm faults there instead of subclassing the exchange. An unarmed injector costs one dict
lookup per point.

Faults (what this peer does wrong, as an attacker or a broken machine would):
  nan            its payload decodes to NaN values
  wrong_shape    its payload declares another shape than the round's tensors
  corrupt        the payload bytes are garbage (not a protobuf)
  oversize       it declares and streams a payload beyond the receivers' size limit
  wrong_version  it speaks another protocol version
  stall          it still sends its inputs but never answers another member (a hung machine)
  lose_result    it loses the first reduced chunk it receives (a network cut), so it must catch up
  exit           it dies at once (SIGKILL) after sending its inputs: a SIGKILL seen from outside
  exit_midstream it dies (SIGKILL) halfway through streaming its input to the owners: a machine
                 lost mid-transfer. Peers that share one test process set ``die`` to a stand-in
                 (stop the server, close the channels): the call then ends with ExchangeError.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

FAULTS = (
    "nan",
    "wrong_shape",
    "corrupt",
    "oversize",
    "wrong_version",
    "stall",
    "lose_result",
    "exit",
    "exit_midstream",
)
ANY = "*"


class FaultError(ValueError):
    pass


@dataclass(slots=True)
class _Armed:
    fault: str
    peer: str
    round: int | str
    times: int  # how many more times it fires; -1: always


class FaultInjector:
    def __init__(self, stall_seconds: float = 3600.0) -> None:
        self.stall_seconds = stall_seconds
        self._armed: list[_Armed] = []
        self._lock = threading.Lock()
        self.fired: list[tuple[str, str, int]] = []
        self.die: Callable[[], None] | None = None  # the exit faults: None is a real SIGKILL

    def arm(self, fault: str, *, peer: str = ANY, round: int | str = ANY, times: int = 1) -> None:
        if fault not in FAULTS:
            raise FaultError(f"unknown fault {fault!r}; known: {', '.join(FAULTS)}")
        with self._lock:
            self._armed.append(_Armed(fault, peer, round, times))

    def take(self, fault: str, peer: str, round_id: int) -> bool:
        """True (and count it) if ``fault`` is armed for this peer and round."""
        if not self._armed:
            return False
        with self._lock:
            for armed in self._armed:
                if armed.fault != fault or armed.times == 0:
                    continue
                if armed.peer not in (ANY, peer) or armed.round not in (ANY, round_id):
                    continue
                if armed.times > 0:
                    armed.times -= 1
                self.fired.append((fault, peer, round_id))
                return True
        return False

    @classmethod
    def parse(cls, specs: list[str]) -> FaultInjector:
        """From ``fault[@round][xTIMES]`` strings (command-line form), for this process's peer."""
        inj = cls()
        for spec in specs:
            fault, _, rest = spec.partition("@")
            rnd, _, times = rest.partition("x")
            inj.arm(fault, round=int(rnd) if rnd else ANY, times=int(times) if times else 1)
        return inj
