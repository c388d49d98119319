"""The gRPC exchange: all-reduce and all-gather of wire tensors between the peers of a round.

Modules: grpc_exchange (GrpcExchange, the optim.Exchange over gRPC), group (who is in a round),
attempt (one round's reduce or gather state on its owner), send (a member's calls to the owners),
collect (the owner's side of those calls), catchup (results fetched by a peer that missed them),
snapshot (the update copied chunk by chunk), validate (untrusted chunks checked), settings, stats,
peer (build_peer: the one place an exchange peer is built: server, exchange, group).
"""
