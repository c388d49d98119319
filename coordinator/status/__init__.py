"""The coordinator's HTTP port: what an operator looks at.

report (the run's status built from the ledger; the admin Status call and /api/status share it),
http (the aiohttp server on the coordinator's loop: GET /, /api/status, /metrics, admin actions),
page.html (the self-contained status page: inline CSS, JS and SVG, nothing fetched from outside).
"""
