"""The volunteer, one subpackage per job.

model (the Llama-style model, tokenizer, corpus, token shards), train (the single-node trainer and
the one inner step), net (peer server, event loop, state transfer, fault injection), exchange (the
gRPC all-reduce / all-gather of wire tensors), pipeline (SWARM: stage service, router, drivers,
stage state), daemon (`murmur node`: coordinator session, training thread, data plane, state
folder, metrics), sim (`murmur sim`: K replicas in one process), testnet (`murmur testnet`: local
processes, chaos). Imports point down that list; model never imports the
network.
"""
