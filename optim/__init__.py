"""Transport-agnostic low-communication training: inner/outer optimizers, DiLoCo, Streaming DiLoCo,
DeMo, compressors with error feedback, robust aggregators, byte accounting.

Modules: codecs (compressors), aggregate (rules + pre-filter), reduce (what a round computes, shared
by every exchange), exchange (the interface), inprocess (the simulator's exchange), sync (hook
protocol + DDP), diloco (DiLoCo, Streaming DiLoCo), demo (DeMo), inner (the inner optimizer + schedule),
muon (Muon for the hidden matrices with AdamW for the rest: MuLoCo's inner optimizer),
accounting (bytes by codec, DDP's bytes to compare with), factory (build from the run config).
"""
