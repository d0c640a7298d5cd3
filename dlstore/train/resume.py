"""The trainer's checkpoint policy around `CheckpointStore`: when a checkpoint is due, which
one a run resumes from, and which changed settings make a resumed run differ from one that
never stopped."""

from __future__ import annotations

import logging
import time

from dlstore.errors import DlstoreError
from dlstore.logs import redact_url
from dlstore.train.checkpoint import CheckpointStore, checkpoint_named, load_checkpoint_at
from dlstore.train.config import TrainConfig
from dlstore.train.dist import DistContext

__all__ = ["RESULT_SHAPING", "CheckpointSchedule", "changed_settings", "find_resume_state", "flat_settings"]

log = logging.getLogger(__name__)

# Settings whose change on resume makes the result differ from one uninterrupted run.
RESULT_SHAPING = (
    "model",
    "batch_size",
    "image_size",
    "resize_min",
    "epochs",
    "max_steps",  # the cosine schedule ends there
    "base_lr",
    "momentum",
    "weight_decay",
    "label_smoothing",
    "warmup_epochs",
    "schedule",
    "step_milestones",
    "seed",
    "amp",
)


def flat_settings(config: dict) -> dict:
    """A `TrainConfig.to_dict()` with its data settings beside the others (older checkpoints
    saved them flat), so settings are compared by name wherever they live.

    >>> flat_settings({"data": {"batch_size": 64}, "epochs": 3})
    {'batch_size': 64, 'epochs': 3}
    """
    data = config.get("data")
    rest = {k: v for k, v in config.items() if k != "data"}
    return {**data, **rest} if isinstance(data, dict) else rest


def changed_settings(saved: dict, current: dict) -> list[str]:
    """The result-shaping settings (`RESULT_SHAPING`) that differ between two `TrainConfig.to_dict()`s.

    >>> changed_settings({"epochs": 10, "workers": 4}, {"epochs": 20, "workers": 8})
    ['epochs']
    """
    return sorted(k for k, v in current.items() if k in RESULT_SHAPING and saved.get(k) != v)


class CheckpointSchedule:
    """When the next checkpoint is due: every `every_minutes` of wall time and every
    `every_steps` steps (0 turns either off). Each rank keeps its own clock; the trainer
    ORs the verdict over the ranks."""

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


def find_resume_state(cfg: TrainConfig, ckpts: CheckpointStore | None, ctx: DistContext) -> tuple[dict, str] | None:
    """The checkpoint `cfg.resume` names ("none", "auto" or a URL) and where it was, or None
    for a fresh start. A collective under "auto": rank 0 chooses, so a checkpoint published
    meanwhile cannot split the ranks."""
    if cfg.resume == "none":
        if ckpts is not None and ctx.is_main and ckpts.keys():
            log.warning(
                "%s already holds checkpoints; this fresh run will write beside them and move 'latest' "
                "(use --resume auto to continue, or another --checkpoint-url)",
                redact_url(cfg.checkpoint_url or ""),
            )
        return None
    if cfg.resume == "auto":
        # Rank 0 finds the newest checkpoint that loads (its state kept), the others load that
        # one; its failure reaches them too, rather than leave them in the broadcast until the
        # process group's timeout.
        found, failure = None, None
        if ctx.is_main:
            try:
                found = ckpts.newest_loadable()
            except Exception as exc:
                failure = exc
        key, why = ctx.broadcast_object(
            (found[0] if found is not None else None, f"{type(failure).__name__}: {failure}" if failure else None)
        )
        if failure is not None:
            raise failure
        if why is not None:
            raise DlstoreError(f"rank 0 found no checkpoint to resume from: {why}")
        if key is None:
            if ctx.is_main:
                log.info("no checkpoint under %s yet: starting fresh", redact_url(cfg.checkpoint_url or ""))
            return None
        return (found[1] if found is not None else ckpts.load(key)), ckpts.store.join(key)
    # Rank 0 finds what the URL names (a folder's `latest` may move meanwhile), the others load that.
    named, failure = None, None
    if ctx.is_main:
        try:
            named = checkpoint_named(cfg.resume)
        except Exception as exc:
            failure = exc
    named, why = ctx.broadcast_object((named, f"{type(failure).__name__}: {failure}" if failure else None))
    if failure is not None:
        raise failure
    if why is not None:
        raise DlstoreError(f"rank 0 could not find the checkpoint to resume from: {why}")
    return load_checkpoint_at(*named)
