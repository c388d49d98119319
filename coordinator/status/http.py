"""The coordinator's HTTP port, with aiohttp on the coordinator's one loop.

  GET  /                         the status page (one self-contained HTML file: page.html)
  GET  /api/status[?run=ID]      the page's data as JSON (report.page_status)
  GET  /metrics                  Prometheus text (coordinator/metrics.py)
  POST /api/nodes/{id}/ban       admin actions: need the admin credential, as
  POST /api/nodes/{id}/unban     `Authorization: Bearer <the <db>.admin-key file's contents>`

Reading is open (the port is meant for an operator's network, like /metrics); every action is
refused with 401 without the credential and 403 with a wrong one. Bad requests get one-line
answers from protocol/http_server.py; the server keeps serving.
"""

from __future__ import annotations

import hmac
import json
from importlib import resources
from typing import Any

from aiohttp import web

from murmur.errors import MurmurError
from murmur.protocol.http_server import HttpServer, one_line_errors

from ..membership import Membership
from ..metrics import CONTENT_TYPE, LedgerCollector, exposition, registry
from ..runs import NotFound
from ..status_report import StatusSource

MAX_ACTION_BODY = 4096  # an action's JSON body: a reason at most
PAGE_MARKER = "/*__INITIAL_STATUS__*/null"  # replaced by the status at the time the page is served


def _json(data: Any, status: int = 200) -> web.Response:
    return web.json_response(data, status=status, dumps=lambda d: json.dumps(d, allow_nan=False, default=str))


def _error(status: int, message: str) -> web.Response:
    return _json({"error": message}, status)


class StatusApp:
    def __init__(self, source: StatusSource, membership: Membership, collector: LedgerCollector, admin_key: str):
        self.source = source
        self.membership = membership
        self.registry = registry(collector)
        self.admin_key = admin_key
        self.page = resources.files(__package__).joinpath("page.html").read_text()
        self.app = web.Application(middlewares=[one_line_errors], client_max_size=MAX_ACTION_BODY)
        self.app.router.add_get("/", self.index)
        self.app.router.add_get("/api/status", self.status)
        self.app.router.add_get("/metrics", self.metrics)
        self.app.router.add_post("/api/nodes/{node_id}/{action:ban|unban}", self.node_action)

    def server(self) -> HttpServer:
        return HttpServer(self.app)

    def _status(self, request: web.Request) -> dict[str, Any]:
        return self.source.page_status(request.query.get("run", "")[:200])

    async def index(self, request: web.Request) -> web.Response:
        try:
            initial = json.dumps(self._status(request), allow_nan=False, default=str)
        except MurmurError:
            initial = "null"  # the page shows the error its first /api/status call gets
        # Inside <script>: "</" must not close the tag early.
        html = self.page.replace(PAGE_MARKER, initial.replace("</", "<\\/"))
        return web.Response(text=html, content_type="text/html", charset="utf-8",
                            headers={"Cache-Control": "no-store"})

    async def status(self, request: web.Request) -> web.Response:
        try:
            return _json(self._status(request))
        except NotFound as err:
            return _error(404, str(err))
        except MurmurError as err:
            return _error(400, str(err))

    async def metrics(self, _request: web.Request) -> web.Response:
        return web.Response(body=exposition(self.registry), headers={"Content-Type": CONTENT_TYPE})

    def _check_admin(self, request: web.Request) -> web.Response | None:
        given = request.headers.get("Authorization", "")
        if not given.startswith("Bearer ") or not given[7:].strip():
            return _error(401, "this action needs the admin credential: send 'Authorization: Bearer <the "
                               "contents of the coordinator's <db>.admin-key file>'")
        if not hmac.compare_digest(given[7:].strip().encode(), self.admin_key.encode()):
            return _error(403, "the admin credential is wrong: use the <db>.admin-key file of this coordinator")
        return None

    async def node_action(self, request: web.Request) -> web.Response:
        refused = self._check_admin(request)
        if refused is not None:
            return refused
        node_id, action = request.match_info["node_id"], request.match_info["action"]
        reason = "banned from the status page"
        if request.can_read_body:
            try:
                body = await request.json()
            except (ValueError, UnicodeDecodeError):
                return _error(400, 'the body must be JSON, e.g. {"reason": "poisoned updates"}')
            if isinstance(body, dict) and isinstance(body.get("reason"), str) and body["reason"].strip():
                reason = body["reason"].strip()
        if self.source.store.node(node_id) is None:
            return _error(404, f"no node {node_id[:100]!r}; GET /api/status lists the ids")
        try:
            if action == "ban":
                self.membership.ban(node_id, reason[:200])
            else:
                self.membership.unban(node_id)
        except MurmurError as err:
            return _error(409, str(err))
        row = self.source.store.node(node_id)
        return _json({"node_id": node_id, "status": row["status"] if row else "", "action": action})
