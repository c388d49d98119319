"""What the warm-start fork server (node/testnet/warm.py) imports before its first fork: the node's
whole stack, which holds the heavy part of every other process the testnet starts (the
coordinator's gRPC, aiohttp, pydantic and, with a DHT, hivemind; a stage peer's torch), and what a
first optimizer imports (torch._dynamo, about 1.5 s). Importing this module is the whole of its job."""

import hivemind  # noqa: F401 - the DHT, and scipy through it
import torch

import murmur.node.daemon.node  # noqa: F401
import murmur.node.pipeline.stage_peer  # noqa: F401
import murmur.node.train.trainer  # noqa: F401

# torch.optim's first optimizer imports torch._dynamo (its steps are wrapped to keep dynamo out).
torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
