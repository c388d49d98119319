"""The exchange's gRPC channels to its peers: one per peer, mutual TLS, redialed on a new address.

A peer killed and restarted under the same node id is back at a new address; the next call to it
dials the new one. The old channel is closed with the others when the exchange closes (calls still
on it may be finishing).
"""

from __future__ import annotations

import grpc

from murmur.node.exchange.settings import ExchangeSettings
from murmur.node.net.server import STREAM_WINDOW_OPTION
from murmur.protocol import tls
from murmur.protocol.identity import BanList, Identity


class Channels:
    def __init__(self, identity: Identity, ban_list: BanList, settings: ExchangeSettings) -> None:
        self.identity, self.ban_list, self.settings = identity, ban_list, settings
        self._open: dict[str, tuple[str, grpc.aio.Channel]] = {}  # node id -> (address, channel)
        self._stale: list[grpc.aio.Channel] = []

    def get(self, node_id: str, address: str) -> grpc.aio.Channel:
        """The channel to ``node_id`` at ``address`` (raises BannedError for a banned peer)."""
        cached = self._open.get(node_id)
        if cached is not None and cached[0] == address:
            return cached[1]
        tls.check_dial(node_id, self.ban_list)
        options = [
            *tls.channel_options(node_id, self.settings.max_message_bytes),
            (STREAM_WINDOW_OPTION, self.settings.stream_window_bytes),  # results stream back to us
        ]
        channel = grpc.aio.secure_channel(address, tls.channel_credentials(self.identity), options=options)
        if cached is not None:
            self._stale.append(cached[1])
        self._open[node_id] = (address, channel)
        return channel

    async def aclose(self) -> None:
        channels = [c for _, c in self._open.values()] + self._stale
        self._open, self._stale = {}, []
        for ch in channels:
            await ch.close()
