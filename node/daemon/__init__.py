"""`murmur node`: the volunteer daemon.

Modules: cli (the command), node (join, heartbeats, leases, the commit journal, shutdown),
training (the training driver thread), dataplane and peer_dataplane (solo or DHT + gRPC peers),
state_dir (the node's folder on disk), settings (every timeout by name), metrics (/metrics).
"""
