"""Peer networking below the exchange: what every peer-to-peer call stands on.

Modules: server (the mutual-TLS gRPC peer server), loop (the one asyncio loop thread of a process),
state_transfer (fetching a published state from peers, hash-verified), faults (the fault injector
that tests and benchmarks drive, owned by production code), addresses (what a server binds and what
it advertises), member_folder (the identity and join record a member keeps to rejoin as itself).
"""
