"""The Llama-style model cut into pipeline stages: what one volunteer of a SWARM pipeline holds.

A cut of S stages gives stage 0 the embedding and the first blocks, the middle stages blocks only,
and stage S-1 the last blocks, the final norm, the output head and the loss (through
`kernels.linear_cross_entropy`, the fused linear-CE kernel on a GPU). The layer split is even by
default (the first stages take one block more when S does not divide the depth) or explicit
(``layers=[2, 3, 3]``: blocks per stage).

Weights are those of `Transformer(cfg, seed)`: `build_stage` constructs only the stage's own
modules (on the ``meta`` device, then allocated directly on the device it runs on) and draws each
of its parameters from the seed and the parameter's whole-model name (`init_parameter` in
node/model/transformer.py, the draw the whole model makes too). So a peer of stage s holds stage
s and nothing else, from the start: its memory grows with its share of the layers, and every peer
of a stage starts from the same weights as the single-process model would have.

Tied embeddings put one tensor in the first and the last stage; a cut of more than one stage
refuses them (set ``tie_embeddings=False``; the pipeline's config does it for you, see
node/pipeline/config.py), since keeping two copies in agreement would need an exchange between
stages that nothing here does.

Stage parameters keep the full model's names (``blocks.5.attn.wq.weight``), so a stage's state
means the same thing on every peer and in a whole-model checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from murmur import kernels
from murmur.node.model.transformer import Block, ModelConfig, RMSNorm, Transformer, init_parameter, rotary_tables


class StageError(ValueError):
    """A stage cut that cannot be made; the message says why."""


@dataclass(frozen=True, slots=True)
class StageSpan:
    index: int  # stage number, 0-based
    count: int  # stages in the pipeline
    first_block: int
    end_block: int  # exclusive

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.count - 1

    @property
    def blocks(self) -> range:
        return range(self.first_block, self.end_block)


def split_layers(n_layers: int, stages: int, layers: Sequence[int] | None = None) -> list[StageSpan]:
    """The block range of every stage: ``layers`` (blocks per stage) or an even split."""
    if stages < 1:
        raise StageError(f"a pipeline needs at least one stage, not {stages}")
    if layers is None:
        if stages > n_layers:
            raise StageError(f"{stages} stages cannot share {n_layers} blocks (at least one block each)")
        base, extra = divmod(n_layers, stages)
        layers = [base + (1 if i < extra else 0) for i in range(stages)]
    layers = list(layers)
    if len(layers) != stages:
        raise StageError(f"the layer split {layers} names {len(layers)} stages, the pipeline has {stages}")
    if any(n < 1 for n in layers):
        raise StageError(f"every stage needs at least one block; the split is {layers}")
    if sum(layers) != n_layers:
        raise StageError(f"the layer split {layers} holds {sum(layers)} blocks, the model has {n_layers}")
    spans, start = [], 0
    for i, n in enumerate(layers):
        spans.append(StageSpan(i, stages, start, start + n))
        start += n
    return spans


class StageModule(nn.Module):
    """One stage: [embedding] + a run of blocks [+ final norm, head and loss].

    ``forward(x, targets)``: x is token ids [B, T] on the first stage and hidden states [B, T, D]
    elsewhere; the result is hidden states [B, T, D], or on the last stage the mean cross-entropy
    against ``targets`` [B, T].
    """

    def __init__(
        self, cfg: ModelConfig, span: StageSpan, *, embed: nn.Embedding | None, blocks: Sequence[nn.Module],
        norm: RMSNorm | None, lm_head: nn.Linear | None, device: str | torch.device = "cpu",
        autocast_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if span.count > 1 and cfg.tie_embeddings:
            raise StageError("a pipeline of several stages needs untied embeddings (tie_embeddings=False)")
        self.cfg, self.span = cfg, span
        # bf16 autocast on a GPU (fp32 weights stay the master copy the optimizer steps)
        self.autocast_dtype = autocast_dtype
        self.embed = embed
        self.blocks = nn.ModuleList(blocks)
        self.norm = norm
        # None on the last stage of a single-stage cut with tied embeddings: the head is embed.
        self.lm_head = lm_head
        # Drawn on the CPU and moved, so every device rotates by the same fp32 tables.
        cos, sin = rotary_tables(cfg)
        self.register_buffer("rope_cos", cos.to(device), persistent=False)
        self.register_buffer("rope_sin", sin.to(device), persistent=False)

    @property
    def device(self) -> torch.device:
        return self.rope_cos.device

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        t = x.shape[1]
        if t > self.cfg.seq_len:
            raise StageError(f"sequence of {t} tokens exceeds the model's seq_len {self.cfg.seq_len}")
        if self.autocast_dtype is None:
            return self._forward(x, targets)
        with torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype):
            return self._forward(x, targets)

    def _forward(self, x: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor:
        t = x.shape[1]
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x, cos, sin)
        if self.norm is None:
            return x
        h = self.norm(x)
        weight = self.embed.weight if self.lm_head is None else self.lm_head.weight
        if targets is None:
            return torch.nn.functional.linear(h, weight)
        return kernels.linear_cross_entropy(h.flatten(0, 1), weight, targets.flatten())

    def named_stage_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """Parameters under the whole model's names, in the whole model's order."""
        if self.embed is not None:
            yield "embed.weight", self.embed.weight
        for block_index, block in zip(self.span.blocks, self.blocks, strict=True):
            for name, p in block.named_parameters():
                yield f"blocks.{block_index}.{name}", p
        if self.norm is not None:
            yield "norm.weight", self.norm.weight
        if self.lm_head is not None:
            yield "lm_head.weight", self.lm_head.weight


    def parameter_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for _, p in self.named_stage_parameters())


def cut(model: Transformer, spans: Sequence[StageSpan]) -> list[StageModule]:
    """Stage modules sharing ``model``'s parameters (a view of it, not a copy)."""
    return [
        StageModule(
            model.cfg, span, embed=model.embed if span.is_first else None,
            blocks=[model.blocks[i] for i in span.blocks], norm=model.norm if span.is_last else None,
            lm_head=model.lm_head if span.is_last else None, device=model.rope_cos.device,
        )
        for span in spans
    ]


def build_stage(
    cfg: ModelConfig, seed: int, span: StageSpan, device: str | torch.device = "cpu", *,
    autocast_dtype: torch.dtype | None = None,
) -> StageModule:
    """The stage ``span`` of the seed's model, holding only that stage's parameters, allocated on
    ``device`` and initialised as `Transformer(cfg, seed)` initialises them."""
    if span.count > 1 and cfg.tie_embeddings:
        raise StageError("a pipeline of several stages needs untied embeddings (tie_embeddings=False)")
    device = torch.device(device)
    # The modules' own constructors would allocate and initialise every weight once more: build
    # them as shapes only, allocate on the device, then draw each parameter once.
    with torch.device("meta"):
        embed = nn.Embedding(cfg.vocab_size, cfg.dim) if span.is_first else None
        blocks = [Block(cfg) for _ in span.blocks]
        norm = RMSNorm(cfg.dim, cfg.norm_eps) if span.is_last else None
        lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False) if span.is_last and not cfg.tie_embeddings else None
    parts = [m.to_empty(device=device) if m is not None else None for m in (embed, norm, lm_head)]
    blocks = [b.to_empty(device=device) for b in blocks]
    stage = StageModule(cfg, span, embed=parts[0], blocks=blocks, norm=parts[1], lm_head=parts[2], device=device,
                        autocast_dtype=autocast_dtype)
    for name, p in stage.named_stage_parameters():
        init_parameter(name, p, seed, cfg.n_layers)
    return stage
