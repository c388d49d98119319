"""What the warm-start fork server (node/testnet/warm.py) imports before its first fork: the node's
whole stack, which holds the heavy part of every other process the testnet starts (the
coordinator's gRPC, aiohttp, pydantic and, with a DHT, hivemind; a stage peer's torch), and what a
first optimizer imports (torch._dynamo, about 1.5 s). Importing this module is the whole of its job."""

import torch

import murmur.node.daemon.node  # noqa: F401
import murmur.node.pipeline.stage_peer  # noqa: F401
import murmur.node.train.trainer  # noqa: F401

# hivemind (and scipy through it) comes through the DHT's adapter, which sets hivemind's
# tensor-sharing strategy before hivemind is imported. Imported here first, hivemind kept its own
# default in every warm process, and each DHT start spawned a torch_shm_manager helper that outlived
# the DHT (2 s of a restart at load 28).
import murmur.protocol.dht  # noqa: F401

# torch.optim's first optimizer imports torch._dynamo (its steps are wrapped to keep dynamo out).
torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
