"""The Prometheus endpoint both the coordinator and the node serve: GET /metrics as text.

A tiny HTTP server on the process's asyncio loop (no extra dependency). It lives in protocol/
because coordinator/ and node/ may not import each other, and the scrape format is part of what
both promise to operators. ``body`` renders the exposition text at scrape time.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

READ_TIMEOUT_S = 5.0  # a scraper that sends no request line within this long is dropped
CONTENT_TYPE = "text/plain; version=0.0.4"


class MetricsServer:
    def __init__(self, body: Callable[[], str], read_timeout_s: float = READ_TIMEOUT_S) -> None:
        self.body = body
        self.read_timeout_s = read_timeout_s
        self._server: asyncio.AbstractServer | None = None

    async def start(self, host: str, port: int) -> int:
        """Listen on host:port (0: any free port); returns the bound port."""
        self._server = await asyncio.start_server(self._handle, host, port)
        return int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readline(), self.read_timeout_s)
            parts = request.decode("latin-1").split()
            if len(parts) >= 2 and parts[0] == "GET" and parts[1].split("?")[0] == "/metrics":
                status, ctype, payload = "200 OK", CONTENT_TYPE, self.body().encode()
            else:
                status, ctype, payload = "404 Not Found", "text/plain", b"not found: try GET /metrics\n"
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(payload)}\r\n"
                "Connection: close\r\n\r\n".encode()
                + payload
            )
            await writer.drain()
        except (TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
