"""`murmur testnet`: a coordinator and nodes as local processes on loopback.

Modules: cli (the command: live rows, summary, loss plot, chaos), procs (starting, watching and
killing those processes; also the harness of the integration tests), chaos (random SIGKILLs and
restarts, and what the run made of them: rounds, stalls, hash agreement, splits, the ledger),
exchange_peer (one exchange peer as a process, for the exchange benchmark and tests).
"""
