"""An aiohttp application served on the running asyncio loop, guarded against bad clients.

The coordinator (status page, /api/status, /metrics) and the node (/metrics) both serve HTTP this
way; it lives in protocol/ because coordinator/ and node/ may not import each other. aiohttp
parses and answers; in front of each connection sits a small guard that bounds the request head
before aiohttp sees it, so a bad client gets a clear status and costs the server nothing:

  request line longer than ``max_line``          414 URI Too Long
  request head (line + headers) over ``max_head``  431 Request Header Fields Too Large
  no complete head within ``head_timeout_s``      408 Request Timeout (a slow or silent client)

Every error is answered with one line of text and logged as one line, never a stack trace.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web

MAX_LINE_BYTES = 8 * 1024  # the request line: method, path and query, protocol
MAX_HEAD_BYTES = 32 * 1024  # request line and headers together
HEAD_TIMEOUT_S = 10.0  # a client must send its whole request head within this
IDLE_TIMEOUT_S = 15.0  # a keep-alive connection with no new request is closed after this

log = logging.getLogger("murmur.http")


class _OneLineLogger(logging.LoggerAdapter):
    """aiohttp logs parse errors with ``logger.exception``: keep the message, drop the traceback."""

    def exception(self, msg: object, *args: Any, exc_info: Any = True, **kwargs: Any) -> None:
        err = exc_info[1] if isinstance(exc_info, tuple) else exc_info if isinstance(exc_info, BaseException) else None
        detail = f": {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}" if err else ""
        self.warning("%s%s", msg % args if args else msg, detail[:300])


def _answer(status: int, reason: str, text: str) -> bytes:
    body = (text + "\n").encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: text/plain; charset=utf-8\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


class _HeadGuard(asyncio.Protocol):
    """Sits between the transport and aiohttp's protocol for one connection; checks the first
    request head's size and deadline, then passes every byte through untouched."""

    def __init__(self, inner: Any, limits: HttpLimits) -> None:
        self.inner = inner
        self.limits = limits
        self.head: bytearray | None = bytearray()  # None once the first head is complete
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.refused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.timer = asyncio.get_running_loop().call_later(self.limits.head_timeout_s, self._too_slow)
        self.inner.connection_made(transport)

    def _refuse(self, status: int, reason: str, text: str) -> None:
        self.refused = True
        if self.timer is not None:
            self.timer.cancel()
        assert self.transport is not None
        peer = self.transport.get_extra_info("peername")
        log.warning("http: %s %s from %s", status, text, peer[0] if peer else "?")
        self.transport.write(_answer(status, reason, text))
        self.transport.close()

    def _too_slow(self) -> None:
        if self.head is not None and not self.refused:
            self._refuse(408, "Request Timeout", f"no complete request within {self.limits.head_timeout_s:g}s")

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return
        if self.head is not None:
            self.head += data
            line_end = self.head.find(b"\r\n")
            if line_end > self.limits.max_line or (line_end < 0 and len(self.head) > self.limits.max_line):
                self._refuse(414, "URI Too Long", f"the request line is over {self.limits.max_line} bytes")
                return
            head_end = self.head.find(b"\r\n\r\n")
            if head_end > self.limits.max_head or (head_end < 0 and len(self.head) > self.limits.max_head):
                self._refuse(
                    431, "Request Header Fields Too Large", f"the request head is over {self.limits.max_head} bytes"
                )
                return
            if head_end >= 0:
                self.head = None
                if self.timer is not None:
                    self.timer.cancel()
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return None if self.refused else self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


class HttpLimits:
    def __init__(
        self,
        max_line: int = MAX_LINE_BYTES,
        max_head: int = MAX_HEAD_BYTES,
        head_timeout_s: float = HEAD_TIMEOUT_S,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
    ) -> None:
        self.max_line, self.max_head = max_line, max_head
        self.head_timeout_s, self.idle_timeout_s = head_timeout_s, idle_timeout_s


@web.middleware
async def one_line_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Unknown routes and wrong methods answer in one line; a handler's crash is a 500, logged in one line."""
    try:
        return await handler(request)
    except web.HTTPException as err:
        if err.status >= 400 and err.text and err.text == f"{err.status}: {err.reason}":
            hint = " (routes: GET /, /api/status, /metrics)" if err.status == 404 else ""
            err.text = f"{err.status} {err.reason}: {request.method} {request.path[:200]}{hint}"
        raise
    except Exception as err:  # noqa: BLE001 - one line in the log, one line to the client, keep serving
        log.warning("http: %s %s failed: %r", request.method, request.path[:200], err)
        raise web.HTTPInternalServerError(text="500 Internal Server Error: see the server's log") from None


class HttpServer:
    """``app`` served on one host:port of the running loop (``start`` returns the bound port)."""

    def __init__(self, app: web.Application, limits: HttpLimits | None = None) -> None:
        self.app = app
        self.limits = limits or HttpLimits()
        self._runner: web.AppRunner | None = None
        self._server: asyncio.AbstractServer | None = None

    async def start(self, host: str, port: int) -> int:
        self._runner = web.AppRunner(
            self.app,
            access_log=None,
            handle_signals=False,
            keepalive_timeout=self.limits.idle_timeout_s,
            max_line_size=self.limits.max_line,
            max_field_size=self.limits.max_head,
            logger=_OneLineLogger(logging.getLogger("aiohttp.server"), {}),
        )
        await self._runner.setup()
        server = self._runner.server
        assert server is not None
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _HeadGuard(server(), self.limits), host, port)
        return int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        # Stop accepting, close the open connections (aiohttp's shutdown), then wait for the listener.
        if self._server is not None:
            self._server.close()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None
