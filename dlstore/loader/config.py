"""The loader's settings: what the batches look like on the device and how they are made."""

from __future__ import annotations

from dataclasses import dataclass

from dlstore.errors import ConfigError
from dlstore.world import World, available_cores

__all__ = ["ENGINES", "START_METHODS", "THREADS_SCALE_TO", "LoaderConfig", "default_workers"]

# "threads": decode threads in the training process, with no fork, /dev/shm or hand-off.
# "processes": DataLoader worker processes. `engine="auto"` picks one by `choose_engine`.
ENGINES = ("threads", "processes")
# How the process engine starts workers. None is torch's default, or a fork server when
# `engine="auto"` chose processes. "forkserver" and "spawn" start them from a fresh interpreter,
# not a copy of this process and its threads' locks.
START_METHODS = (None, "fork", "forkserver", "spawn")
# Decode threads past which the GIL stops them scaling; see `choose_engine`.
THREADS_SCALE_TO = 4


@dataclass(frozen=True)
class LoaderConfig:
    """`num_workers` counts the engine's decode threads or worker processes.

    The `Loader` resolves `engine="auto"`: processes for a GPU, threads otherwise.

    >>> LoaderConfig(num_workers=4, device="cpu", dtype="uint8").engine
    'auto'
    """

    num_workers: int = 8
    device: str = "cuda"
    engine: str = "auto"
    start_method: str | None = None
    # Batches decoded ahead, per worker for processes; batches copied to the device ahead.
    prefetch_factor: int = 2
    device_lookahead: int = 2
    dtype: str = "float32"  # or "bfloat16", "float16", "uint8"; uint8 is not normalised
    normalize: bool = True
    channels_last: bool = True
    timeout_s: float = 0.0
    # Batches go into a ring of buffers allocated once, `BatchSlots`. False hands each batch
    # over as a fresh tensor, torch's default, with more page faults.
    shared_slots: bool = True
    # The epochs the run reads, when known. Near an epoch's end the loader runs on into the
    # next; nothing is built or fetched past the last. None: no end known.
    epochs: int | None = None

    def __post_init__(self) -> None:
        if self.engine not in ("auto", *ENGINES):
            raise ConfigError(f"engine must be 'auto' or one of {ENGINES}, not {self.engine!r}")
        if self.start_method not in START_METHODS:
            raise ConfigError(f"start_method must be one of {START_METHODS}, not {self.start_method!r}")
        if self.num_workers < 0 or self.prefetch_factor < 1 or self.device_lookahead < 0:
            raise ConfigError("num_workers and device_lookahead must not be negative, prefetch_factor at least 1")
        if self.epochs is not None and self.epochs < 1:
            raise ConfigError(f"epochs must be at least 1 (or None: no end known), not {self.epochs}")

    def reads(self, epoch: int) -> bool:
        """Whether the run reads `epoch`, as far as `epochs` tells."""
        return self.epochs is None or epoch < self.epochs

    @property
    def lookahead(self) -> int:
        """Batches the thread engine builds ahead of the one the loop takes."""
        return self.prefetch_factor * max(1, self.num_workers) if self.engine == "processes" else self.prefetch_factor


def default_workers(workers: int | None, world: World) -> int:
    """`workers`, or when None one per core this rank gets of the node's cores.

    More only makes them compete, and torch warns about it."""
    if workers is not None:
        return workers
    return max(1, available_cores() // world.local_world_size)
