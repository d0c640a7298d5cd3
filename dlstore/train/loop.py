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

import contextlib
import json
import logging
import math
import os
import random
import signal
import threading
import time
from dataclasses import replace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from dlstore.errors import ConfigError
from dlstore.train.checkpoint import CheckpointStore, load_checkpoint_url
from dlstore.train.config import TrainConfig, image_size_for_epoch
from dlstore.train.dist import DistContext, setup_distributed
from dlstore.train.metrics import MetricsLog

__all__ = [
    "EXIT_PREEMPTED",
    "Trainer",
    "amp_dtype_for",
    "autocast",
    "build_model",
    "lr_factor",
    "main",
    "param_groups",
    "training_step",
]

log = logging.getLogger(__name__)

# sysexits' EX_TEMPFAIL: "try again later". A job script (or Slurm's --requeue) reruns the
# same command with `--resume auto` when it sees this code.
EXIT_PREEMPTED = 75
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def main(config: TrainConfig) -> int:
    """Train as `config` says; returns 0 when done, `EXIT_PREEMPTED` after a signal-triggered
    checkpoint. Launch one process per GPU (torchrun, srun) or just call it.

    >>> from dlstore.train import TrainConfig, main
    >>> main(TrainConfig(train_url="file:///data/cifar/train", val_url="file:///data/cifar/val",
    ...                  model="resnet18", image_size=32, epochs=2, batch_size=128))  # doctest: +SKIP
    0
    """
    ctx = setup_distributed(device=config.device, timeout_minutes=config.dist_timeout_minutes)
    trainer = None
    try:
        trainer = Trainer(config, ctx)
        return trainer.run()
    finally:
        if trainer is not None:
            trainer.close()
        ctx.close()


# --------------------------------------------------------------------------- pieces


def lr_factor(step: int, cfg: TrainConfig, steps_per_epoch: int, total_steps: int) -> float:
    """The learning rate of optimiser step `step` (0-based), as a fraction of the peak:
    linear warm-up from `warmup_start_factor`, then cosine to `min_lr_factor` or step decay.

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


def build_model(name: str, num_classes: int) -> nn.Module:
    """A torchvision classification model by name (`resnet18`, `resnet50`, ...), randomly
    initialised with `num_classes` outputs."""
    import torchvision

    try:
        return torchvision.models.get_model(name, weights=None, num_classes=num_classes)
    except ValueError as exc:
        choices = ", ".join(torchvision.models.list_models(module=torchvision.models)[:12])
        raise ConfigError(f"unknown model {name!r} ({exc}); e.g. {choices}, ...") from None


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """SGD parameter groups: `weight_decay` on weight matrices and kernels, none on 1-d ones."""
    # No weight decay on BatchNorm weights and biases (all 1-d parameters): decaying them
    # only fights the normalisation and costs accuracy (Goyal et al. 2017, FFCV, timm).
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (no_decay if param.ndim <= 1 else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def autocast(device: torch.device, amp_dtype: torch.dtype | None):
    """Autocast to `amp_dtype` on `device`, or nothing when it is None."""
    if amp_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=amp_dtype)


def training_step(
    model: nn.Module,
    criterion: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    amp_dtype: torch.dtype | None,
    images: torch.Tensor,
    labels: torch.Tensor,
    keep_grads: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimiser step (forward under autocast, backward, step); returns (loss, logits).
    No host sync: the caller decides when to look at the numbers. `dlstore.train.demand`
    times this same function on synthetic data.

    `keep_grads` zeroes the gradients rather than dropping them: under DDP with
    `gradient_as_bucket_view` they are views of the all-reduce buckets, and dropped ones
    would be allocated again and copied into the buckets at every step."""
    with autocast(images.device, amp_dtype):
        logits = model(images)
        loss = criterion(logits, labels)
    optimizer.zero_grad(set_to_none=not keep_grads)
    scaler.scale(loss).backward()  # DDP all-reduces gradients during backward
    scaler.step(optimizer)
    scaler.update()
    return loss, logits


def amp_dtype_for(amp: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype that `amp` ("auto", "bf16", "fp16", "none") means on `device`."""
    if amp == "auto":
        return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else None
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "none": None}[amp]


def _rng_state(device: torch.device) -> dict:
    """This process's RNG states, as tensors and plain values (weights_only-loadable)."""
    _, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        "numpy": {
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        },
        "python": random.getstate(),
    }


def _set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


def _sibling_val_url(train_url: str) -> str | None:
    """`.../val` beside a train URL ending in `/train`, when a dataset is there."""
    from dlstore.manifest import MANIFEST_NAME
    from dlstore.storage import open_store

    if not train_url.rstrip("/").endswith("/train"):
        return None
    candidate = train_url.rstrip("/")[: -len("train")] + "val"
    if not open_store(candidate).exists(MANIFEST_NAME):
        return None
    log.info("evaluating on %s (the val split beside the train split)", candidate)
    return candidate


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _set_determinism(deterministic: bool) -> None:
    if deterministic:
        # cuBLAS reads this when its first handle is made; harmless on the CPU.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    else:
        torch.backends.cudnn.benchmark = True  # fixed input sizes: let cuDNN pick the fastest kernels
        torch.backends.cuda.matmul.allow_tf32 = True  # what is left in float32 under AMP
        torch.backends.cudnn.allow_tf32 = True


# Settings whose change on resume makes the result differ from one uninterrupted run.
_RESULT_SHAPING = (
    "model",
    "batch_size",
    "image_size",
    "resize_min",
    "epochs",
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


class _Window:
    """Sums over the steps since the last log line, on the device (no host sync per step)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.reset()

    def reset(self) -> None:
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self.correct = torch.zeros((), dtype=torch.float64, device=self.device)
        self.samples = 0
        self.steps = 0
        self.data_s = 0.0
        self.compute_s = 0.0
        self.lr = 0.0  # the rate of the window's last step

    def add(self, loss: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor) -> None:
        n = labels.numel()
        self.loss_sum += loss.detach().double() * n
        self.correct += (logits.detach().argmax(1) == labels).sum().double()
        self.samples += n
        self.steps += 1

    def state(self) -> dict:
        # Each rank's own, unreduced sums: restored on the same rank they reproduce exactly
        # the sums (and so the logged means) of an uninterrupted run.
        return {
            "loss_sum": self.loss_sum.item(),
            "correct": self.correct.item(),
            "samples": self.samples,
            "steps": self.steps,
            "data_s": self.data_s,
            "compute_s": self.compute_s,
            "lr": self.lr,
        }

    def load(self, state: dict) -> None:
        self.reset()
        self.loss_sum.fill_(state["loss_sum"])
        self.correct.fill_(state["correct"])
        self.samples, self.steps, self.lr = state["samples"], state["steps"], state["lr"]
        self.data_s, self.compute_s = state["data_s"], state["compute_s"]


# --------------------------------------------------------------------------- trainer


class Trainer:
    """One rank's share of a training run. `main(config)` is the usual entry point."""

    def __init__(self, cfg: TrainConfig, ctx: DistContext) -> None:
        self.cfg, self.ctx = cfg, ctx
        self.device = ctx.device
        self.cuda = self.device.type == "cuda"
        self.amp_dtype = amp_dtype_for(cfg.amp, self.device)
        if self.amp_dtype is not None and not self.cuda:
            log.warning("AMP %s on the CPU is slow on most CPUs; use --amp none there", self.amp_dtype)
        _set_determinism(cfg.deterministic)
        _seed_everything(cfg.seed)  # same seed on every rank: identical initial weights

        self.train_set = self._dataset(cfg.train_url, "train", image_size_for_epoch(cfg, 0))
        self.classes = list(self.train_set.manifest.classes)
        if len(self.classes) < 2:
            raise ConfigError(f"{cfg.train_url}: the manifest lists {len(self.classes)} classes; training needs labels")
        self.train_loader = self._loader(self.train_set)
        self.val_set = self.val_loader = None
        self.val_url = cfg.val_url or _sibling_val_url(cfg.train_url)
        if self.val_url:
            # return_keys: the loader then says which samples are padding (repeats that keep
            # the ranks equal), so evaluation can count each real sample exactly once.
            self.val_set = self._dataset(
                self.val_url, "eval", cfg.eval_image_size or cfg.image_size, shuffle=False, return_keys=True
            )
            # Batch slots stay allocated (and on a GPU page-locked) for the loader's life; the
            # val loader, idle but for a few % of the run, hands its batches over without them.
            self.val_loader = self._loader(self.val_set, shared_slots=False)
        self.steps_per_epoch = len(self.train_loader)
        if self.steps_per_epoch == 0:
            raise ConfigError(f"{cfg.train_url}: no full batch of {cfg.batch_size} per rank; lower --batch-size")
        self.total_steps = cfg.epochs * self.steps_per_epoch
        if cfg.max_steps is not None:
            self.total_steps = min(self.total_steps, cfg.max_steps)

        self.module = build_model(cfg.model, len(self.classes))
        self._build_parallel_model()
        self.global_batch = cfg.batch_size * ctx.world_size
        self.peak_lr = cfg.base_lr * self.global_batch / 256
        self.optimizer = torch.optim.SGD(
            param_groups(self.module, cfg.weight_decay),
            lr=self.peak_lr,
            momentum=cfg.momentum,
            nesterov=cfg.nesterov and cfg.momentum > 0,
        )
        spe, total = self.steps_per_epoch, self.total_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_factor(s, cfg, spe, total))
        # A GradScaler only matters for fp16; bf16 has float32's range.
        self.scaler = torch.amp.GradScaler("cuda", enabled=self.amp_dtype == torch.float16 and self.cuda)
        self.criterion = nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing)

        self.ckpts = CheckpointStore(cfg.checkpoint_url, keep=cfg.keep_checkpoints) if cfg.checkpoint_url else None
        self.metrics = MetricsLog(cfg.output_dir, enabled=ctx.is_main, tensorboard=cfg.tensorboard)
        self.window = _Window(self.device)
        self.step = 0
        self.epoch = 0
        self.finished = False
        self.stop_signal: int | None = None
        self._old_handlers: dict[int, Any] = {}
        self._last_checkpoint = time.monotonic()
        self._saved_step: int | None = None  # the step of the last checkpoint this process wrote or loaded
        self._started = time.monotonic()

    # -- construction -------------------------------------------------------------------
    def _dataset(self, url: str, preset: str, image_size: int, **options: Any):
        from dlstore.dataset import Dataset

        cfg = self.cfg
        return Dataset(
            url,
            cache_dir=cfg.cache_dir,
            cache_limit=cfg.cache_limit,
            transform=preset,
            image_size=image_size,
            batch_size=cfg.batch_size,
            seed=cfg.seed,
            world=self.ctx.world,
            decode_on=cfg.decode_on,
            **options,
        )

    def _loader(self, dataset, shared_slots: bool = True):
        from dlstore.loader import Loader

        # bf16 images straight from the prefetcher: the first convolution under autocast
        # would cast them anyway, and the normalise kernel writes half the bytes.
        dtype = "bfloat16" if self.amp_dtype == torch.bfloat16 else "float32"
        return Loader(
            dataset,
            num_workers=self.cfg.workers,
            device=str(self.device),
            dtype=dtype,
            channels_last=self.cfg.channels_last,
            shared_slots=shared_slots,
        )

    def _build_parallel_model(self) -> None:
        cfg, ctx = self.cfg, self.ctx
        if cfg.sync_bn and ctx.distributed:
            self.module = nn.SyncBatchNorm.convert_sync_batchnorm(self.module)
        self.module.to(self.device)
        if cfg.channels_last:
            self.module.to(memory_format=torch.channels_last)
        model: nn.Module = self.module
        if ctx.distributed:
            from torch.nn.parallel import DistributedDataParallel

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

    # -- signals ------------------------------------------------------------------------
    def _on_signal(self, signum: int, frame: Any) -> None:
        # Only set a flag: the loop checkpoints at the next step boundary, together with
        # the other ranks. Nothing else is safe to do inside a signal handler.
        self.stop_signal = signum

    def _install_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            log.warning("not in the main thread: SIGTERM/SIGUSR1 will not trigger a checkpoint")
            return
        for sig in STOP_SIGNALS:
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)

    def _restore_signals(self) -> None:
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers.clear()

    # -- the run ------------------------------------------------------------------------
    def run(self) -> int:
        self._install_signals()
        try:
            previous = self._resume()
            self._write_config()
            self.metrics.start(previous or [], resume_step=self.step if previous is not None else None)
            if self.finished:
                log.info("the checkpoint at step %d is of a finished run: nothing to do", self.step)
                return 0
            return self._train()
        finally:
            self._restore_signals()

    def _train(self) -> int:
        cfg = self.cfg
        for epoch in range(self.epoch, cfg.epochs):
            self.epoch = epoch
            code = self._train_epoch(epoch)
            if code is not None:
                return code
            self._evaluate(epoch)
            self.epoch = epoch + 1
            if self._reached_max_steps():
                break
            # An epoch boundary is a step boundary too: a signal that came during
            # evaluation is honoured here, with the loader already at the next epoch.
            stop, due = self._control()
            if stop:
                return self._preempt()
            if due:
                self._checkpoint()
        self.finished = True
        self._checkpoint(force=True)
        if self.ctx.is_main:
            log.info("training finished at step %d", self.step)
        return 0

    def _reached_max_steps(self) -> bool:
        return self.cfg.max_steps is not None and self.step >= self.cfg.max_steps

    def _train_epoch(self, epoch: int) -> int | None:
        self._set_train_resolution(epoch)
        loader = self.train_loader
        loader.set_epoch(epoch)
        self.train_model.train()
        bar = self._progress_bar(epoch, initial=self.steps_per_epoch - len(loader))
        batches = iter(loader)
        first = True
        try:
            while not self._reached_max_steps():
                started = time.perf_counter()
                try:
                    if first:
                        # Starting the DataLoader draws its worker seed from torch's global
                        # RNG. Keep that draw out of the training stream (dropout, stochastic
                        # depth): a resumed run starts its loader at another point of it.
                        with torch.random.fork_rng(devices=[]):
                            images, labels = next(batches)[:2]
                        first = False
                    else:
                        images, labels = next(batches)[:2]
                except StopIteration:
                    break
                fetched = time.perf_counter()
                self._train_step(images, labels)
                self.step += 1
                self.window.data_s += fetched - started
                self.window.compute_s += time.perf_counter() - fetched
                if self.step % self.cfg.log_every == 0:
                    self._log_train(epoch, bar)
                if bar is not None:
                    bar.update(1)
                stop, due = self._control()
                if stop:
                    return self._preempt()
                if due:
                    self._checkpoint()
        finally:
            batches.close()  # type: ignore[attr-defined]
            if bar is not None:
                bar.close()
        if self.window.steps:
            self._log_train(epoch, None)  # the epoch's last, partial window
        return None

    def _autocast(self):
        return autocast(self.device, self.amp_dtype)

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
        self.train_loader.close()  # its workers and batch slots are for the old size
        self.train_loader = self._loader(self.train_set)
        self.train_loader.load_state_dict(state)
        log.info("epoch %d: training at %d px", epoch, size)

    def _progress_bar(self, epoch: int, initial: int):
        if not (self.cfg.progress and self.ctx.is_main):
            return None
        from tqdm import tqdm

        return tqdm(total=self.steps_per_epoch, initial=initial, desc=f"epoch {epoch}", unit="step", dynamic_ncols=True)

    # -- logging ------------------------------------------------------------------------
    def _log_train(self, epoch: int, bar: Any) -> None:
        w = self.window
        # The one host<->device sync of the window, and one all-reduce for all three sums. On a
        # GPU the loop runs ahead of the device until this sync: the wait is compute time of
        # the window's steps, or img/s would be overstated. (`torch.full`, not `torch.tensor`:
        # a blocking copy from the host would sync before the clock starts.)
        waited = time.perf_counter()
        count = torch.full((), float(w.samples), dtype=torch.float64, device=self.device)
        sums = torch.stack([w.loss_sum, w.correct, count])
        loss_sum, correct, samples = self.ctx.all_reduce_sum(sums).tolist()
        w.compute_s += time.perf_counter() - waited
        wall = w.data_s + w.compute_s
        record = {
            "split": "train",
            "step": self.step,
            "epoch": epoch,
            "loss": loss_sum / samples,
            "top1": correct / samples,
            "lr": w.lr,
            "image_size": self.train_set.cfg.transform.image_size,
            "samples": int(samples),
            "img_per_s": samples / wall if wall > 0 else None,
            "data_wait_pct": 100.0 * w.data_s / wall if wall > 0 else None,
            "data_wait_ms": 1000.0 * w.data_s / w.steps,
            "compute_ms": 1000.0 * w.compute_s / w.steps,
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
        w.reset()

    def _evaluate(self, epoch: int) -> dict | None:
        """Loss, top-1 and top-5 over the whole val split. Every rank runs the same number of
        batches (the plan pads short ranks); padded samples are masked out of the sums."""
        if self.val_loader is None:
            return None
        loader, dataset = self.val_loader, self.val_set
        loader.set_epoch(epoch)
        k = min(5, len(self.classes))
        sums = torch.zeros(4, dtype=torch.float64, device=self.device)  # loss, top1, top5, samples
        # Each rank's BatchNorm statistics were last updated by its own batch; evaluate (and
        # later checkpoint) rank 0's on every rank, as the next training forward would.
        self.ctx.broadcast_tensors(list(self.module.buffers()))
        self.eval_model.eval()
        # fork_rng: evaluating (and starting its loader) leaves the training RNG stream as it was.
        with torch.random.fork_rng(devices=[]), torch.no_grad(), self._autocast():
            for images, labels, meta in loader:
                logits = self.eval_model(images).float()
                # Pinned by the loader: an asynchronous copy (a blocking one would wait for the GPU).
                real = meta["padding"].to(labels.device, non_blocking=True).logical_not().double()
                loss = F.cross_entropy(logits, labels, reduction="none")
                top = logits.topk(k, dim=1).indices
                hit1 = (top[:, 0] == labels).double()
                hit5 = (top == labels[:, None]).any(dim=1).double()
                sums += torch.stack([(loss * real).sum(), (hit1 * real).sum(), (hit5 * real).sum(), real.sum()])
        self.train_model.train()
        loss_sum, top1, top5, samples = self.ctx.all_reduce_sum(sums).tolist()
        record = {
            "split": "val",
            "step": self.step,
            "epoch": epoch,
            "loss": loss_sum / max(samples, 1),
            "top1": top1 / max(samples, 1),
            "top5": top5 / max(samples, 1),
            "samples": int(samples),
            "image_size": dataset.cfg.transform.image_size,
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
        resolved = {
            "config": self.cfg.to_dict(),
            "resolved": {
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
                "val_url": self.val_url,
                "val_samples": self.val_set.manifest.total_samples if self.val_set else None,
                "torch": str(torch.__version__),
            },
        }
        os.makedirs(self.cfg.output_dir, exist_ok=True)
        with open(os.path.join(self.cfg.output_dir, "config.json"), "w") as file:
            json.dump(resolved, file, indent=1)
        if self.ckpts is not None:
            self.ckpts.put_json("config.json", resolved)

    # -- checkpoints --------------------------------------------------------------------
    def _control(self) -> tuple[bool, bool]:
        """(stop now, checkpoint now), the same on every rank."""
        cfg = self.cfg
        minutes_due = (
            cfg.checkpoint_every_minutes > 0
            and time.monotonic() - self._last_checkpoint >= 60 * cfg.checkpoint_every_minutes
        )
        # Clocks differ between ranks, and a signal may reach only some of them: OR over all.
        stop, minutes_due = self.ctx.any_flags(self.stop_signal is not None, minutes_due)
        steps_due = cfg.checkpoint_every_steps > 0 and self.step % cfg.checkpoint_every_steps == 0
        return stop, self.ckpts is not None and (minutes_due or steps_due)

    def _preempt(self) -> int:
        name = signal.Signals(self.stop_signal).name if self.stop_signal else "a signal on another rank"
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
        if self.ckpts is None or (self.step == self._saved_step and not force):
            return
        mine = {"rng": _rng_state(self.device), "window": self.window.state()}
        ranks = self.ctx.gather_objects(mine)
        if self.ctx.is_main:
            state = {
                "step": self.step,
                "epoch": self.epoch,
                "finished": self.finished,
                "world_size": self.ctx.world_size,
                "local_world_size": self.ctx.local_world_size,
                "model": self.module.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict(),
                "loader": self.train_loader.state_dict(),
                "ranks": ranks,
                "metrics": self.metrics.records,
                "classes": self.classes,
                "config": self.cfg.to_dict(),
                "torch_version": str(torch.__version__),
            }
            self.ckpts.save(state, self.step)
            self.ckpts.put_text("metrics.jsonl", self.metrics.jsonl_text())
        # Nobody runs ahead (or exits) before the checkpoint is published.
        self.ctx.barrier()
        self._last_checkpoint = time.monotonic()
        self._saved_step = self.step

    def _resume(self) -> list[dict] | None:
        """Load the checkpoint `cfg.resume` names; returns its metrics, or None for a fresh start."""
        cfg = self.cfg
        if cfg.resume == "none":
            if self.ckpts is not None and self.ctx.is_main and self.ckpts.keys():
                log.warning(
                    "%s already holds checkpoints; this fresh run will write beside them and move 'latest' "
                    "(use --resume auto to continue, or another --checkpoint-url)",
                    cfg.checkpoint_url,
                )
            return None
        if cfg.resume == "auto":
            # Rank 0 chooses, so a checkpoint published meanwhile cannot split the ranks.
            key = self.ctx.broadcast_object(self.ckpts.latest_key() if self.ctx.is_main else None)
            if key is None:
                log.info("no checkpoint under %s yet: starting fresh", cfg.checkpoint_url)
                return None
            state = self.ckpts.load(key)
            where = self.ckpts.store.join(key)
        else:
            state, where = load_checkpoint_url(cfg.resume), cfg.resume
        self._load_state(state)
        if self.ctx.is_main:
            log.info("resumed from %s at epoch %d, step %d", where, self.epoch, self.step)
        return list(state["metrics"])

    def _load_state(self, state: dict) -> None:
        if list(state["classes"]) != self.classes:
            raise ConfigError("the checkpoint was trained on other classes than this dataset's")
        saved = state.get("config", {})
        changed = sorted(k for k, v in self.cfg.to_dict().items() if k in _RESULT_SHAPING and saved.get(k) != v)
        if changed and self.ctx.is_main:
            # Allowed (e.g. more epochs), but the curves will not be those of one run.
            log.warning(
                "resuming with changed settings: %s",
                ", ".join(f"{k} {saved.get(k)!r} -> {getattr(self.cfg, k)!r}" for k in changed),
            )
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        self.step, self.epoch, self.finished = state["step"], state["epoch"], state["finished"]
        self._saved_step = self.step
        self._set_train_resolution(state["loader"]["epoch"])
        self.train_loader.load_state_dict(state["loader"])
        ranks = state["ranks"]
        if len(ranks) == self.ctx.world_size:
            mine = ranks[self.ctx.rank]
            _set_rng_state(mine["rng"], self.device)
            self.window.load(mine["window"])
        else:
            # Another world size: the data position carries over exactly (the plan re-deals
            # it), but per-rank RNG streams and partial metric windows cannot.
            log.warning(
                "checkpoint from %d ranks resumed on %d: RNG streams are reseeded", len(ranks), self.ctx.world_size
            )
            _seed_everything(self.cfg.seed + 1_000_003 * self.step + self.ctx.rank)

    def close(self) -> None:
        self.metrics.close()
        for loader in (self.train_loader, self.val_loader):
            if loader is not None:
                loader.close()
