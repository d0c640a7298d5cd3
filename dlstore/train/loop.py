"""The training loop: DDP training from a dlstore dataset, evaluated each epoch, checkpointed.

Every decision that changes what the ranks do next is taken at a step boundary. Stopping
for a signal and writing a checkpoint are such decisions. All ranks agree on them with one
small all-reduce over the gloo control group. A rank that decided alone would enter a
collective the others never reach, and the job would hang until the NCCL timeout.

Metrics are summed on the device over a logging window and reduced once per window. So
the host waits for the GPU only at log steps. `resume` says what a checkpoint holds, and
`schedule` when one is due and what the learning rate is.
"""

from __future__ import annotations

import json
import logging
import os
import time
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
from dlstore.train.resume import check_same_settings, checkpoint_state, resume
from dlstore.train.schedule import CheckpointSchedule, LrSchedule
from dlstore.train.seeding import rng_state, seed_everything, set_determinism
from dlstore.train.signals import EXIT_PREEMPTED, StopSignals
from dlstore.train.step import amp_dtype_for, build_model, check_model_name, param_groups, training_step
from dlstore.train.window import StepWindow

__all__ = ["EXIT_PREEMPTED", "Trainer", "main"]

log = logging.getLogger(__name__)


def main(config: TrainConfig) -> int:
    """Train as `config` says: 0 when done, `EXIT_PREEMPTED` after a stop signal's checkpoint.

    Launch one process per GPU with torchrun or srun, or just call it.

    >>> from dlstore.train import TrainConfig, main
    >>> data = DataConfig.from_env("file:///data/cifar/train", image_size=32, batch_size=128)
    >>> main(TrainConfig(data, val_url="file:///data/cifar/val", model="resnet18", epochs=2))  # doctest: +SKIP
    0
    """
    # Installed first: a stop signal during start-up ends the run with a word, not silently.
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


class _LoaderBrokenByStop(Exception):
    """A rank's training loader failed after a stop signal, in `_next_trainable_batch`."""


class Trainer:
    """One rank's share of a training run. `main(config)` is the usual entry point.

    The parts live beside it: the step, the logging window, the evaluation, the schedules,
    resume, pre-emption signals and RNG states. The Trainer holds the state they act on
    and the order of a run.
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
        check_same_settings(cfg, ctx, self.device)
        check_model_name(cfg.model)
        self._build_data()
        self._build_model()
        self.ckpts = None
        if cfg.checkpoint_url:
            self.ckpts = CheckpointStore(open_store(cfg.checkpoint_url, cfg.data.store), keep=cfg.keep_checkpoints)
        self.save_schedule = CheckpointSchedule(cfg.checkpoint_every_minutes, cfg.checkpoint_every_steps)
        self.metrics = MetricsLog(cfg.output_dir, enabled=ctx.is_main, tensorboard=cfg.tensorboard)
        self.window = StepWindow(self.device)
        self.signals = signals or StopSignals()
        self.step = 0
        self.skipped_steps = 0  # batches every rank skipped because one rank's was empty
        self.epoch = 0
        self.finished = False
        self._started = time.monotonic()

    # -- construction -------------------------------------------------------------------
    def _build_data(self) -> None:
        """The train and val datasets and loaders, when there is a val split, and the step counts."""
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
            # return_keys: the loader says which samples are padding, so each counts once.
            size = cfg.eval_image_size or cfg.image_size
            val = cfg.data.replace(url=self.val_url, transform="eval", image_size=size, shuffle=False, return_keys=True)
            self.val_set = self._dataset(val)
            self._check_val_classes(self.val_set.manifest.classes)
            # The val loader is mostly idle: it hands batches over without slots held for life.
            self.val_loader = self._loader(self.val_set, shared_slots=False)
        self.steps_per_epoch = len(self.train_loader)
        if self.steps_per_epoch == 0:
            raise ConfigError(
                f"{redact_url(cfg.data.url)}: no full batch of {cfg.data.batch_size} per rank; lower --batch-size"
            )

    def _check_val_classes(self, val_classes: tuple[str, ...]) -> None:
        """Refuse a val set whose labels mean other classes, before an epoch is spent.

        Its labels would index the model's outputs wrongly, and its top-1 would mean nothing.
        """
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
        """The model, DDP-wrapped and compiled as asked, the optimiser, its schedule and the loss."""
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
        self.lr_schedule = LrSchedule(cfg, self.optimizer, self.peak_lr, self.steps_per_epoch)
        # A GradScaler only matters for fp16; bf16 has float32's range.
        self.scaler = torch.amp.GradScaler("cuda", enabled=self.amp_dtype == torch.float16 and self.cuda)
        self.criterion = nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing)

    def _dataset(self, data: DataConfig) -> Dataset:
        return Dataset(data, world=self.ctx.world)

    def _loader(self, dataset, shared_slots: bool = True):
        # bf16 images straight from the prefetcher: autocast would cast them anyway.
        dtype = "bfloat16" if self.amp_dtype == torch.bfloat16 else "float32"
        loader = Loader(
            dataset,
            device=str(self.device),
            engine=self.cfg.engine,
            # Worker processes from a fork server: a fork of this threaded process could copy
            # a lock one of the cache's or store's threads holds.
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
            # Compile the DDP wrapper, not the module, so that the all-reduce overlaps backward.
            self.train_model = torch.compile(self.train_model)
            self.eval_model = torch.compile(self.module)

    # -- the run ------------------------------------------------------------------------
    def run(self) -> int:
        with self.signals:
            previous = resume(self)
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
        """Evaluate the epoch before the resumed one if a stop signal broke its evaluation off.

        That is when the run stands at the epoch's end and the epoch has no val record. The
        records come from the checkpoint, so every rank decides the same. Whether it evaluated.
        """
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
        """After Ctrl-C, which writes no checkpoint first, say what is kept."""
        if not self.ctx.is_main:
            return
        saved = self.save_schedule.saved_step
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
            # All its batches taken, so the loader stands at the next epoch's start. An epoch
            # cut short by --max-steps is not done, and the loader stays in it.
            done = self.train_loader.state.epoch > epoch or len(self.train_loader) == 0
            self._evaluate(epoch, done)
            if done:
                self.epoch = epoch + 1
            if self.reached_max_steps():
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

    def reached_max_steps(self) -> bool:
        return self.cfg.max_steps is not None and self.step >= self.cfg.max_steps

    def _train_epoch(self, epoch: int) -> int | None:
        """The epoch's steps from the loader's position; an exit code if the run must stop."""
        self.set_train_resolution(epoch)
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
        while not self.reached_max_steps():
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

        A batch whose samples were all corrupt arrives empty, and a step on it is NaN. DDP's
        all-reduce would hand that NaN to every rank. So all ranks skip the step together
        when any rank's batch is empty. A rank that skipped alone would leave the others
        waiting in an all-reduce it never joins. The ranks agree on each batch over the gloo
        control group: a few bytes per step.

        The same agreement carries a loader that failed after a stop signal. Every rank then
        stops together, with the loader standing before this step (`_LoaderBrokenByStop`).
        """
        while True:
            before = self.train_loader.state
            broken = False
            try:
                batch = self._next_batch(batches, first)
            except Exception as exc:
                if self.signals.received is None:
                    raise
                # A stop signal to the whole process group, as Slurm sends, ended the loader's
                # workers while this rank waited for a batch. The run stops as for the signal.
                log.warning("the training loader broke off after %s (%s); stopping", self.signals.name, exc)
                broken, batch = True, None
            first = False
            if batch is None and not broken:
                return None  # the epoch's end, the same step on every rank
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
                # Starting the loader draws a worker seed from torch's global RNG. Keep that
                # draw out of the training stream: a resumed run starts its loader elsewhere in it.
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
        self.lr_schedule.scheduler.step()
        self.window.add(loss, logits, labels)

    def set_train_resolution(self, epoch: int) -> None:
        """Progressive resizing: a new loader at the same position when this epoch's size differs."""
        size = image_size_for_epoch(self.cfg, epoch)
        transform = self.train_set.cfg.transform
        if size == transform.image_size:
            return
        state = self.train_loader.state_dict()
        self.train_set = self.train_set.with_transform(replace(transform, image_size=size))
        # The old loader's workers and slots, /dev/shm included, go before the new ones come.
        self.train_loader.close()
        self.train_loader = None
        self.train_loader = self._loader(self.train_set)
        self.train_loader.load_state_dict(state, strict=not self.cfg.resume_any_data)
        log.info("epoch %d: training at %d px", epoch, size)

    def _progress_bar(self, epoch: int, initial: int) -> tqdm | None:
        if not (self.cfg.progress and self.ctx.is_main):
            return None
        # disable=None: no bar on a stderr that is no terminal.
        total = self.steps_per_epoch
        return tqdm(total=total, initial=initial, desc=f"epoch {epoch}", unit="step", dynamic_ncols=True, disable=None)

    # -- logging ------------------------------------------------------------------------
    def _log_train(self, epoch: int, bar: tqdm | None) -> None:
        reduced = self.window.reduce(self.ctx)
        record = {"split": "train", "step": self.step, "epoch": epoch, "loss": reduced["loss"], "top1": reduced["top1"]}
        record |= {"lr": self.window.lr, "image_size": self.train_set.cfg.transform.image_size}
        record |= {k: reduced[k] for k in ("samples", "img_per_s", "data_wait_pct", "data_wait_ms", "compute_ms")}
        record["elapsed_s"] = time.monotonic() - self._started
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
        """Loss, top-1 and top-5 over the whole val split.

        Every rank runs the same number of batches; padded samples are masked out of the sums.
        `epoch_done` is False for an epoch cut by --max-steps: a resume that finishes it
        scores it again, and the record says which of the two is the epoch's.
        """
        if self.val_loader is None:
            return None
        self.val_loader.set_epoch(epoch)
        # Each rank's BatchNorm statistics were last updated by its own batch. Evaluate and
        # later checkpoint rank 0's on every rank, as the next training forward would.
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
            # and the resumed run evaluates this epoch first in `_evaluate_a_broken_off_epoch`
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
        """What the config left to the run, as decided: world, device, precision, batch, steps."""
        return {
            "world_size": self.ctx.world_size,
            "local_world_size": self.ctx.local_world_size,
            "backend": self.ctx.backend,
            "device": str(self.device),
            "amp_dtype": str(self.amp_dtype).replace("torch.", "") if self.amp_dtype else None,
            "global_batch": self.global_batch,
            "peak_lr": self.peak_lr,
            "steps_per_epoch": self.steps_per_epoch,
            "total_steps": self.lr_schedule.total_steps,
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
        """Whether the run's last step is done: a checkpoint due now is left to the final one.

        The final one follows the evaluation, and would upload the same step again.
        """
        if self.reached_max_steps() or self.epoch >= self.cfg.epochs:
            return True
        return self.epoch == self.cfg.epochs - 1 and len(self.train_loader) == 0

    def _control(self) -> tuple[bool, bool]:
        """Whether to stop now and whether to checkpoint now, the same on every rank."""
        # Clocks differ between ranks, and a signal may reach only some of them: OR over all.
        stop, minutes_due = self.ctx.any_flags(self.signals.received is not None, self.save_schedule.minutes_due())
        steps_due = self.save_schedule.steps_due(self.step)
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
        """Write a checkpoint of this step. A collective: every rank calls it at the same step.

        A second call at the same step writes nothing unless forced. Resuming from the first
        redoes the same evaluation deterministically.
        """
        if self.ckpts is None or (self.step == self.save_schedule.saved_step and not force):
            return
        ranks = self.ctx.gather_objects({"rng": rng_state(self.device), "window": self.window.state()})
        if self.ctx.is_main:
            self.ckpts.save(checkpoint_state(self, ranks), self.step)
            self.ckpts.put_text("metrics.jsonl", self.metrics.jsonl_text())
        # Nobody runs ahead or exits before the checkpoint is published.
        self.ctx.barrier()
        self.save_schedule.mark_saved(self.step)

    def close(self) -> None:
        self.metrics.close()
        for loader in (self.train_loader, self.val_loader):
            if loader is not None:
                loader.close()
