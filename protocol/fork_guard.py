"""The one lock between this process's forks of a DHT process and the work that must not run under one.

hivemind's DHT is a forked child (protocol/dht.py), and a fork copies only the thread that forks:
what another thread was changing at that instant reaches the child half-changed. A node builds its
model and reads its checkpoint while its DHT starts (seconds of a restart: node/daemon/node.py),
from the moment the DHT's process is forked; a second fork of that start (a retry) waits for that
work under this lock, and that work waits for a fork under way. Light on purpose (the standard
library only): the node's training side takes it without importing hivemind.
"""

from __future__ import annotations

import threading

FORK_GUARD = threading.Lock()
