"""The run's schedule for a pipelined run, counted in the samples its ledger holds.

A data-parallel node counts its own optimizer steps; in a pipeline no single process steps the
whole model, and stage-mates step at different rates. So a pipelined run measures its progress
by what the coordinator's ledger holds: every committed microbatch went through every stage, and
``samples = tokens committed // seq_len``. The run's step is ``samples // train.batch_size`` and
the run ends at ``train.steps`` of them (or when every shard is done, whichever comes first).

Every stage peer sets its inner optimizer's lr from this step before each of its own steps
(warm-up, cosine, ``min_lr_ratio``: `optim.inner.lr_at`, the rule `murmur train` and the
data-parallel nodes use), so all stages follow one schedule whatever their rate. Drivers stop
leasing at the end of the schedule and evaluate the validation split every ``train.eval_every``
run steps.
"""

from __future__ import annotations

from dataclasses import dataclass

from murmur.optim.inner import lr_at
from murmur.protocol.runconfig import RunConfig


@dataclass(slots=True)
class RunSchedule:
    steps: int  # train.steps
    batch_size: int  # train.batch_size: sequences a run step
    seq_len: int
    eval_every: int  # run steps between evaluations
    optim: object  # the run's OptimSection
    tokens_committed: int = 0  # the newest ledger total heard of

    @classmethod
    def of(cls, run: RunConfig, seq_len: int) -> RunSchedule:
        return cls(run.train.steps, run.train.batch_size, seq_len, run.train.eval_every, run.optim)

    def heard(self, tokens_committed: int) -> None:
        """The ledger's total as a reply or a poll said it (never goes back: replies may cross)."""
        self.tokens_committed = max(self.tokens_committed, int(tokens_committed))

    def step_at(self, tokens: int) -> int:
        return (tokens // self.seq_len) // self.batch_size

    @property
    def step(self) -> int:
        return self.step_at(self.tokens_committed)

    @property
    def budget_tokens(self) -> int:
        """Tokens the run commits by its schedule's end."""
        return self.steps * self.batch_size * self.seq_len

    @property
    def done(self) -> bool:
        return self.step >= self.steps

    def lr(self) -> float:
        return lr_at(min(self.step, self.steps), self.steps, self.optim)

    def evaluation_due(self, before: int, after: int) -> bool:
        """Whether the ledger moving from ``before`` to ``after`` tokens crossed an evaluation point
        (a multiple of ``eval_every`` run steps, or the schedule's end)."""
        a, b = self.step_at(before), self.step_at(after)
        return b // self.eval_every > a // self.eval_every or (a < self.steps <= b)
