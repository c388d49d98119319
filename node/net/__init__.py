"""Peer networking below the exchange: what every peer-to-peer call stands on.

Modules: server (the mutual-TLS gRPC peer server), loop (the one asyncio loop thread of a process),
state_transfer (fetching a published state from peers, hash-verified), faults (the fault injector
that tests and benchmarks drive, owned by production code).
"""
