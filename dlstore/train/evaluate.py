"""Evaluation: loss, top-1 and top-5 over the val split, `--val-url` or the `val` beside `train`.
Each real sample is counted exactly once across the ranks."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dlstore.config import StoreConfig
from dlstore.format.manifest import MANIFEST_NAME
from dlstore.storage import open_store
from dlstore.train.dist import DistContext
from dlstore.train.step import autocast

__all__ = ["score", "sibling_val_url"]

log = logging.getLogger(__name__)


def sibling_val_url(train_url: str, store_config: StoreConfig | None = None) -> str | None:
    """`.../val` beside a train URL ending in `/train`, when a dataset is there."""
    if not train_url.rstrip("/").endswith("/train"):
        return None
    candidate = train_url.rstrip("/")[: -len("train")] + "val"
    if not open_store(candidate, store_config).exists(MANIFEST_NAME):
        return None
    return candidate


def score(
    model: nn.Module,
    loader,
    ctx: DistContext,
    amp_dtype: torch.dtype | None,
    num_classes: int,
    stopping: Callable[[], bool] = lambda: False,
) -> dict[str, float] | None:
    """Loss, top-1, top-5 and real samples of `model` over one pass of every rank's `loader`.

    The loader must return keys: padded samples are masked out of the sums. None on every
    rank when the pass broke on some rank while `stopping()`: a group's SIGTERM ends the
    loader's workers too, and the run must still reach its checkpoint.
    """
    k = min(5, num_classes)
    # loss, top1, top5, samples, and the ranks whose pass broke off for a stop
    sums = torch.zeros(5, dtype=torch.float64, device=ctx.device)
    # fork_rng: evaluating and starting its loader leave the training RNG stream as it was.
    with torch.random.fork_rng(devices=[]), torch.no_grad(), autocast(ctx.device, amp_dtype):
        try:
            _score_batches(model, loader, k, sums)
        except Exception as exc:  # "DataLoader worker (pid ...) exited unexpectedly", a reset...
            if not stopping():
                raise  # a stop came: whatever broke the pass, the resume evaluates this epoch again
            log.warning("evaluation broken off by the stop signal: %s", exc)
            sums[4] = 1.0
    loss_sum, top1, top5, samples, broken = ctx.all_reduce_sum(sums).tolist()
    if broken:
        return None
    return {
        "loss": loss_sum / max(samples, 1),
        "top1": top1 / max(samples, 1),
        "top5": top5 / max(samples, 1),
        "samples": int(samples),
    }


def _score_batches(model: nn.Module, loader, k: int, sums: torch.Tensor) -> None:
    """Add each batch's loss, hits and real samples into `sums`; no collective in here."""
    for images, labels, meta in loader:
        logits = model(images).float()
        real = meta["padding"].to(labels.device).logical_not().double()  # there already, from the loader
        loss = F.cross_entropy(logits, labels, reduction="none")
        top = logits.topk(k, dim=1).indices
        hit1 = (top[:, 0] == labels).double()
        hit5 = (top == labels[:, None]).any(dim=1).double()
        sums[:4] += torch.stack([(loss * real).sum(), (hit1 * real).sum(), (hit5 * real).sum(), real.sum()])
