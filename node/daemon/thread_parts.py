"""What every side of a `TrainingThread` reads: the parts its __init__ sets
(node/daemon/training_thread.py), named once for the sides that are its mixins (resume.py, resync.py,
round_handoff.py), each of which adds the attributes only it uses."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from murmur.node.daemon.dataplane import DataPlane
from murmur.node.daemon.session import CoordinatorSession
from murmur.node.daemon.settings import NodeSettings
from murmur.node.daemon.state_dir import StateDir
from murmur.node.daemon.stop import StopSignal
from murmur.node.daemon.training import NodeTrainer
from murmur.node.net.faults import FaultInjector
from murmur.protocol.runconfig import RunConfig


class ThreadParts:
    """The attributes a `TrainingThread`'s __init__ sets and all of its sides read."""

    cfg: RunConfig
    trainer: NodeTrainer
    dataplane: DataPlane
    session: CoordinatorSession
    state: StateDir
    stop: StopSignal
    s: NodeSettings
    log: Callable[[str], None]
    loop: asyncio.AbstractEventLoop
    faults: FaultInjector | None
