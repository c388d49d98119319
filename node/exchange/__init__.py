"""The gRPC exchange: all-reduce and all-gather of wire tensors between the peers of a round.

Modules: grpc_exchange (GrpcExchange, the optim.Exchange over gRPC), peer (build_peer: the one
place an exchange peer is built: server, exchange, group), group (who is in a round), rounds (the
attempts of one call: retry, quorum, catch up), calls (a call's state: ReduceCall, GatherCall;
an owner's Reply), own (this peer's own attempt as an owner), send and send_reduce (this peer's
streams to the owners), collect (the owner's side of those streams), attempt (one attempt's state
on its owner), catchup (results published, and fetched by a peer that missed them), channels (gRPC
channels to the peers), snapshot (the update copied chunk by chunk), validate (untrusted chunks
checked), tasks (helper tasks dropped without losing an exception), settings, stats.
"""
