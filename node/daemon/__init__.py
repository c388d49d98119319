"""`murmur node`: the volunteer daemon.

Modules: cli (the command), node (wires the parts; run, stop, shutdown), session (the coordinator
session: join, heartbeats, leases, the commit journal, outages), training_thread (the training
thread and its bridge to the loop, restore, round records), training (the windows the thread
trains), dataplane (what the daemon needs of its peers, and the solo plane), peer_dataplane (DHT +
gRPC peers), run_view (the coordinator's live trainers, which round groups are checked against),
stop (the stop flag), state_dir (the node's folder on disk), settings (every timeout by name),
metrics (/metrics).
"""
