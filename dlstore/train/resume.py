"""Resuming a run: which checkpoint, what it holds, and how a `Trainer` takes it back.

A checkpoint holds the loader's position, the optimiser, schedule and scaler, and each
rank's RNG states and partial metrics window. So a resumed run logs the same numbers at
the same steps as one that never stopped. The functions here take the `Trainer` whole:
its state is what a checkpoint saves.
"""

from __future__ import annotations

import logging

import torch

from dlstore.errors import ConfigError, DlstoreError
from dlstore.logs import redact_url
from dlstore.train.checkpoint import CheckpointStore, checkpoint_named, load_checkpoint_at
from dlstore.train.config import TrainConfig
from dlstore.train.dist import DistContext
from dlstore.train.seeding import seed_everything, set_rng_state

__all__ = [
    "RESULT_SHAPING",
    "changed_settings",
    "check_same_settings",
    "checkpoint_state",
    "find_resume_state",
    "flat_settings",
    "resume",
]

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
# Beside the result-shaping settings, those that decide which samples each rank reads.
_SAME_DATA_SETTINGS = ("url", "val_url", "shuffle", "shuffle_window", "drop_last", "window_ramp", "transform")
# Settings that decide when the ranks meet in a collective: a rank that differs waits alone in one.
_SAME_RUN_SETTINGS = (
    "log_every",
    "checkpoint_url",
    "checkpoint_every_steps",
    "checkpoint_every_minutes",
    "resume",
    "resume_any_data",
    "resize_start_epoch",
    "resize_end_epoch",
    "resize_step",
    "eval_image_size",
    "sync_bn",
)
#: The optimiser's settings that come from the run's config, not from a checkpoint.
_OPTIMIZER_SETTINGS = ("momentum", "weight_decay", "nesterov", "dampening")


def flat_settings(config: dict) -> dict:
    """A `TrainConfig.to_dict()` with its data settings beside the others.

    Older checkpoints saved them so; settings are compared by name wherever they live.

    >>> flat_settings({"data": {"batch_size": 64}, "epochs": 3})
    {'batch_size': 64, 'epochs': 3}
    """
    data = config.get("data")
    rest = {k: v for k, v in config.items() if k != "data"}
    return {**data, **rest} if isinstance(data, dict) else rest


def changed_settings(saved: dict, current: dict) -> list[str]:
    """The settings of `RESULT_SHAPING` that differ between two `TrainConfig.to_dict()`s.

    >>> changed_settings({"epochs": 10, "workers": 4}, {"epochs": 20, "workers": 8})
    ['epochs']
    """
    return sorted(k for k, v in current.items() if k in RESULT_SHAPING and saved.get(k) != v)


def find_resume_state(cfg: TrainConfig, ckpts: CheckpointStore | None, ctx: DistContext) -> tuple[dict, str] | None:
    """The checkpoint `cfg.resume` names and where it was, or None for a fresh start.

    `cfg.resume` is "none", "auto" or a URL. Rank 0 chooses and tells the others, so a
    checkpoint published meanwhile cannot split the ranks.
    """
    if cfg.resume == "none":
        if ckpts is not None and ctx.is_main and ckpts.keys():
            log.warning(
                "%s already holds checkpoints; this fresh run will write beside them and move 'latest' "
                "(use --resume auto to continue, or another --checkpoint-url)",
                redact_url(cfg.checkpoint_url or ""),
            )
        return None
    if cfg.resume == "auto":
        # Rank 0 finds the newest checkpoint that loads, the others load that one. Its failure
        # reaches them too, rather than leave them in the broadcast until the group's timeout.
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
    # Rank 0 finds what the URL names, the others load that: a folder's `latest` may move meanwhile.
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


def check_same_settings(cfg: TrainConfig, ctx: DistContext, device: torch.device) -> None:
    """Every rank runs with rank 0's settings, or every rank stops here with an error.

    Ranks that differ in batch size or checkpoint settings would hang in a collective. Ranks
    that differ in seed or shuffle would read some samples twice an epoch and others never.
    The ranks that differ name the settings.
    """
    if ctx.world_size == 1:
        return
    flat = flat_settings(cfg.to_dict())
    mine = {name: flat.get(name) for name in (*RESULT_SHAPING, *_SAME_DATA_SETTINGS, *_SAME_RUN_SETTINGS)}
    first = ctx.broadcast_object(mine)
    differ = [name for name in mine if mine[name] != first.get(name)]
    count = torch.full((), float(bool(differ)), dtype=torch.float64, device=device)
    ranks = int(ctx.all_reduce_sum(count).item())
    if differ:
        settings = ", ".join(f"{name}={mine[name]!r} (rank 0: {first.get(name)!r})" for name in differ)
        raise ConfigError(f"rank {ctx.rank} runs with other settings than rank 0: {settings}")
    if ranks:
        raise ConfigError(
            f"{ranks} rank(s) run with other settings than rank 0 (each names them): launch every rank "
            "with the same command line"
        )


def checkpoint_state(trainer, ranks: list[dict]) -> dict:
    """What a checkpoint of `trainer` holds; `ranks` are every rank's RNG states and windows."""
    return {
        "step": trainer.step,
        "epoch": trainer.epoch,
        "finished": trainer.finished,
        "world_size": trainer.ctx.world_size,
        "local_world_size": trainer.ctx.local_world_size,
        "model": trainer.module.state_dict(),
        "optimizer": trainer.optimizer.state_dict(),
        "scheduler": trainer.lr_schedule.scheduler.state_dict(),
        "schedule_offset": trainer.lr_schedule.offset,
        "scaler": trainer.scaler.state_dict(),
        "loader": trainer.train_loader.state_dict(),
        "ranks": ranks,
        "metrics": trainer.metrics.records,
        "classes": trainer.classes,
        "config": trainer.cfg.to_dict(),
        "torch_version": str(torch.__version__),
    }


def resume(trainer) -> list[dict] | None:
    """Load into `trainer` the checkpoint its config names; its metrics, or None for a fresh start."""
    found = find_resume_state(trainer.cfg, trainer.ckpts, trainer.ctx)
    if found is None:
        return None
    state, where = found
    _load_state(trainer, state)
    if not _resumed_from_own_store(trainer.cfg):
        # This run's --checkpoint-url holds nothing of this step: a stop now must write it there.
        trainer.save_schedule.saved_step = None
    if trainer.ctx.is_main:
        log.info("resumed from %s at epoch %d, step %d", where, trainer.epoch, trainer.step)
    return list(state["metrics"])


def _resumed_from_own_store(cfg: TrainConfig) -> bool:
    if cfg.resume == "auto":
        return True
    own = (cfg.checkpoint_url or "").rstrip("/")
    return bool(own) and cfg.resume.startswith(own + "/")


def _load_state(trainer, state: dict) -> None:
    cfg, ctx = trainer.cfg, trainer.ctx
    if list(state["classes"]) != trainer.classes:
        raise ConfigError("the checkpoint was trained on other classes than this dataset's")
    saved, current = flat_settings(state.get("config", {})), flat_settings(cfg.to_dict())
    changed = changed_settings(saved, current)
    if changed and ctx.is_main:
        # Allowed, e.g. more epochs, but the curves will not be those of one run.
        log.warning(
            "resuming with changed settings: %s",
            ", ".join(f"{k} {saved.get(k)!r} -> {current[k]!r}" for k in changed),
        )
    if saved.get("model", cfg.model) != cfg.model:
        raise ConfigError(
            f"the checkpoint holds a {saved['model']}, this run builds a {cfg.model}: resume with --model "
            f"{saved['model']}, or start afresh (--resume none, or another --checkpoint-url)"
        )
    trainer.module.load_state_dict(state["model"])
    # The optimiser's settings are this run's, as the changed settings above said.
    optimizer = trainer.optimizer
    settings = [{k: v for k, v in group.items() if k in _OPTIMIZER_SETTINGS} for group in optimizer.param_groups]
    optimizer.load_state_dict(state["optimizer"])
    for group, own in zip(optimizer.param_groups, settings):
        group.update(own)
    trainer.lr_schedule.scheduler.load_state_dict(state["scheduler"])
    if state["scaler"]:  # empty from a run without fp16: an fp16 scaler then starts afresh
        trainer.scaler.load_state_dict(state["scaler"])
    trainer.step, trainer.epoch = state["step"], state["epoch"]
    # Finished by this run's settings, not the saved run's: one resumed with more epochs goes on.
    trainer.finished = trainer.epoch >= cfg.epochs or trainer.reached_max_steps()
    trainer.save_schedule.saved_step = trainer.step
    trainer.set_train_resolution(state["loader"]["epoch"])
    trainer.train_loader.load_state_dict(state["loader"], strict=not cfg.resume_any_data)
    _load_rank_state(trainer, state["ranks"])
    saved_batch = saved.get("batch_size", cfg.data.batch_size)
    if len(state["ranks"]) != ctx.world_size or saved_batch != cfg.data.batch_size:
        _rebase_lr_schedule(trainer, len(state["ranks"]), saved_batch)
    else:
        trainer.lr_schedule.set(state.get("schedule_offset", 0), trainer.lr_schedule.scheduler.last_epoch)


def _rebase_lr_schedule(trainer, saved_world: int, saved_batch: int) -> None:
    """Resumed on another number of ranks or batch size: an epoch has another number of steps.

    The schedule goes on from where the data is, with this world's peak rate. It ends with
    the data, or at --max-steps, which still counts the run's steps.
    """
    loader, spe, schedule = trainer.train_loader, trainer.steps_per_epoch, trainer.lr_schedule
    position = loader.state.epoch * spe + (spe - len(loader))
    schedule.set(position - trainer.step, position)
    if trainer.ctx.is_main:
        log.warning(
            "checkpoint from %d ranks of batch %d resumed on %d of batch %d: the learning-rate schedule goes on "
            "from step %d of this world's %d (the data's place), not from the saved step %d, with this world's "
            "peak rate %.4g",
            saved_world,
            saved_batch,
            trainer.ctx.world_size,
            trainer.cfg.data.batch_size,
            position,
            schedule.total_steps,
            trainer.step,
            schedule.peak_lr,
        )


def _load_rank_state(trainer, ranks: list[dict]) -> None:
    """This rank's RNG streams and partial metrics window.

    With another world size, the windows' sums are merged, so the next log line counts the
    steps before the checkpoint. The data position carries over exactly, as the plan re-deals
    it, but per-rank RNG streams cannot: they are reseeded.
    """
    ctx = trainer.ctx
    if len(ranks) == ctx.world_size:
        mine = ranks[ctx.rank]
        set_rng_state(mine["rng"], trainer.device)
        trainer.window.load(mine["window"])
        return
    trainer.window.load_merged([rank["window"] for rank in ranks], first=ctx.is_main)
    if ctx.is_main:
        log.warning("checkpoint from %d ranks resumed on %d: RNG streams are reseeded", len(ranks), ctx.world_size)
    seed_everything(trainer.cfg.data.seed + 1_000_003 * trainer.step + ctx.rank)
