"""The coordinator's HTTP port: what an operator looks at.

http (the aiohttp server on the coordinator's loop: GET /, /api/status, /metrics, admin actions),
page.html (the self-contained status page: inline CSS, JS and SVG, nothing fetched from outside).
The status itself is built from the ledger by coordinator/status_report.py, which the admin Status
call shares, so the page and `murmur admin status` always agree.
"""
