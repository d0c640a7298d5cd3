"""The training loop: DDP ResNet training from a dlstore dataset, evaluation each epoch,
checkpoints to any store URL and exact resume.

Why the loop is shaped the way it is:

* Every decision that changes what the ranks do next (stop for a signal, write a
  checkpoint) is taken at a step boundary and agreed by all ranks with one small
  all-reduce over the gloo control group. A rank that decided alone would enter a
  collective the others never reach, and the job would hang until the NCCL timeout.
* Metrics are summed on the device over a logging window and reduced once per window,
  so the host waits for the GPU only at log steps, not every step.
* Resume is exact: the checkpoint holds the loader's position (batches delivered), the
  optimiser, scheduler and scaler, each rank's RNG states and each rank's partly filled
  metrics window, so an interrupted run logs the same numbers at the same steps as one
  that never stopped (bit for bit on the CPU with `deterministic=True`).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from dlstore.config import DataConfig, writable_dir
from dlstore.dataset import Dataset
from dlstore.errors import ConfigError, StoppedBySignal
from dlstore.loader import Loader
from dlstore.logs import redact_url
from dlstore.storage import open_store
from dlstore.train.checkpoint import CheckpointStore
from dlstore.train.config import TrainConfig, image_size_for_epoch
from dlstore.train.dist import DistContext, setup_distributed
from dlstore.train.evaluate import score, sibling_val_url
from dlstore.train.metrics import MetricsLog
from dlstore.train.resume import (
    RESULT_SHAPING,
    CheckpointSchedule,
    changed_settings,
    find_resume_state,
    flat_settings,
)
from dlstore.train.seeding import rng_state, seed_everything, set_determinism, set_rng_state
from dlstore.train.signals import EXIT_PREEMPTED, StopSignals
from dlstore.train.step import amp_dtype_for, build_model, check_model_name, lr_factor, param_groups, training_step
from dlstore.train.window import StepWindow

__all__ = ["EXIT_PREEMPTED", "Trainer", "main"]

log = logging.getLogger(__name__)

# Beside the result-shaping settings, those that decide which samples each rank reads.
_SAME_DATA_SETTINGS = ("url", "val_url", "shuffle", "shuffle_window", "drop_last", "window_ramp", "transform")
# Settings that decide when the ranks meet in a collective (a log line's all-reduce, a
# checkpoint, the resumed step, a resize, evaluation): a rank that differs waits alone in one.
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


def main(config: TrainConfig) -> int:
    """Train as `config` says; returns 0 when done, `EXIT_PREEMPTED` after a signal-triggered
    checkpoint. Launch one process per GPU (torchrun, srun) or just call it.

    >>> from dlstore.train import TrainConfig, main
    >>> data = DataConfig.from_env("file:///data/cifar/train", image_size=32, batch_size=128)
    >>> main(TrainConfig(data, val_url="file:///data/cifar/val", model="resnet18", epochs=2))  # doctest: +SKIP
    0
    """
    # Installed before anything else: a stop signal during start-up (Slurm's, a scheduler's)
    # ended the process where it stood, with no word said and exit 143 or 138.
    signals = StopSignals(raise_until_training=True)
    ctx = trainer = None
    with signals:
        try:
            ctx = setup_distributed(device=config.device, timeout_minutes=config.dist_timeout_minutes)
            trainer = Trainer(config, ctx, signals)
            return trainer.run()
        except StoppedBySignal as stop:
            log.warning("stopped by %s during start-up, before training: nothing to save; run it again", stop)
            return EXIT_PREEMPTED
        finally:
            signals.note_only()  # a stop now must not cut the clean-up short, nor hide the error
            if trainer is not None:
                trainer.close()
            if ctx is not None:
                ctx.close()


#: The optimiser's settings that come from the run's config, not from a checkpoint.
_OPTIMIZER_SETTINGS = ("momentum", "weight_decay", "nesterov", "dampening")


class _LoaderBrokenByStop(Exception):
    """A rank's training loader failed after a stop signal (`_next_trainable_batch`)."""


class Trainer:
    """One rank's share of a training run. `main(config)` is the usual entry point.

    The parts live beside it: the step (`step.py`), the logging window (`window.py`), the
    evaluation (`evaluate.py`), checkpoint policy and resume (`resume.py`, on `checkpoint.py`),
    pre-emption signals (`signals.py`) and RNG states (`seeding.py`); the Trainer holds the
    state they act on and the order of a run.
    """

    def __init__(self, cfg: TrainConfig, ctx: DistContext, signals: StopSignals | None = None) -> None:
        self.cfg, self.ctx = cfg, ctx
        self.device = ctx.device
        self.cuda = self.device.type == "cuda"
        self.amp_dtype = amp_dtype_for(cfg.amp, self.device)
        if self.amp_dtype is not None and not self.cuda:
            log.warning("AMP %s on the CPU is slow on most CPUs; use --amp none there", self.amp_dtype)
        set_determinism(cfg.deterministic)
        seed_everything(cfg.data.seed)  # same seed on every rank: identical initial weights
        if ctx.is_main:  # its config and metrics go there: refused now rather than after the model is built
            writable_dir(cfg.output_dir, "--output-dir")
        self._check_same_settings()
        check_model_name(cfg.model)
        self._build_data()
        self._build_model()
        self.ckpts = None
        if cfg.checkpoint_url:
            self.ckpts = CheckpointStore(open_store(cfg.checkpoint_url, cfg.data.store), keep=cfg.keep_checkpoints)
        self.schedule = CheckpointSchedule(cfg.checkpoint_every_minutes, cfg.checkpoint_every_steps)
        self.metrics = MetricsLog(cfg.output_dir, enabled=ctx.is_main, tensorboard=cfg.tensorboard)
        self.window = StepWindow(self.device)
        self.signals = signals or StopSignals()
        self.step = 0
        self.skipped_steps = 0  # batches every rank skipped because one rank's was empty
        self.schedule_offset = 0  # the scheduler's steps ahead of `step` (`_set_schedule`)
        self.epoch = 0
        self.finished = False
        self._started = time.monotonic()

    def _check_same_settings(self) -> None:
        """Every rank runs with rank 0's data, result and collective settings, or every rank
        stops here with an error (the ranks that differ name the settings). Different batch
        sizes, --log-every or checkpoint settings made the job hang until the collective
        timeout (30 minutes by default), different seeds or shuffles read some samples twice
        an epoch and others never, silently."""
        if self.ctx.world_size == 1:
            return
        flat = flat_settings(self.cfg.to_dict())
        mine = {name: flat.get(name) for name in (*RESULT_SHAPING, *_SAME_DATA_SETTINGS, *_SAME_RUN_SETTINGS)}
        first = self.ctx.broadcast_object(mine)
        differ = [name for name in mine if mine[name] != first.get(name)]
        count = torch.full((), float(bool(differ)), dtype=torch.float64, device=self.device)
        ranks = int(self.ctx.all_reduce_sum(count).item())
        if differ:
            settings = ", ".join(f"{name}={mine[name]!r} (rank 0: {first.get(name)!r})" for name in differ)
            raise ConfigError(f"rank {self.ctx.rank} runs with other settings than rank 0: {settings}")
        if ranks:
            raise ConfigError(
                f"{ranks} rank(s) run with other settings than rank 0 (each names them): launch every rank "
                "with the same command line"
            )

    # -- construction -------------------------------------------------------------------
    def _build_data(self) -> None:
        """The train and (when there is one) val datasets and loaders, and the step counts."""
        cfg = self.cfg
        self.train_set = self._dataset(cfg.data.replace(image_size=image_size_for_epoch(cfg, 0)))
        self.classes = list(self.train_set.manifest.classes)
        if len(self.classes) < 2:
            raise ConfigError(
                f"{redact_url(cfg.data.url)}: the manifest lists {len(self.classes)} classes; training needs labels"
            )
        self.train_loader = self._loader(self.train_set)
        self.val_set = self.val_loader = None
        self.val_url = cfg.val_url or sibling_val_url(cfg.data.url, cfg.data.store)
        if self.val_url is not None and not cfg.val_url and self.ctx.is_main:
            log.info("evaluating on %s (the val split beside the train split)", redact_url(self.val_url))
        if self.val_url:
            # return_keys: the loader then says which samples are padding (repeats that keep
            # the ranks equal), so evaluation can count each real sample exactly once.
            size = cfg.eval_image_size or cfg.image_size
            val = cfg.data.replace(url=self.val_url, transform="eval", image_size=size, shuffle=False, return_keys=True)
            self.val_set = self._dataset(val)
            self._check_val_classes(self.val_set.manifest.classes)
            # Batch slots stay allocated (and on a GPU page-locked) for the loader's life; the
            # val loader, idle but for a few % of the run, hands its batches over without them.
            self.val_loader = self._loader(self.val_set, shared_slots=False)
        self.steps_per_epoch = len(self.train_loader)
        if self.steps_per_epoch == 0:
            raise ConfigError(
                f"{redact_url(cfg.data.url)}: no full batch of {cfg.data.batch_size} per rank; lower --batch-size"
            )
        self.total_steps = cfg.epochs * self.steps_per_epoch
        if cfg.max_steps is not None:
            self.total_steps = min(self.total_steps, cfg.max_steps)

    def _check_val_classes(self, val_classes: tuple[str, ...]) -> None:
        """Refuse a val set whose labels mean other classes, before an epoch is spent: its
        labels would index the model's outputs wrongly (past them: a crash in the first
        evaluation; within them: a top-1 that means nothing)."""
        if list(val_classes) == self.classes:
            return
        differ = next(
            (i for i, (a, b) in enumerate(zip(self.classes, val_classes)) if a != b),
            min(len(self.classes), len(val_classes)),
        )
        first = (
            f"label {differ} is {self.classes[differ]!r} in training and {val_classes[differ]!r} in val"
            if differ < min(len(self.classes), len(val_classes))
            else "one list is longer"
        )
        raise ConfigError(
            f"the val set {redact_url(self.val_url or '')} has other classes than the training set "
            f"{redact_url(self.cfg.data.url)} "
            f"({len(val_classes)} against {len(self.classes)}; {first}): convert both splits of one dataset, "
            "or give --val-url the split that matches"
        )

    def _build_model(self) -> None:
        """The model (DDP-wrapped, compiled as asked), the optimiser, its schedule and the loss."""
        cfg = self.cfg
        self.module = build_model(cfg.model, len(self.classes))
        self._build_parallel_model()
        self.global_batch = cfg.data.batch_size * self.ctx.world_size
        self.peak_lr = cfg.base_lr * self.global_batch / 256
        self.optimizer = torch.optim.SGD(
            param_groups(self.module, cfg.weight_decay),
            lr=self.peak_lr,
            momentum=cfg.momentum,
            nesterov=cfg.nesterov and cfg.momentum > 0,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor_of())
        # A GradScaler only matters for fp16; bf16 has float32's range.
        self.scaler = torch.amp.GradScaler("cuda", enabled=self.amp_dtype == torch.float16 and self.cuda)
        self.criterion = nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing)

    def _dataset(self, data: DataConfig) -> Dataset:
        return Dataset(data, world=self.ctx.world)

    def _loader(self, dataset, shared_slots: bool = True):
        # bf16 images straight from the prefetcher: the first convolution under autocast
        # would cast them anyway, and the normalise kernel writes half the bytes.
        dtype = "bfloat16" if self.amp_dtype == torch.bfloat16 else "float32"
        loader = Loader(
            dataset,
            device=str(self.device),
            engine=self.cfg.engine,
            # Worker processes (--engine processes) from a fork server, as "auto" starts them:
            # this process runs the cache's and the store's threads, and a fork can copy a lock
            # one of them holds (a worker that never starts).
            start_method="forkserver",
            dtype=dtype,
            channels_last=self.cfg.channels_last,
            shared_slots=shared_slots,
            epochs=self.cfg.epochs,  # nothing fetched for an epoch after the run's last
        )
        log.info("%s: engine %s, %d workers", dataset.cfg.url, loader.cfg.engine, loader.cfg.num_workers)
        return loader

    def _build_parallel_model(self) -> None:
        cfg, ctx = self.cfg, self.ctx
        if cfg.sync_bn and ctx.distributed:
            self.module = nn.SyncBatchNorm.convert_sync_batchnorm(self.module)
        self.module.to(self.device)
        if cfg.channels_last:
            self.module.to(memory_format=torch.channels_last)
        model: nn.Module = self.module
        if ctx.distributed:
            model = DistributedDataParallel(
                self.module,
                device_ids=[self.device.index] if self.cuda else None,
                # Gradients live in the all-reduce buckets: one copy less per step.
                gradient_as_bucket_view=True,
            )
        self.train_model = model
        self.eval_model = self.module  # no DDP for eval: no gradient sync, no buffer broadcast
        if cfg.compile:
            # Compile the DDP wrapper (not the module) so DDPOptimizer splits the graph at
            # bucket boundaries and gradient all-reduce still overlaps backward.
            self.train_model = torch.compile(self.train_model)
            self.eval_model = torch.compile(self.module)

    # -- the run ------------------------------------------------------------------------
    def run(self) -> int:
        with self.signals:
            previous = self._resume()
            self._write_config()
            self.metrics.start(previous or [], resume_step=self.step if previous is not None else None)
            self.signals.note_only()
            if self.finished:
                # A stop during the last epoch's evaluation checkpointed the finished run without it.
                if previous is not None and self._evaluate_a_broken_off_epoch(previous):
                    self._checkpoint(force=True)
                log.info("the checkpoint at step %d is of a finished run: nothing more to do", self.step)
                return 0
            if previous is not None:
                self._evaluate_a_broken_off_epoch(previous)
            try:
                return self._train()
            except KeyboardInterrupt:
                self._say_where_to_go_on()
                raise

    def _evaluate_a_broken_off_epoch(self, records: list[dict]) -> bool:
        """The epoch before the resumed one, when the run stands at its end (the loader at the next
        epoch's start) and it has no val record: a stop signal broke its evaluation off (a
        SIGTERM to the process group ends the val loader's worker processes). Evaluated now,
        with the weights it ended with, as the uninterrupted run did. The same on every rank:
        the records come from the checkpoint. Whether it evaluated."""
        last = self.epoch - 1
        at_its_end = self.train_loader.state.epoch == self.epoch and len(self.train_loader) == self.steps_per_epoch
        if self.val_loader is None or last < 0 or not at_its_end:
            return False
        if any(r.get("split") == "val" and r.get("epoch") == last and r.get("epoch_done") for r in records):
            return False
        log.info("epoch %d's evaluation was broken off: evaluating it now", last)
        self._evaluate(last)
        return True

    def _say_where_to_go_on(self) -> None:
        """After Ctrl-C (no checkpoint first: that is SIGTERM's or SIGUSR1's), what is kept."""
        if not self.ctx.is_main:
            return
        saved = self.schedule.saved_step
        if self.ckpts is not None and saved is not None:
            kept = f"the last checkpoint is step {saved} in {redact_url(self.ckpts.store.url)}: rerun with --resume auto to go on"
        elif self.ckpts is not None:
            kept = (
                f"no checkpoint was written to {redact_url(self.ckpts.store.url)} yet "
                "(the first comes after --checkpoint-every-steps or --checkpoint-every-minutes)"
            )
        else:
            kept = "no checkpoint was written (no --checkpoint-url)"
        log.warning("interrupted at step %d; %s. SIGTERM or SIGUSR1 checkpoint before they stop a run", self.step, kept)

    def _train(self) -> int:
        for epoch in range(self.epoch, self.cfg.epochs):
            self.epoch = epoch
            code = self._train_epoch(epoch)
            if code is not None:
                return code
            # All its batches taken (the loader then stands at the next epoch's start), not an
            # epoch cut short by --max-steps (the loader stays in it).
            done = self.train_loader.state.epoch > epoch or len(self.train_loader) == 0
            self._evaluate(epoch, done)
            if done:
                self.epoch = epoch + 1
            if self._reached_max_steps():
                break
            # An epoch boundary is a step boundary too: a signal that came during
            # evaluation is honoured here, with the loader already at the next epoch.
            code = self._at_step_boundary()
            if code is not None:
                return code
        self.finished = True
        self._checkpoint(force=True)
        if self.ctx.is_main:
            log.info("training finished at step %d", self.step)
        return 0

    def _reached_max_steps(self) -> bool:
        return self.cfg.max_steps is not None and self.step >= self.cfg.max_steps

    def _train_epoch(self, epoch: int) -> int | None:
        """The epoch's steps (from the loader's position); an exit code if the run must stop."""
        self._set_train_resolution(epoch)
        loader = self.train_loader
        loader.set_epoch(epoch)
        self.train_model.train()
        bar = self._progress_bar(epoch, initial=self.steps_per_epoch - len(loader))
        batches = iter(loader)
        try:
            code = self._train_steps(epoch, batches, bar)
        finally:
            batches.close()  # type: ignore[attr-defined]
            if bar is not None:
                bar.close()
        if code is None and self.window.steps:
            self._log_train(epoch, None)  # the epoch's last, partial window
        return code

    def _train_steps(self, epoch: int, batches, bar: Any) -> int | None:
        first = True
        while not self._reached_max_steps():
            started = time.perf_counter()
            try:
                batch = self._next_trainable_batch(batches, first)
            except _LoaderBrokenByStop:
                return self._preempt()
            if batch is None:
                return None
            first = False
            fetched = time.perf_counter()
            self._train_step(*batch)
            self.step += 1
            self.window.data_s += fetched - started
            self.window.compute_s += time.perf_counter() - fetched
            if self.step % self.cfg.log_every == 0:
                self._log_train(epoch, bar)
            if bar is not None:
                bar.update(1)
            code = self._at_step_boundary()
            if code is not None:
                return code
        return None

    def _next_trainable_batch(self, batches, first: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The next batch that every rank trains on, or None at the end of the epoch.

        A batch whose samples were all corrupt arrives empty, and a step on it is NaN (the mean
        loss over nothing, BatchNorm's statistics of nothing) that DDP's all-reduce would hand
        to every rank. All ranks skip such a step together, when any rank's batch is empty: a
        rank that skipped alone would leave the others waiting in a gradient all-reduce it never
        joins, and one that stepped on a stand-in with zero loss weight would still move its
        BatchNorm statistics, the momentum and the weight decay. The ranks deliver equally many
        batches (the plan's invariant), so they agree on each one over the gloo control group:
        a few bytes per step, nothing with one rank. The other ranks' samples of that step go
        untrained; a whole batch corrupt is rare.

        The same agreement carries a loader that failed after a stop signal (its workers ended
        by the signal to the process group): every rank then stops together, with the loader
        standing before this step (`_LoaderBrokenByStop`)."""
        while True:
            before = self.train_loader.state
            broken = False
            try:
                batch = self._next_batch(batches, first)
            except Exception as exc:
                if self.signals.received is None:
                    raise
                # A stop signal to the whole process group (Slurm's) ended the loader's worker
                # processes while this rank waited for a batch: the run stops as for the signal.
                log.warning("the training loader broke off after %s (%s); stopping", self.signals.name, exc)
                broken, batch = True, None
            first = False
            if batch is None and not broken:
                return None  # the epoch's end (the same step on every rank)
            empty, stop = self.ctx.any_flags(not broken and len(batch[1]) == 0, broken)
            if stop:
                self.train_loader.state = before  # no rank trains on this step's batch: a resume reads it
                raise _LoaderBrokenByStop
            if not empty:
                return batch
            self.skipped_steps += 1
            if len(batch[1]) == 0:
                log.warning("after step %d: a batch with no samples (all corrupt): every rank skips a step", self.step)

    @staticmethod
    def _next_batch(batches, first: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(images, labels), or None at the end of the epoch."""
        try:
            if first:
                # Starting the DataLoader draws its worker seed from torch's global RNG. Keep
                # that draw out of the training stream (dropout, stochastic depth): a resumed
                # run starts its loader at another point of it.
                with torch.random.fork_rng(devices=[]):
                    return next(batches)[:2]
            return next(batches)[:2]
        except StopIteration:
            return None

    def _train_step(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        loss, logits = training_step(
            self.train_model,
            self.criterion,
            self.optimizer,
            self.scaler,
            self.amp_dtype,
            images,
            labels,
            keep_grads=self.ctx.distributed,
        )
        self.window.lr = self.optimizer.param_groups[0]["lr"]  # the rate this step used
        self.scheduler.step()
        self.window.add(loss, logits, labels)

    def _set_train_resolution(self, epoch: int) -> None:
        """Progressive resizing: a new loader (same position) when this epoch's size differs."""
        size = image_size_for_epoch(self.cfg, epoch)
        transform = self.train_set.cfg.transform
        if size == transform.image_size:
            return
        state = self.train_loader.state_dict()
        self.train_set = self.train_set.with_transform(replace(transform, image_size=size))
        # Its workers and batch slots are for the old size: gone (their /dev/shm too, which the
        # new loader's engine choice looks at) before the new ones are made.
        self.train_loader.close()
        self.train_loader = None
        self.train_loader = self._loader(self.train_set)
        self.train_loader.load_state_dict(state, strict=not self.cfg.resume_any_data)
        log.info("epoch %d: training at %d px", epoch, size)

    def _progress_bar(self, epoch: int, initial: int) -> tqdm | None:
        if not (self.cfg.progress and self.ctx.is_main):
            return None
        # disable=None: none on a stderr that is no terminal (a log file got a line per step).
        return tqdm(
            total=self.steps_per_epoch,
            initial=initial,
            desc=f"epoch {epoch}",
            unit="step",
            dynamic_ncols=True,
            disable=None,
        )

    # -- logging ------------------------------------------------------------------------
    def _log_train(self, epoch: int, bar: tqdm | None) -> None:
        reduced = self.window.reduce(self.ctx)
        record = {
            "split": "train",
            "step": self.step,
            "epoch": epoch,
            "loss": reduced["loss"],
            "top1": reduced["top1"],
            "lr": self.window.lr,
            "image_size": self.train_set.cfg.transform.image_size,
            "samples": reduced["samples"],
            "img_per_s": reduced["img_per_s"],
            "data_wait_pct": reduced["data_wait_pct"],
            "data_wait_ms": reduced["data_wait_ms"],
            "compute_ms": reduced["compute_ms"],
            "elapsed_s": time.monotonic() - self._started,
        }
        self.metrics.write(record)
        if bar is not None:
            bar.set_postfix(
                loss=f"{record['loss']:.3f}",
                img_s=f"{record['img_per_s'] or 0:.0f}",
                wait=f"{record['data_wait_pct'] or 0:.0f}%",
                refresh=False,
            )
        self.window.reset()

    def _evaluate(self, epoch: int, epoch_done: bool = True) -> dict | None:
        """Loss, top-1 and top-5 over the whole val split. Every rank runs the same number of
        batches (the plan pads short ranks); padded samples are masked out of the sums.
        `epoch_done` is False for an epoch cut by --max-steps: a resume that finishes it scores
        it again, and the record says which of the two is the epoch's."""
        if self.val_loader is None:
            return None
        self.val_loader.set_epoch(epoch)
        # Each rank's BatchNorm statistics were last updated by its own batch; evaluate (and
        # later checkpoint) rank 0's on every rank, as the next training forward would.
        self.ctx.broadcast_tensors(list(self.module.buffers()))
        self.eval_model.eval()
        scores = score(
            self.eval_model,
            self.val_loader,
            self.ctx,
            self.amp_dtype,
            len(self.classes),
            stopping=lambda: self.signals.received is not None,
        )
        self.train_model.train()
        if scores is None:  # broken off by a stop signal: the step boundary after it checkpoints,
            # and the resumed run evaluates this epoch first (`_evaluate_a_broken_off_epoch`)
            if self.ctx.is_main:
                log.warning("epoch %d's evaluation broken off by %s; a resume evaluates it", epoch, self.signals.name)
            return None
        record = {
            "split": "val",
            "step": self.step,
            "epoch": epoch,
            "epoch_done": epoch_done,
            **scores,
            "image_size": self.val_set.cfg.transform.image_size,
            "elapsed_s": time.monotonic() - self._started,
        }
        self.metrics.write(record)
        if self.ctx.is_main:
            log.info(
                "epoch %d step %d: val loss %.4f top-1 %.4f top-5 %.4f",
                epoch,
                self.step,
                record["loss"],
                record["top1"],
                record["top5"],
            )
        return record

    def _write_config(self) -> None:
        if not self.ctx.is_main:
            return
        resolved = {"config": self.cfg.to_dict(), "resolved": self._resolved_settings()}
        os.makedirs(self.cfg.output_dir, exist_ok=True)
        with open(os.path.join(self.cfg.output_dir, "config.json"), "w") as file:
            json.dump(resolved, file, indent=1)
        if self.ckpts is not None:
            self.ckpts.put_json("config.json", resolved)

    def _resolved_settings(self) -> dict:
        """What the config left to the run (world, device, precision, batch, steps), as decided."""
        return {
            "world_size": self.ctx.world_size,
            "local_world_size": self.ctx.local_world_size,
            "backend": self.ctx.backend,
            "device": str(self.device),
            "amp_dtype": str(self.amp_dtype).replace("torch.", "") if self.amp_dtype else None,
            "global_batch": self.global_batch,
            "peak_lr": self.peak_lr,
            "steps_per_epoch": self.steps_per_epoch,
            "total_steps": self.total_steps,
            "num_classes": len(self.classes),
            "train_samples": self.train_set.manifest.total_samples,
            "val_url": redact_url(self.val_url) if self.val_url else None,
            "val_samples": self.val_set.manifest.total_samples if self.val_set else None,
            "torch": str(torch.__version__),
        }

    # -- checkpoints --------------------------------------------------------------------
    def _at_step_boundary(self) -> int | None:
        """Stop (returning the exit code) or checkpoint, as all ranks agree; None to go on."""
        stop, due = self._control()
        if stop:
            return self._preempt()
        if due and not self._no_step_follows():
            self._checkpoint()
        return None

    def _no_step_follows(self) -> bool:
        """The run's last step is done: a checkpoint due now is left to the run's final one, a
        moment later (after the evaluation), which would otherwise upload the same step again.
        (`len(train_loader)` is the batches left in the epoch; asked only when a save is due.)"""
        if self._reached_max_steps() or self.epoch >= self.cfg.epochs:
            return True
        return self.epoch == self.cfg.epochs - 1 and len(self.train_loader) == 0

    def _control(self) -> tuple[bool, bool]:
        """(stop now, checkpoint now), the same on every rank."""
        # Clocks differ between ranks, and a signal may reach only some of them: OR over all.
        stop, minutes_due = self.ctx.any_flags(self.signals.received is not None, self.schedule.minutes_due())
        steps_due = self.schedule.steps_due(self.step)
        return stop, self.ckpts is not None and (minutes_due or steps_due)

    def _preempt(self) -> int:
        name = self.signals.name
        if self.ckpts is None:
            log.warning("stopping at step %d for %s without a checkpoint (no --checkpoint-url)", self.step, name)
        else:
            self._checkpoint()
            if self.ctx.is_main:
                log.warning("stopped at step %d for %s after a checkpoint; rerun with --resume auto", self.step, name)
        return EXIT_PREEMPTED

    def _checkpoint(self, force: bool = False) -> None:
        """Write a checkpoint of this step (a collective: every rank calls it at the same step).

        A second call at the same step (the epoch's last step, then again after its
        evaluation) writes nothing unless forced: resuming from the first redoes the same
        evaluation deterministically."""
        if self.ckpts is None or (self.step == self.schedule.saved_step and not force):
            return
        ranks = self.ctx.gather_objects({"rng": rng_state(self.device), "window": self.window.state()})
        if self.ctx.is_main:
            self.ckpts.save(self._checkpoint_state(ranks), self.step)
            self.ckpts.put_text("metrics.jsonl", self.metrics.jsonl_text())
        # Nobody runs ahead (or exits) before the checkpoint is published.
        self.ctx.barrier()
        self.schedule.mark_saved(self.step)

    def _checkpoint_state(self, ranks: list[dict]) -> dict:
        return {
            "step": self.step,
            "epoch": self.epoch,
            "finished": self.finished,
            "world_size": self.ctx.world_size,
            "local_world_size": self.ctx.local_world_size,
            "model": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "schedule_offset": self.schedule_offset,
            "scaler": self.scaler.state_dict(),
            "loader": self.train_loader.state_dict(),
            "ranks": ranks,
            "metrics": self.metrics.records,
            "classes": self.classes,
            "config": self.cfg.to_dict(),
            "torch_version": str(torch.__version__),
        }

    def _resume(self) -> list[dict] | None:
        """Load the checkpoint `cfg.resume` names; returns its metrics, or None for a fresh start."""
        found = find_resume_state(self.cfg, self.ckpts, self.ctx)
        if found is None:
            return None
        state, where = found
        self._load_state(state)
        if not self._resumed_from_own_store():
            # This run's --checkpoint-url holds nothing of this step: a stop now must write it
            # there, and no message may say a checkpoint is there.
            self.schedule.saved_step = None
        if self.ctx.is_main:
            log.info("resumed from %s at epoch %d, step %d", where, self.epoch, self.step)
        return list(state["metrics"])

    def _resumed_from_own_store(self) -> bool:
        """Whether the checkpoint resumed from is one of --checkpoint-url's."""
        cfg = self.cfg
        if cfg.resume == "auto":
            return True
        own = (cfg.checkpoint_url or "").rstrip("/")
        return bool(own) and cfg.resume.startswith(own + "/")

    def _load_state(self, state: dict) -> None:
        if list(state["classes"]) != self.classes:
            raise ConfigError("the checkpoint was trained on other classes than this dataset's")
        saved, current = flat_settings(state.get("config", {})), flat_settings(self.cfg.to_dict())
        changed = changed_settings(saved, current)
        if changed and self.ctx.is_main:
            # Allowed (e.g. more epochs), but the curves will not be those of one run.
            log.warning(
                "resuming with changed settings: %s",
                ", ".join(f"{k} {saved.get(k)!r} -> {current[k]!r}" for k in changed),
            )
        if saved.get("model", self.cfg.model) != self.cfg.model:
            raise ConfigError(
                f"the checkpoint holds a {saved['model']}, this run builds a {self.cfg.model}: resume with --model "
                f"{saved['model']}, or start afresh (--resume none, or another --checkpoint-url)"
            )
        self.module.load_state_dict(state["model"])
        # The optimiser's settings are this run's: a resume with another --momentum or
        # --weight-decay (warned of above) ran on with the saved ones, silently.
        settings = [
            {k: v for k, v in group.items() if k in _OPTIMIZER_SETTINGS} for group in self.optimizer.param_groups
        ]
        self.optimizer.load_state_dict(state["optimizer"])
        for group, own in zip(self.optimizer.param_groups, settings):
            group.update(own)
        self.scheduler.load_state_dict(state["scheduler"])
        if state["scaler"]:  # empty from a run without fp16: an fp16 scaler then starts afresh
            self.scaler.load_state_dict(state["scaler"])
        self.step, self.epoch = state["step"], state["epoch"]
        # Finished by this run's settings, not the saved run's: one stopped by --max-steps, or
        # resumed with more epochs, goes on (its epoch's rest first, when it stopped mid-epoch).
        self.finished = self.epoch >= self.cfg.epochs or self._reached_max_steps()
        self.schedule.saved_step = self.step
        self._set_train_resolution(state["loader"]["epoch"])
        self.train_loader.load_state_dict(state["loader"], strict=not self.cfg.resume_any_data)
        self._load_rank_state(state["ranks"])
        saved_batch = saved.get("batch_size", self.cfg.data.batch_size)
        if len(state["ranks"]) != self.ctx.world_size or saved_batch != self.cfg.data.batch_size:
            self._rebase_schedule(len(state["ranks"]), saved_batch)
        else:
            # The next step's rate from this run's schedule and peak, not the saved one's: resumed
            # with more --max-steps or --epochs, the first step ran at the old schedule's end
            # rate; with another --base-lr, the whole run at the old peak.
            self._set_schedule(state.get("schedule_offset", 0), self.scheduler.last_epoch)

    def _set_schedule(self, offset: int, position: int) -> None:
        """This run's schedule and peak rate, standing at scheduler step `position`, which is
        `offset` steps ahead of the run's step count (since a resume on another number of
        ranks or batch size): --max-steps, which counts the run's steps, ends the schedule that
        much later. The offset is saved with each checkpoint, so that later resumes keep it."""
        self.schedule_offset = offset
        if self.cfg.max_steps is not None:
            self.total_steps = min(self.cfg.epochs * self.steps_per_epoch, self.cfg.max_steps + offset)
        groups = self.optimizer.param_groups
        self.scheduler.lr_lambdas = [self._lr_factor_of()] * len(groups)
        self.scheduler.base_lrs = [self.peak_lr] * len(groups)
        for group in groups:
            group["initial_lr"] = self.peak_lr
        self.scheduler.last_epoch = position - 1
        self.scheduler.step()  # to `position`: the groups' rates set from it

    def _lr_factor_of(self) -> Callable[[int], float]:
        """The schedule's factor of a scheduler step, for this world's epochs and steps."""
        cfg, spe, total = self.cfg, self.steps_per_epoch, self.total_steps
        return lambda step: lr_factor(step, cfg, spe, total)

    def _rebase_schedule(self, saved_world: int, saved_batch: int) -> None:
        """Resumed on another number of ranks or with another batch size: an epoch has another
        number of steps here, so the saved step count is another point of this world's schedule. The schedule goes on
        from where the data is (the epoch and the batches of it left), with this world's peak
        (the linear scaling rule, for its global batch), and ends with the data, or at
        --max-steps, which still counts the run's steps (the curves' x axis goes on as it was)."""
        loader, spe = self.train_loader, self.steps_per_epoch
        position = loader.state.epoch * spe + (spe - len(loader))
        self._set_schedule(position - self.step, position)
        if self.ctx.is_main:
            log.warning(
                "checkpoint from %d ranks of batch %d resumed on %d of batch %d: the learning-rate schedule goes on "
                "from step %d of this world's %d (the data's place), not from the saved step %d, with this world's "
                "peak rate %.4g",
                saved_world,
                saved_batch,
                self.ctx.world_size,
                self.cfg.data.batch_size,
                position,
                self.total_steps,
                self.step,
                self.peak_lr,
            )

    def _load_rank_state(self, ranks: list[dict]) -> None:
        """This rank's RNG streams and partial metrics window, when the world size is the same;
        with another, the windows' sums merged (the steps before the checkpoint in the next
        log line, as in an uninterrupted run: they were missing from the curves) and the RNG
        streams reseeded."""
        if len(ranks) == self.ctx.world_size:
            mine = ranks[self.ctx.rank]
            set_rng_state(mine["rng"], self.device)
            self.window.load(mine["window"])
            return
        # Another world size: the data position carries over exactly (the plan re-deals it),
        # the windows' sums add up, but per-rank RNG streams cannot carry over.
        self.window.load_merged([rank["window"] for rank in ranks], first=self.ctx.is_main)
        if self.ctx.is_main:
            log.warning(
                "checkpoint from %d ranks resumed on %d: RNG streams are reseeded", len(ranks), self.ctx.world_size
            )
        seed_everything(self.cfg.data.seed + 1_000_003 * self.step + self.ctx.rank)

    def close(self) -> None:
        self.metrics.close()
        for loader in (self.train_loader, self.val_loader):
            if loader is not None:
                loader.close()
