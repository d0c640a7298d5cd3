"""The two schedules of a run: the learning rate of each step, and when a checkpoint is due."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch

from dlstore.train.config import TrainConfig

__all__ = ["CheckpointSchedule", "LrSchedule", "lr_factor"]


def lr_factor(step: int, cfg: TrainConfig, steps_per_epoch: int, total_steps: int) -> float:
    """The learning rate of optimiser step `step`, 0-based, as a fraction of the peak.

    It warms up linearly from `warmup_start_factor`, then decays by cosine to `min_lr_factor`
    or in steps.

    >>> cfg = TrainConfig("x", epochs=10, warmup_epochs=1, warmup_start_factor=0.0)
    >>> [round(lr_factor(s, cfg, 10, 100), 3) for s in (0, 5, 10, 55, 100)]
    [0.0, 0.5, 1.0, 0.5, 0.0]
    """
    warmup = int(round(cfg.warmup_epochs * steps_per_epoch))
    if step < warmup:
        return cfg.warmup_start_factor + (1.0 - cfg.warmup_start_factor) * step / warmup
    if cfg.schedule == "cosine":
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return cfg.min_lr_factor + (1.0 - cfg.min_lr_factor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    epoch = step // max(1, steps_per_epoch)
    return cfg.step_gamma ** sum(epoch >= m for m in cfg.step_milestones)


class LrSchedule:
    """The run's learning rate per step: `lr_factor` of the peak, over a `LambdaLR`.

    `offset` counts the scheduler's steps ahead of the run's own step count. It is not 0
    after a resume on another number of ranks or batch size. `--max-steps` counts the run's
    steps, so it ends the schedule `offset` steps later. Checkpoints save the offset.
    """

    def __init__(self, cfg: TrainConfig, optimizer: torch.optim.Optimizer, peak_lr: float, steps_per_epoch: int):
        self.cfg, self.optimizer, self.peak_lr, self.steps_per_epoch = cfg, optimizer, peak_lr, steps_per_epoch
        self.offset = 0
        self.total_steps = self._total_steps()
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, self._factor())

    def _total_steps(self) -> int:
        total = self.cfg.epochs * self.steps_per_epoch
        return total if self.cfg.max_steps is None else min(total, self.cfg.max_steps + self.offset)

    def _factor(self) -> Callable[[int], float]:
        # A closure, not a bound method: `LambdaLR.state_dict` saves nothing of a function.
        cfg, spe, total = self.cfg, self.steps_per_epoch, self.total_steps
        return lambda step: lr_factor(step, cfg, spe, total)

    def set(self, offset: int, position: int) -> None:
        """This run's schedule and peak, standing at scheduler step `position`.

        A resume calls it, so the next step's rate comes from this run's settings, not the
        saved run's.
        """
        self.offset = offset
        self.total_steps = self._total_steps()
        groups = self.optimizer.param_groups
        self.scheduler.lr_lambdas = [self._factor()] * len(groups)
        self.scheduler.base_lrs = [self.peak_lr] * len(groups)
        for group in groups:
            group["initial_lr"] = self.peak_lr
        self.scheduler.last_epoch = position - 1
        self.scheduler.step()  # to `position`: the groups' rates set from it


class CheckpointSchedule:
    """When the next checkpoint is due: every `every_minutes` and every `every_steps` steps.

    0 turns either off. Each rank keeps its own clock; the trainer ORs the verdict over the ranks.
    """

    def __init__(self, every_minutes: float, every_steps: int) -> None:
        self.every_minutes = every_minutes
        self.every_steps = every_steps
        self.last_time = time.monotonic()
        self.saved_step: int | None = None  # the step of the last checkpoint written or loaded

    def minutes_due(self) -> bool:
        return self.every_minutes > 0 and time.monotonic() - self.last_time >= 60 * self.every_minutes

    def steps_due(self, step: int) -> bool:
        return self.every_steps > 0 and step % self.every_steps == 0

    def mark_saved(self, step: int) -> None:
        self.last_time = time.monotonic()
        self.saved_step = step
