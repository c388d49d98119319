"""A heartbeat front: a process beside the coordinator's that carries a share of the nodes'
heartbeat streams, so gRPC's own work for each heartbeat (TLS, HTTP/2, the aio machinery: some
130 us of a loop thread, docs/coordinator.md "At scale") is spread over processes and cores.

    python -m murmur.coordinator.heartbeat_front --link SOCKET --listen HOST:0 --key K --cert C

It decides nothing: every heartbeat goes, as the bytes the node sent, with the node id read from
the caller's verified certificate, to the coordinator process over a Unix socket (the link), and
the answer that comes back is what the node gets: the reply, or the refusal that ends its stream
with the coordinator's status and reason. Heartbeats that arrive while a batch is with the
coordinator wait and go together as the next batch (one in flight at a time, as group commits
do), so under load the coordinator handles a batch per read, and alone a beat goes at once.

It serves HeartbeatStream only (any other method is UNIMPLEMENTED), over the node address's mutual
TLS with the run CA. It prints one JSON line on stdout once it listens (``{"port": P}``) and ends,
ending every stream with UNAVAILABLE, when its link closes (the coordinator stopped or died) or on
SIGTERM; nodes then heartbeat at the node address again (protocol/coordinator_client.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import struct
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

from murmur.protocol import coordinator_pb2 as pb
from murmur.protocol import tls
from murmur.protocol.version import VERSION_METADATA_KEY, VersionMismatch, check_version

from .serving import end_streams, serving_options  # the coordinator's own (call waits, no BDP probes)
from .settings import CoordinatorSettings

FRAME = struct.Struct("!I")  # each link message: its length, then a FrontBatch or FrontAnswers
MAX_BATCH = 256  # beats a batch carries at most (a reply listing a whole view can be a megabyte)
SERVICE = pb.DESCRIPTOR.services_by_name["Coordinator"].full_name  # murmur.v1.Coordinator


class LinkLost(ConnectionError):
    pass


class Link:
    """The front's end of the link: heartbeats batched to the coordinator, one batch in flight;
    ``run`` reads the answers (the coordinator sends nothing else) until the link closes."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self._waiting: list[tuple[str, bytes, asyncio.Future[pb.FrontAnswer]]] = []
        self._in_flight: list[asyncio.Future[pb.FrontAnswer]] = []
        self._flush_due = False
        self.lost = asyncio.Event()

    async def beat(self, node_id: str, request: bytes) -> pb.FrontAnswer:
        if self.lost.is_set():
            raise LinkLost("the coordinator's link is closed")
        done: asyncio.Future[pb.FrontAnswer] = asyncio.get_running_loop().create_future()
        self._waiting.append((node_id, request, done))
        if not self._in_flight and not self._flush_due:  # beats of this loop turn go in the same batch
            self._flush_due = True
            asyncio.get_running_loop().call_soon(self._flush)
        return await done

    def _flush(self) -> None:
        self._flush_due = False
        if self._in_flight or not self._waiting or self.lost.is_set():
            return
        batch, self._waiting = self._waiting[:MAX_BATCH], self._waiting[MAX_BATCH:]
        data = pb.FrontBatch(beats=[pb.FrontBeat(node_id=n, request=r) for n, r, _ in batch]).SerializeToString()
        self.writer.write(FRAME.pack(len(data)) + data)
        self._in_flight = [done for _, _, done in batch]

    async def run(self) -> None:
        try:
            while True:
                (size,) = FRAME.unpack(await self.reader.readexactly(FRAME.size))
                answers = pb.FrontAnswers.FromString(await self.reader.readexactly(size)).answers
                batch, self._in_flight = self._in_flight, []
                if len(answers) != len(batch):
                    raise LinkLost(f"the coordinator answered {len(answers)} heartbeats of {len(batch)}")
                for done, answer in zip(batch, answers, strict=True):
                    if not done.done():
                        done.set_result(answer)
                self._flush()  # what waited meanwhile: the next batch
        except (OSError, EOFError, asyncio.IncompleteReadError, LinkLost) as err:
            self._lose(err)

    def _lose(self, err: BaseException) -> None:
        self.lost.set()
        for done in [*self._in_flight, *(d for _, _, d in self._waiting)]:
            if not done.done():
                done.set_exception(LinkLost(f"the coordinator's link closed ({err or 'end of file'})"))
        self._in_flight, self._waiting = [], []


class Front:
    def __init__(self, link: Link) -> None:
        self.link = link
        self.streams: set[grpc.aio.ServicerContext] = set()

    async def stream(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        """The coordinator's HeartbeatStream, carried: raw bytes both ways (the coordinator parses)."""
        metadata = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
        try:
            check_version(metadata.get(VERSION_METADATA_KEY), who="client")
        except VersionMismatch as err:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
        names = context.auth_context().get("x509_common_name") or []
        if not names:  # the handshake requires a certificate of the run CA; never expected
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "heartbeats need the node certificate")
        node_id = names[0].decode()
        self.streams.add(context)
        try:
            async for request in requests:
                try:
                    answer = await self.link.beat(node_id, request)
                except LinkLost as err:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, f"the coordinator is gone ({err})")
                if answer.code:
                    await context.abort(getattr(grpc.StatusCode, answer.code, grpc.StatusCode.UNKNOWN), answer.details)
                yield answer.reply
        finally:
            self.streams.discard(context)



async def serve(args: argparse.Namespace) -> None:
    reader, writer = await asyncio.open_unix_connection(args.link)
    link = Link(reader, writer)
    front = Front(link)
    settings = CoordinatorSettings(call_wait_s=args.call_wait)
    server = grpc.aio.server(options=[*tls.server_options(args.max_message_bytes), *serving_options(settings)])
    handlers = {"HeartbeatStream": grpc.stream_stream_rpc_method_handler(front.stream)}  # bytes both ways
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    ca_pem = Path(args.cert).read_bytes()
    creds = grpc.ssl_server_credentials(
        [(Path(args.key).read_bytes(), ca_pem)], root_certificates=ca_pem, require_client_auth=True
    )
    port = server.add_secure_port(args.listen, creds)
    await server.start()
    print(json.dumps({"port": port}), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    reading = asyncio.ensure_future(link.run())  # ends when the link closes (the coordinator is gone)
    await asyncio.wait([asyncio.ensure_future(stop.wait()), reading], return_when=asyncio.FIRST_COMPLETED)
    reading.cancel()
    await end_streams(front.streams)
    await server.stop(args.grace)
    writer.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--link", required=True, help="the coordinator's Unix socket")
    parser.add_argument("--listen", required=True, help="HOST:PORT of the nodes' streams (PORT 0: a free one)")
    parser.add_argument("--key", required=True, help="the coordinator's TLS key (the run CA's)")
    parser.add_argument("--cert", required=True, help="the run CA's certificate")
    parser.add_argument("--call-wait", type=float, default=CoordinatorSettings().call_wait_s)
    parser.add_argument("--max-message-bytes", type=int, default=CoordinatorSettings().max_message_bytes)
    parser.add_argument("--grace", type=float, default=CoordinatorSettings().grpc_grace_s)
    args = parser.parse_args(argv)
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
