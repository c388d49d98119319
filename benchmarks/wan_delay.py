"""A fixed one-way delay on every packet crossing a bridge, in user space (this kernel has no netem).

    sudo python benchmarks/wan_delay.py --bridge mxb0 --delay-ms 25     # until SIGTERM

benchmarks/scale.py's WAN row starts it (``start``): each peer sits in its own network namespace
on one bridge (benchmarks/exchange.py), so every packet between two peers crosses the bridge once,
and holding each for ``delay`` there gives a round trip of twice that. How: an iptables rule sends
the bridge's forwarded IPv4 packets to NFQUEUE (the bridge's packets reach iptables:
net.bridge.bridge-nf-call-iptables), and this process tells the kernel to let each go ``delay``
after it arrived. The packets wait in the kernel; only their ids (metadata, no payload) come up.
Arrivals keep their order, so one batch verdict (every id up to N) releases all packets that are
due. The netlink messages are built here (linux/netfilter/nfnetlink_queue.h): no library needed.
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_CONFIG, NFQNL_MSG_VERDICT_BATCH = 0, 2, 3
NFQA_PACKET_HDR = 1
NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_QUEUE_MAXLEN, NFQA_CFG_MASK, NFQA_CFG_FLAGS = 1, 2, 3, 4, 5
NFQA_VERDICT_HDR = 2
NFQNL_CFG_CMD_BIND = 1
NFQNL_COPY_META = 1
NFQA_CFG_F_FAIL_OPEN, NFQA_CFG_F_GSO = 0x1, 0x4
NF_ACCEPT = 1
NLM_F_REQUEST = 1
SO_RCVBUFFORCE = 33
QUEUE = 7749
QUEUE_MAXLEN = 1 << 16  # packets held at once (50 ms of 16 peers at 100 Mbit/s is ~7,000)


def _attr(kind: int, payload: bytes) -> bytes:
    head = struct.pack("=HH", 4 + len(payload), kind)
    return head + payload + b"\0" * (-len(payload) % 4)


def _message(msg: int, queue: int, attrs: bytes, family: int = socket.AF_UNSPEC) -> bytes:
    body = struct.pack("=BBH", family, 0, socket.htons(queue)) + attrs
    return struct.pack("=IHHII", 16 + len(body), (NFNL_SUBSYS_QUEUE << 8) | msg, NLM_F_REQUEST, 0, 0) + body


class Delayer:
    """Holds each packet of queue ``queue`` for ``delay`` seconds, then accepts it."""

    def __init__(self, queue: int, delay: float) -> None:
        self.queue, self.delay = queue, delay
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        self.sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 64 << 20)
        self.sock.bind((0, 0))
        self.sock.send(_message(NFQNL_MSG_CONFIG, queue, _attr(NFQA_CFG_CMD, struct.pack("=BBH", NFQNL_CFG_CMD_BIND,
                                                                                       0, socket.htons(2)))))
        params = _attr(NFQA_CFG_PARAMS, struct.pack("!IB", 0, NFQNL_COPY_META))
        params += _attr(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", QUEUE_MAXLEN))
        flags = NFQA_CFG_F_FAIL_OPEN | NFQA_CFG_F_GSO  # overflow: let through, not drop; GSO whole
        params += _attr(NFQA_CFG_MASK, struct.pack("!I", flags)) + _attr(NFQA_CFG_FLAGS, struct.pack("!I", flags))
        self.sock.send(_message(NFQNL_MSG_CONFIG, queue, params))
        self.held: collections.deque[tuple[float, int]] = collections.deque()
        self.cond = threading.Condition()
        self.packets = 0

    def receive(self) -> None:
        """Read packet notices; note each id with its release time."""
        while True:
            data = self.sock.recv(1 << 20)
            now = time.monotonic()
            off = 0
            while off + 16 <= len(data):
                length, kind = struct.unpack_from("=IH", data, off)
                if length < 16:
                    break
                if kind == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
                    packet_id = self._packet_id(data, off + 20, off + length)
                    if packet_id is not None:
                        with self.cond:
                            self.held.append((now + self.delay, packet_id))
                            self.cond.notify()
                off += (length + 3) & ~3

    @staticmethod
    def _packet_id(data: bytes, off: int, end: int) -> int | None:
        while off + 4 <= end:
            length, kind = struct.unpack_from("=HH", data, off)
            if length < 4:
                return None
            if kind & 0x7FFF == NFQA_PACKET_HDR:
                return int(struct.unpack_from("!I", data, off + 4)[0])
            off += (length + 3) & ~3
        return None

    def release(self) -> None:
        """Accept, in one batch verdict, every held packet whose time has come."""
        while True:
            with self.cond:
                while not self.held:
                    self.cond.wait()
                due, last = self.held[0]
                wait = due - time.monotonic()
                if wait > 0:
                    self.cond.wait(wait)
                    continue
                while self.held and self.held[0][0] <= time.monotonic():
                    _, last = self.held.popleft()
                    self.packets += 1
            verdict = _attr(NFQA_VERDICT_HDR, struct.pack("!II", NF_ACCEPT, last))
            self.sock.send(_message(NFQNL_MSG_VERDICT_BATCH, self.queue, verdict))


def _rule(op: str, bridge: str, queue: int) -> list[str]:
    return ["iptables", "-t", "mangle", op, "FORWARD", "-i", bridge, "-o", bridge, "-j", "NFQUEUE",
            "--queue-num", str(queue), "--queue-bypass"]


class Running:
    def __init__(self, proc: subprocess.Popen[str], bridge: str, queue: int) -> None:
        self.proc, self.bridge, self.queue = proc, bridge, queue

    def stop(self) -> None:
        subprocess.run(_rule("-D", self.bridge, self.queue), capture_output=True)
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start(bridge: str, delay_ms: float, queue: int = QUEUE) -> Running | None:
    """The delayer as a process, and the rule that feeds it; None (said in one line) if the kernel
    cannot (no NFQUEUE, or bridged packets skip iptables)."""
    nf = Path("/proc/sys/net/bridge/bridge-nf-call-iptables")
    if not nf.exists() or nf.read_text().strip() != "1":
        print("no delay: bridged packets do not reach iptables here (modprobe br_netfilter)", file=sys.stderr)
        return None
    proc = subprocess.Popen([sys.executable, __file__, "--bridge", bridge, "--delay-ms", str(delay_ms),
                             "--queue", str(queue), "--no-rule"], stdout=subprocess.PIPE, text=True)
    if (proc.stdout.readline() if proc.stdout else "").strip() != "ready":  # type: ignore[union-attr]
        proc.kill()
        proc.wait()
        print("no delay: the NFQUEUE delayer did not start (no nfnetlink_queue?)", file=sys.stderr)
        return None
    added = subprocess.run(_rule("-I", bridge, queue), capture_output=True, text=True)
    if added.returncode:
        proc.kill()
        proc.wait()
        print(f"no delay: iptables refused the NFQUEUE rule: {added.stderr.strip()}", file=sys.stderr)
        return None
    return Running(proc, bridge, queue)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bridge", default="mxb0")
    ap.add_argument("--delay-ms", type=float, required=True, help="one-way delay (the round trip is twice it)")
    ap.add_argument("--queue", type=int, default=QUEUE)
    ap.add_argument("--no-rule", action="store_true", help="the caller adds the iptables rule")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("error: the delayer needs root (netlink to the packet queue, iptables)", file=sys.stderr)
        return 2
    delayer = Delayer(args.queue, args.delay_ms / 1000)
    if not args.no_rule:
        subprocess.run(_rule("-I", args.bridge, args.queue), check=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    threading.Thread(target=delayer.release, daemon=True).start()
    print("ready", flush=True)
    try:
        delayer.receive()
    finally:
        if not args.no_rule:
            subprocess.run(_rule("-D", args.bridge, args.queue), capture_output=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
