"""The trainer's settings: one frozen dataclass, saved beside the outputs and in every checkpoint.

The data settings are the embedded `DataConfig`, the one `Dataset`, `Loader` and the bench take.
The rest is the model, the optimisation, checkpoints and logging."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dlstore.config import DataConfig, repr_hiding_credentials
from dlstore.errors import ConfigError
from dlstore.loader.config import ENGINES
from dlstore.logs import redact_url

__all__ = ["TrainConfig", "add_train_arguments", "config_from_args", "image_size_for_epoch"]

_AMP = ("auto", "bf16", "fp16", "none")
_SCHEDULES = ("cosine", "step")


#: Settings that are URLs, besides the data's own. A password or a presigned query in one is
#: hidden in the config's repr and in the config saved with the run and its checkpoints.
_URL_FIELDS = ("val_url", "checkpoint_url", "resume")


@dataclass(frozen=True)
class TrainConfig:
    """Everything one training run needs; `dlstore train --help` documents each field.

    >>> cfg = TrainConfig(DataConfig.from_env("swift://imagenet/train", batch_size=256),
    ...                   val_url="swift://imagenet/val", model="resnet50", epochs=90)   # doctest: +SKIP

    `data` may be given as a URL alone, with all other data settings at their defaults.
    """

    data: DataConfig | str
    val_url: str | None = None
    output_dir: str = "runs/train"

    # model, device and precision
    model: str = "resnet50"
    device: str = "auto"  # "auto" = this rank's GPU when there is one, else CPU
    amp: str = "auto"  # "auto" = bf16 on CUDA, none on CPU
    channels_last: bool = True
    compile: bool = False
    sync_bn: bool = False

    # data beyond `data`: the loader's engine, evaluation and progressive resizing
    engine: str = "auto"  # decode threads; processes on a GPU without the C row builder: choose_engine
    eval_image_size: int | None = None  # default: image_size
    # Progressive resizing as FFCV does it: image size ramps linearly from resize_min at
    # resize_start_epoch to image_size at resize_end_epoch, in steps of resize_step pixels.
    resize_min: int | None = None
    resize_start_epoch: int = 0
    resize_end_epoch: int = 0
    resize_step: int = 32

    # optimisation
    epochs: int = 90
    base_lr: float = 0.1  # per 256 images of global batch: lr = base_lr * global_batch / 256
    momentum: float = 0.9
    nesterov: bool = True
    weight_decay: float = 5e-5
    label_smoothing: float = 0.1
    warmup_epochs: float = 5.0
    warmup_start_factor: float = 0.1
    schedule: str = "cosine"
    min_lr_factor: float = 0.0  # cosine floor, as a fraction of the peak lr
    step_milestones: tuple[int, ...] = (30, 60, 80)  # epochs, for schedule="step"
    step_gamma: float = 0.1
    max_steps: int | None = None  # stop after this many optimiser steps, for smoke runs

    # checkpoints
    checkpoint_url: str | None = None
    checkpoint_every_steps: int = 0  # 0: off
    checkpoint_every_minutes: float = 30.0  # 0: off
    keep_checkpoints: int = 3
    resume: str = "none"  # "none", "auto", or a checkpoint URL
    # Resume even when the data or the plan settings changed since the checkpoint, so the
    # loader's fingerprint differs. Samples are then skipped or repeated in that epoch.
    resume_any_data: bool = False

    # logging and reproducibility
    log_every: int = 10
    progress: bool = True
    tensorboard: bool = True
    deterministic: bool = False
    dist_timeout_minutes: float = 30.0

    def __post_init__(self) -> None:
        if isinstance(self.data, str):
            object.__setattr__(self, "data", DataConfig(self.data))
        if self.device not in ("auto", "cuda", "cpu"):
            raise ConfigError(f"device must be 'auto', 'cuda' or 'cpu', not {self.device!r}")
        if self.engine not in ("auto", *ENGINES):
            raise ConfigError(f"engine must be 'auto' or one of {ENGINES}, not {self.engine!r}")
        if self.amp not in _AMP:
            raise ConfigError(f"amp must be one of {_AMP}, not {self.amp!r}")
        if self.schedule not in _SCHEDULES:
            raise ConfigError(f"schedule must be one of {_SCHEDULES}, not {self.schedule!r}")
        for name in ("epochs", "log_every", "keep_checkpoints", "resize_step"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, not {getattr(self, name)}")
        if self.checkpoint_every_steps < 0 or self.checkpoint_every_minutes < 0:
            raise ConfigError("checkpoint intervals must not be negative")
        if self.resize_min is not None and not 0 < self.resize_min <= self.image_size:
            raise ConfigError(f"resize_min must be in (0, image_size={self.image_size}], not {self.resize_min}")
        if self.resize_min is not None and self.resize_end_epoch < self.resize_start_epoch:
            raise ConfigError("--resize-end-epoch must not come before --resize-start-epoch")
        if self.resume not in ("none", "auto") and "://" not in self.resume and not self.resume.endswith(".pt"):
            raise ConfigError(f"resume must be 'none', 'auto' or a checkpoint URL, not {self.resume!r}")
        if self.resume == "auto" and not self.checkpoint_url:
            raise ConfigError("--resume auto (resume='auto') needs --checkpoint-url (checkpoint_url) to look in")
        if self.max_steps is not None and self.max_steps < 1:
            raise ConfigError("--max-steps (max_steps) must be at least 1")
        self._check_optimisation()

    def _check_optimisation(self) -> None:
        """The optimiser's and the schedule's numbers, checked before the run starts.
        torch refuses some only at the first step, with a traceback, and takes others silently."""
        bounds = {  # name: (lowest, highest, whether the lowest itself is allowed)
            "base_lr": (0.0, math.inf, False),
            "momentum": (0.0, 1.0, True),
            "weight_decay": (0.0, math.inf, True),
            "label_smoothing": (0.0, 1.0, True),
            "warmup_epochs": (0.0, math.inf, True),
            "warmup_start_factor": (0.0, 1.0, True),
            "min_lr_factor": (0.0, 1.0, True),
            "step_gamma": (0.0, 1.0, False),
            "dist_timeout_minutes": (0.0, math.inf, False),
        }
        for name, (low, high, low_allowed) in bounds.items():
            value = getattr(self, name)
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not (number and (value >= low if low_allowed else value > low) and value <= high):
                where = f"{'[' if low_allowed else '('}{low:g}, {high:g}]".replace("inf]", "inf)")
                flag = "--" + name.replace("_", "-")
                raise ConfigError(f"{flag} ({name}) must be in {where}, not {value!r}")
        milestones = list(self.step_milestones)
        if self.schedule == "step" and (milestones != sorted(milestones) or any(m < 0 for m in milestones)):
            raise ConfigError(f"--step-milestones (step_milestones) must be epochs in rising order, not {milestones}")

    @property
    def image_size(self) -> int:
        """The final training resolution, the data's."""
        return self.data.image_size

    def __repr__(self) -> str:
        return repr_hiding_credentials(self, _URL_FIELDS)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able values, tuples as lists, with the data settings under "data".
        The store's credentials are left out and the URLs' are hidden by `redact_url`."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "data"}
        values.update({name: redact_url(values[name]) for name in _URL_FIELDS if values[name] is not None})
        return json.loads(json.dumps({"data": self.data.to_dict(), **values}))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrainConfig:
        """The inverse of `to_dict`; unknown keys are an error, so a typo is not silently ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ConfigError(f"unknown TrainConfig fields: {sorted(unknown)}")
        values = dict(data)
        if isinstance(values.get("data"), Mapping):
            values["data"] = DataConfig.from_dict(values["data"])
        if "step_milestones" in values:
            values["step_milestones"] = tuple(values["step_milestones"])
        return cls(**values)

    def replace(self, **changes: Any) -> TrainConfig:
        return dataclasses.replace(self, **changes)


def image_size_for_epoch(cfg: TrainConfig, epoch: int) -> int:
    """The training resolution of `epoch` under progressive resizing, or `image_size` without it.
    FFCV's linear ramp, rounded to a multiple of `resize_step`.

    >>> cfg = TrainConfig(DataConfig("x", image_size=192), resize_min=128, resize_start_epoch=2, resize_end_epoch=6)
    >>> [image_size_for_epoch(cfg, e) for e in range(8)]
    [128, 128, 128, 128, 160, 192, 192, 192]
    """
    if cfg.resize_min is None:
        return cfg.image_size
    lo, hi = cfg.resize_min, cfg.image_size
    if epoch <= cfg.resize_start_epoch:
        return lo
    if epoch >= cfg.resize_end_epoch:
        return hi
    fraction = (epoch - cfg.resize_start_epoch) / (cfg.resize_end_epoch - cfg.resize_start_epoch)
    size = round((lo + fraction * (hi - lo)) / cfg.resize_step) * cfg.resize_step
    return min(hi, max(lo, size))


# -- the command line (`dlstore train`) ----------------------------------------------------
# field -> (type, help). Booleans become --flag / --no-flag; the defaults come from TrainConfig.
_CLI: dict[str, tuple[Any, str]] = {
    "val_url": (
        str,
        "dataset URL of the val split, evaluated after every epoch (default: the 'val' beside a '.../train' URL, if there is one)",
    ),
    "output_dir": (str, "where config.json, metrics.jsonl/.csv and TensorBoard events go (rank 0)"),
    "model": (str, "torchvision classification model: resnet18, resnet50, ..."),
    "device": (str, "auto (this rank's GPU if any), cuda or cpu"),
    "amp": (str, "mixed precision: auto (bf16 on CUDA, none on CPU), bf16, fp16 or none"),
    "channels_last": (bool, "NHWC memory layout for the model and the batches"),
    "compile": (bool, "torch.compile the model"),
    "sync_bn": (bool, "synchronise BatchNorm statistics across ranks"),
    "engine": (
        str,
        "auto (decode threads; worker processes on a GPU if the C row builder is not built), threads "
        "(decode threads in the training process) or processes (DataLoader worker processes)",
    ),
    "eval_image_size": (int, "evaluation resolution (default: --image-size)"),
    "resize_min": (int, "progressive resizing: the starting resolution (off when not given)"),
    "resize_start_epoch": (int, "progressive resizing: last epoch at --resize-min"),
    "resize_end_epoch": (int, "progressive resizing: first epoch at --image-size"),
    "resize_step": (int, "progressive resizing: resolutions are multiples of this"),
    "epochs": (int, "epochs to train"),
    "base_lr": (float, "learning rate per 256 images of global batch (scaled linearly)"),
    "momentum": (float, "SGD momentum"),
    "nesterov": (bool, "Nesterov momentum"),
    "weight_decay": (float, "weight decay (never applied to BatchNorm parameters or biases)"),
    "label_smoothing": (float, "label smoothing of the training loss"),
    "warmup_epochs": (float, "linear warm-up length in epochs"),
    "warmup_start_factor": (float, "warm-up starts at this fraction of the peak rate"),
    "schedule": (str, "decay after warm-up: cosine or step"),
    "min_lr_factor": (float, "cosine floor, as a fraction of the peak rate"),
    "step_milestones": (int, "step decay: epochs at which the rate is multiplied by --step-gamma"),
    "step_gamma": (float, "step decay factor"),
    "max_steps": (int, "stop after this many optimiser steps (smoke tests); the lr schedule then ends there"),
    "checkpoint_url": (str, "store URL for checkpoints, e.g. swift://ckpt/run1 or file:///scratch/run1"),
    "checkpoint_every_steps": (int, "checkpoint every N steps (0: off)"),
    "checkpoint_every_minutes": (float, "checkpoint every M minutes (0: off)"),
    "keep_checkpoints": (int, "keep the newest N checkpoints"),
    "resume": (str, "none, auto (the latest checkpoint under --checkpoint-url, if any) or a checkpoint URL"),
    "resume_any_data": (bool, "resume even if the dataset or its plan settings changed since the checkpoint"),
    "log_every": (int, "steps per metrics record"),
    "progress": (bool, "progress bar on rank 0, when stderr is a terminal"),
    "tensorboard": (bool, "TensorBoard events on rank 0"),
    "deterministic": (bool, "torch.use_deterministic_algorithms(True); bit-exact resume on the CPU"),
    "dist_timeout_minutes": (float, "timeout of collective operations"),
}


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every `TrainConfig` field to an argparse parser.
    `train_url` is positional, the data settings come from `DataConfig`, the rest from `_CLI`."""
    DataConfig.add_arguments(parser)
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    parser.add_argument("train_url", help="dataset URL of the training split, e.g. swift://imagenet/train")
    for name, (kind, text) in _CLI.items():
        flag = "--" + name.replace("_", "-")
        default = defaults[name]
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=text)
        elif name == "step_milestones":
            parser.add_argument(flag, type=int, nargs="+", default=list(default), metavar="EPOCH", help=text)
        else:
            shown = "" if default is None else f" (default: {default})"
            parser.add_argument(flag, type=kind, default=default, help=text + shown)


def config_from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> TrainConfig:
    """The `TrainConfig` of parsed `dlstore train` arguments.
    `env`, by default `os.environ`, is read here once for the cache directory and the store."""
    values = {name: getattr(args, name) for name in _CLI}
    values["step_milestones"] = tuple(values["step_milestones"])
    return TrainConfig(DataConfig.from_args(args.train_url, args, env), **values)
