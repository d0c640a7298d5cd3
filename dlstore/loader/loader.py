"""From the dataset to the training loop.

An engine builds this rank's batches in plan order: decode threads, or worker processes for a
GPU. A GPU prefetcher copies them ahead on a side CUDA stream. What the loop sees does not
depend on the engine or its number of workers. The loader counts batches delivered to the
loop, not those built ahead, so `state_dict()` is the exact position.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import Any

import torch

from dlstore.dataset import Dataset
from dlstore.errors import ConfigError, NoSpace
from dlstore.loader.config import THREADS_SCALE_TO, LoaderConfig, default_workers
from dlstore.loader.prefetch import GpuPrefetcher
from dlstore.loader.processes import ProcessEngine
from dlstore.loader.slots import BatchSlots
from dlstore.loader.threads import ThreadEngine
from dlstore.plan import EpochState
from dlstore.transforms import builds_rows_natively, device_jpeg_decoder
from dlstore.world import available_cores

__all__ = ["Loader", "choose_engine", "resolve_auto"]

log = logging.getLogger(__name__)

# A plan setting's value in a loader state that does not record it.
_BEFORE_FINGERPRINTED = {"window_ramp": False}
# Plan settings a loaded state sets rather than checks (`Loader._follow_saved_order`).
_FOLLOWS_THE_STATE = ("window_ramp",)


class Loader:
    """Batches of this rank, on the device, normalised, channels_last::

        ds = dlstore.Dataset("swift://imagenet/train", batch_size=256)
        loader = dlstore.Loader(ds, num_workers=8, device="cuda")  # 8 worker processes
        loader.set_epoch(0)
        for images, labels in loader: ...

    With `Dataset(..., return_keys=True)` each batch is `(images, labels, meta)`. `meta["keys"]`
    are the samples' keys. `meta["padding"]`, on the device, marks samples that repeat one
    delivered this epoch to keep the ranks equal: count them out of evaluation.
    """

    def __init__(self, dataset: Dataset, num_workers: int | None = None, device: str = "cuda", **options: Any) -> None:
        if num_workers is None:
            num_workers = default_workers(dataset.cfg.workers, dataset.world)
        self.cfg = LoaderConfig(num_workers=num_workers, device=device, **options)
        if self.cfg.device.startswith("cuda") and not torch.cuda.is_available():
            log.warning("CUDA is not available: the loader delivers batches on the CPU")
            self.cfg = replace(self.cfg, device="cpu")
        self.device = torch.device(self.cfg.device)
        self.dataset = dataset
        if self.cfg.engine == "auto":
            self.cfg = resolve_auto(self.cfg, dataset, self.device)
        kind = "decode threads" if self.cfg.engine == "threads" else "worker processes"
        log.info("engine: %s, %d %s, batches to %s", self.cfg.engine, self.cfg.num_workers, kind, self.device)
        self.state = EpochState(epoch=0, history=())
        # A state saved in another order resumes on a copy of the dataset until that epoch is
        # left: (the caller's dataset, the epoch planned on the copy, the copy's corrupt count).
        self._resumed_in: tuple[Dataset, int, int] | None = None
        # Made once: an nvImageCodec decoder starts threads and streams.
        self.jpeg_decoder = None
        if dataset.cfg.decode_on == "device":
            self.jpeg_decoder = device_jpeg_decoder(dataset.cfg.device_decoder, self.device)
            log.info("JPEGs decoded on %s by %s", self.device, self.jpeg_decoder.name)
        engine = ThreadEngine if self.cfg.engine == "threads" else ProcessEngine
        self.slots = self._slots(engine.slot_count(self.cfg))
        self.engine: ThreadEngine | ProcessEngine = engine(dataset, self.cfg, self.slots)

    def _slots(self, count: int) -> BatchSlots | None:
        """Slots pay where the batch is copied out of them anyway.

        That is to the GPU, into a float batch on the CPU, or from worker processes. There a
        reused buffer replaces a fresh shared-memory file. A uint8 CPU batch of threads goes as is."""
        cfg, data = self.cfg, self.dataset.cfg
        copied_out = self.device.type == "cuda" or cfg.dtype != "uint8" or cfg.engine == "processes"
        in_process = cfg.engine == "processes" and cfg.num_workers == 0
        if in_process or not (cfg.shared_slots and copied_out and data.decode_on == "worker"):
            return None
        shared = cfg.engine == "processes"  # worker processes write them: in /dev/shm
        try:
            return BatchSlots(count, data.batch_size, data.transform.image_size, self.device, shared=shared)
        except RuntimeError as exc:
            if not shared:
                raise
            # A small container /dev/shm, say. Whole batches are no fallback: they need it too.
            need = count * data.batch_size * data.transform.image_size**2 * 3
            raise NoSpace(
                f"the worker processes' {count} batch slots need {need / 1e6:.0f} MB of /dev/shm ({exc}): give it"
                " more room (docker run --shm-size), or use engine='threads' (no /dev/shm), fewer workers or"
                " smaller batches"
            ) from None

    def set_epoch(self, epoch: int) -> None:
        """Go on to `epoch` from its beginning, unless the loader already stands in it.

        A loaded state's epoch, or one a loop left early, goes on where it stands. A resumed loop
        calls `set_epoch` at each epoch's start and needs exactly that."""
        if epoch != self.state.epoch:
            self.state = EpochState(epoch=epoch, history=())
            self._leave_saved_order()

    def __len__(self) -> int:
        """Batches this rank has left in the current epoch; the same on every rank."""
        return self.dataset.plan(self.state.epoch, self.state.history).num_batches

    def __iter__(self) -> Iterator:
        prefetcher = GpuPrefetcher(
            self.engine.batches(self.state.epoch, self.state.history),
            self.cfg,
            self.device,
            self.slots,
            on_corrupt=self.dataset.cfg.on_corrupt,
            background=self.dataset.cfg.decode_on == "device",
            decoder=self.jpeg_decoder,
            padding_to_device=self.dataset.cfg.return_keys,
        )
        for batch in prefetcher:
            self.state = self.state.advance(self.dataset.world, self.dataset.cfg.batch_size, 1)
            # Counted as delivered, not as built: a pass left early never delivers its lookahead.
            self.dataset.corrupt_samples += batch.get("corrupt", 0) + batch.get("undecodable", 0)
            if self.dataset.cfg.return_keys:
                yield batch["images"], batch["labels"], {"keys": batch["keys"], "padding": batch["padding"]}
            else:
                yield batch["images"], batch["labels"]
        # A finished epoch resumes at the next one.
        self.state = EpochState(epoch=self.state.epoch + 1, history=())
        self._leave_saved_order()

    def close(self) -> None:
        """Stop the decode threads or worker processes now; garbage collection also stops them."""
        self.engine.close()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def state_dict(self) -> dict:
        """The exact position: the epoch and its steps done per world layout.

        It carries a fingerprint of what decides the order: the manifest's shards and plan settings.
        Version 2 has the window ramp, so a version 1 reader refuses it rather than reorder."""
        version = 2 if self.dataset.cfg.window_ramp else 1
        return {"version": version, "seed": self.dataset.cfg.seed, **self.state.to_dict(), "data": self._fingerprint()}

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        """Continue from `state`.

        A state saved on other data or plan settings would replay another order. That skips and
        repeats samples, so it raises `ConfigError` naming what changed. `strict=False` warns
        instead. The window ramp follows the state."""
        if not isinstance(state, Mapping):
            raise ConfigError(f"a loader state is the dict Loader.state_dict() gives, not a {type(state).__name__}")
        version, seed, data = state.get("version"), state.get("seed"), state.get("data")
        if type(version) is not int or version not in (1, 2):  # True == 1, but no state says True
            raise ConfigError(f"unknown loader state version {version!r}")
        if type(seed) is not int or seed != self.dataset.cfg.seed:
            raise ConfigError("loader state was saved with another seed; resuming would change the data order")
        if data is not None and not isinstance(data, Mapping):
            raise ConfigError(f"malformed loader state: its 'data' is {data!r}, not the settings it was saved with")
        saved = {**_BEFORE_FINGERPRINTED, **(data or {})}
        now = self._fingerprint()
        changed = [k for k in now if "data" in state and k not in _FOLLOWS_THE_STATE and saved.get(k) != now[k]]
        if changed:
            what = ", ".join(f"{k} (saved {saved.get(k)!r}, now {now[k]!r})" for k in changed)
            message = f"loader state was saved on other data or plan settings: {what}"
            if strict:
                raise ConfigError(message + "; pass strict=False (dlstore train --resume-any-data) to resume anyway")
            log.warning("%s; resuming anyway, as asked", message)
        position = EpochState.from_dict(state)
        self._follow_saved_order(bool(saved["window_ramp"]), position.epoch)
        try:  # planned now: more steps than the epoch has failed only at the first batch
            self.dataset.plan(position.epoch, position.history)
        except ConfigError as exc:
            self._back_to_configured()
            raise ConfigError(f"loader state: {exc}") from None
        self.state = position

    def _fingerprint(self) -> dict:
        cfg = self.dataset.cfg
        return {
            "manifest": self.dataset.manifest_digest,
            "drop_last": cfg.drop_last,
            "shuffle": cfg.shuffle,
            "shuffle_window": cfg.shuffle_window,
            "window_ramp": cfg.window_ramp,
        }

    def _follow_saved_order(self, window_ramp: bool, epoch: int) -> None:
        """The epoch a state was saved in goes on in its order.

        With the other window ramp setting, `epoch` is planned on a dataset copy with the state's
        setting and a new engine. Later epochs follow the caller's dataset."""
        self._back_to_configured()  # from the copy of an earlier load
        if window_ramp == self.dataset.cfg.window_ramp:
            return
        log.warning(
            "the loader state was saved with window_ramp=%s: epoch %d goes on in that order", window_ramp, epoch
        )
        configured, copy = self.dataset, self.dataset.with_settings(window_ramp=window_ramp)
        self._swap(copy)
        self._resumed_in = (configured, epoch, copy.corrupt_samples)

    def _leave_saved_order(self) -> None:
        """Back to the caller's dataset once the epoch resumed on a copy is left."""
        if self._resumed_in is not None and self.state.epoch != self._resumed_in[1]:
            self._back_to_configured()

    def _back_to_configured(self) -> None:
        """The caller's dataset again, with the corrupt samples the copy counted added to its count."""
        if self._resumed_in is None:
            return
        configured, _, counted_from = self._resumed_in
        copy = self.dataset
        self._swap(configured)
        self._resumed_in = None
        configured.corrupt_samples += copy.corrupt_samples - counted_from

    def _swap(self, dataset: Dataset) -> None:
        """Plan and build on `dataset` from now on, with a new engine.

        It is made before the old one closes, so a failure leaves the loader as it was."""
        engine = type(self.engine)(dataset, self.cfg, self.slots)
        self.engine.close()
        self.dataset, self.engine = dataset, engine


def choose_engine(dataset: Dataset, cfg: LoaderConfig, device: torch.device, shm: str = "/dev/shm") -> str:
    """What `engine="auto"` means: decode threads, unless batches go to a GPU and this install
    lacks the C row builder (`dlstore.transforms.builds_rows_natively`).

    With it, C threads that never take the GIL build the batches, so they keep their pace
    beside a GPU loop's Python. Without it, each image takes the GIL a few times, and there
    processes feed far more. Threads spare /dev/shm, a fork, resident memory and the `__main__`
    guard a fork server needs. Processes need room in `/dev/shm` for the node's batches in
    flight; without it, threads and a warning."""
    if device.type != "cuda" or cfg.num_workers == 0 or builds_rows_natively(dataset.cfg.transform):
        return "threads"
    data = dataset.cfg
    in_flight = cfg.prefetch_factor * cfg.num_workers + 2
    if data.decode_on == "device":  # the JPEGs travel
        per_batch = data.batch_size * dataset.manifest.total_size // max(1, int(dataset.shard_sizes.sum()))
    else:  # uint8 images (in the slots, or handed over): normalised on the device
        per_batch = data.batch_size * data.transform.image_size**2 * 3
    own = in_flight * per_batch * 5 // 4
    node = own * dataset.world.local_world_size
    try:
        usage = shutil.disk_usage(shm)
        total, free = usage.total, usage.free
    except OSError:
        total = free = 0
    # The node's ranks against the size; this rank against what is free, as earlier ranks hold theirs.
    if total < node or free < own:
        log.warning(
            "%s has %.1f GB free of %.1f GB; worker processes need about %.1f GB for this rank's "
            "batches in flight, %.1f GB for the node's %d ranks: decode threads instead, slower "
            "beside a GPU training loop (more shared memory: docker run --shm-size=%dg, or fewer workers)",
            shm, free / 1e9, total / 1e9, own / 1e9, node / 1e9, dataset.world.local_world_size,
            -(-node // 10**9) + 1,
        )  # fmt: skip
        return "threads"
    return "processes"


def resolve_auto(cfg: LoaderConfig, dataset: Dataset, device: torch.device, shm: str = "/dev/shm") -> LoaderConfig:
    """`cfg` with `engine="auto"` resolved by `choose_engine`.

    Worker processes start from a fork server unless `start_method` says otherwise. The loader's
    process runs the cache's threads, and a fork can copy a lock one of them holds. A script
    that starts them needs `if __name__ == "__main__":`."""
    engine = choose_engine(dataset, cfg, device, shm)
    # Threads that decode at once: at most the cores this rank gets.
    decoding = min(cfg.num_workers, max(1, available_cores() // dataset.world.local_world_size))
    if (
        engine == "threads"
        and device.type == "cpu"
        and dataset.cfg.decode_on != "device"
        and not builds_rows_natively(dataset.cfg.transform)
        and decoding > THREADS_SCALE_TO
    ):
        log.warning(
            "engine='auto' chose %d decode threads for CPU batches; past ~%d they stop scaling (the "
            "GIL: on 16 cores, 14 threads fed 0.33-0.36x what 14 worker processes fed), and beside a "
            "GPU training loop they slow it: engine='processes' is faster here (the script then needs "
            "`if __name__ == \"__main__\":`); engine='threads' keeps them without this warning",
            cfg.num_workers, THREADS_SCALE_TO,
        )  # fmt: skip
    start_method = cfg.start_method
    if engine == "processes" and start_method is None:
        start_method = "forkserver"
    return replace(cfg, engine=engine, start_method=start_method)
