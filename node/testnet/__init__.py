"""`murmur testnet`: a coordinator and nodes as local processes on loopback.

Modules: cli (the command: live rows, summary, loss plot, chaos), procs (starting, watching and
killing those processes; also the harness of the integration tests), chaos (random SIGKILLs and
restarts, and what the run made of them: rounds, stalls, hash agreement, splits, the ledger),
pipeline_net (`testnet up --stages`: stage peers and drivers of a pipelined run),
exchange_peer_process (one exchange peer as a process: the multi-process exchange tests and a
manual check; the exchange peer itself is built by node/exchange/peer.py), warm (the fork server
that starts those processes warm: imports paid once) and warm_preload (what it imports).
"""
