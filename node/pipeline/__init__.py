"""SWARM-style pipelines: a model cut into stages, each served by peers that come and go.

Modules: config (the pipeline's typed settings), worker (a stage's forward, backward by
recomputation and optimizer steps, free of transport), codec (activations and gradients on the wire:
fp32, bf16, int8 blockwise), chunks (payloads above one gRPC message as checked chunk streams),
memory (a stage peer's resident memory as it reports it, and the allocator setting that lets freed
copies of its stage leave the process), service (the gRPC stage service with mutual TLS and input
checks), client (calls to stage peers, each reached at a StageEndpoint), router (stochastic wiring:
per-hop peer choice by estimated load, benching, adaptive deadlines), driver (microbatches through
the stages with bounded retries; only completed microbatches count), member (a pipeline process's
seat in the run: join, heartbeats, a driver's lease and ledger commits), stage_state (a stage's
weights published for, and fetched by, peers joining the stage), schedule (the run's schedule as
drivers and stage peers follow it: run steps from the ledger, lr, eval points), stage_sync (a
stage's peers keep its weights together: DiLoCo's outer step on the clock), stage_peer (a stage
peer: serves a stage, moves between stages), stage_peer_process and driver_process (one stage peer,
one driver, each as a process: the `python -m` entry points).
"""
