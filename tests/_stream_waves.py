"""Nodes of a test, in a process of their own: join, then open heartbeat streams in two waves.

    python tests/_stream_waves.py ADDRESS TOKEN NODES WAVES WAVE_GAP_S

Joins NODES nodes (each its own key, certificate and channel), prints ``joined``, waits for a
line on stdin, then sends each node's first heartbeat (which opens its stream) in WAVES waves
WAVE_GAP_S apart, prints ``sent`` after the last, and then one JSON line: how many heartbeats
ended how ("ok" or the status code's name). A process of its own, so that it keeps calling while the test stalls the
coordinator's loop.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections import Counter

from murmur.protocol import identity
from murmur.protocol.coordinator_client import CoordinatorError, MemberClient, join_run


async def beat(client: MemberClient) -> str:
    try:
        await client.heartbeat(1.0)
        return "ok"
    except CoordinatorError as err:
        return err.code.name


async def main(address: str, token: str, nodes: int, waves: int, gap_s: float) -> None:
    joined = await asyncio.gather(*(join_run(address, token, identity.generate_key()) for _ in range(nodes)))
    clients = [MemberClient(j.node_address, ident, server_name=j.tls_server_name, timeout_s=120) for ident, j in joined]
    print("joined", flush=True)
    await asyncio.to_thread(sys.stdin.readline)
    beats = []
    for wave in range(waves):
        if wave:
            await asyncio.sleep(gap_s)
        beats += [asyncio.ensure_future(beat(c)) for c in clients[wave::waves]]
    await asyncio.sleep(0.1)  # the last wave's calls leave this process
    print("sent", flush=True)
    outcomes = Counter(await asyncio.gather(*beats))
    await asyncio.gather(*(c.close() for c in clients))
    print(json.dumps(outcomes), flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])))
