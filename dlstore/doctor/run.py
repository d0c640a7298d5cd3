"""`dlstore doctor`: every check in order, from one reading of the environment."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from dlstore.config import DataConfig, StoreConfig, default_cache_dir, parse_size
from dlstore.doctor.check import FAIL, Check, redact
from dlstore.doctor.credentials import credentials_check
from dlstore.doctor.gpu import TorchFacts, cuda_check, gather_torch_facts, nccl_check, torch_check
from dlstore.doctor.launch import distributed_check
from dlstore.doctor.node import LoaderShape, cache_check, decode_check, shm_check
from dlstore.doctor.store_probe import endpoint_check, probe_store
from dlstore.errors import ConfigError
from dlstore.format.manifest import Manifest
from dlstore.world import World

__all__ = ["DoctorOptions", "add_doctor_arguments", "options_from_args", "run_doctor"]


@dataclass(frozen=True)
class DoctorOptions:
    """What to check against: the run's data settings, ranks per node, and the probe's size.

    `data` is the trainer's and bench's `DataConfig`. Its URL may be "" for no dataset, its
    `cache_dir` "" for the default, its `workers` None for the loader's. `ranks_per_node` None
    means the launcher's, else one per visible GPU. `read_bytes` sizes the timed ranged GET.

    >>> DoctorOptions(DataConfig("swift://imagenet/train", batch_size=128)).url
    'swift://imagenet/train'
    """

    data: DataConfig = field(default_factory=lambda: DataConfig(""))
    ranks_per_node: int | None = None
    read_bytes: int = 16 * 2**20

    @property
    def url(self) -> str | None:
        return self.data.url or None


def _secret_values(config: StoreConfig) -> list[str]:
    swift, s3 = config.swift, config.s3
    secrets = (swift.key, swift.application_credential_secret, swift.auth_token, s3.secret_access_key, s3.session_token)
    return [secret.reveal() for secret in secrets if secret]


def _world(env: Mapping[str, str]) -> World:
    """The launcher's world, or a single process when its variables are broken.
    The distributed check reports them."""
    try:
        return World.from_env(env) if any(n in env for n in ("WORLD_SIZE", "SLURM_NTASKS")) else World()
    except ConfigError:
        return World()


def _loader_shape(options: DoctorOptions, ranks_per_node: int) -> LoaderShape:
    """Batch slots per rank: the ring `dlstore.loader.BatchSlots` allocates for its workers."""
    # dlstore.loader imports torch, so this runs only once torch is known to import.
    from dlstore.loader import LoaderConfig, default_workers

    data = options.data
    workers = default_workers(data.workers, World(0, ranks_per_node, ranks_per_node))
    slots = LoaderConfig().prefetch_factor * workers + 2 if workers > 0 else 0
    return LoaderShape(data.batch_size, data.image_size, slots, ranks_per_node)


def _scheme(url: str | None) -> str | None:
    if url is None:
        return None
    return urlsplit(url).scheme if "://" in url else "file"  # a plain path is a file:// store


def _store_checks(options: DoctorOptions, env: Mapping[str, str], config: StoreConfig, emit) -> Manifest | None:
    scheme = _scheme(options.url)
    credentials = credentials_check(scheme, env, config)
    for check in credentials:
        emit(check)
    if options.url is None or any(check.status == FAIL for check in credentials):
        return None
    endpoint = endpoint_check(scheme, config, env)
    if endpoint is not None:
        emit(endpoint)
        if endpoint.status == FAIL:
            return None
    probe = probe_store(options.url, config, options.read_bytes)
    for check in probe.checks:
        emit(check)
    return probe.manifest


def _torch_checks(options: DoctorOptions, env: Mapping[str, str], world: World, emit) -> TorchFacts:
    facts = gather_torch_facts()
    if not facts.torch_error:
        gpus = len(facts.devices)
        ranks = options.ranks_per_node or (world.local_world_size if world.launcher != "none" else max(gpus, 1))
        emit(shm_check(_loader_shape(options, ranks)))
    for check in (torch_check(facts), cuda_check(facts, env), nccl_check(facts, world.world_size)):
        if check is not None:
            emit(check)
    return facts


def run_doctor(
    options: DoctorOptions, env: Mapping[str, str], report: Callable[[Check], None] | None = None
) -> list[Check]:
    """Run every check; `report` sees each as it completes, and the CLI prints it.

    `env` is the environment, read once by the caller. boto3's credential chain and torch
    also look at the process's own.

    >>> checks = run_doctor(DoctorOptions(DataConfig("swift://imagenet/train")), dict(os.environ))   # doctest: +SKIP
    >>> exit_code(checks)                                                                # doctest: +SKIP
    0
    """
    checks: list[Check] = []
    secrets: list[str] = []

    def emit(check: Check) -> None:
        check = redact(check, secrets)
        checks.append(check)
        if report is not None:
            report(check)

    try:
        config = StoreConfig.from_env(env)
    except ConfigError as exc:
        emit(Check("settings", FAIL, str(exc), "fix or unset that variable"))
        config = None
    manifest = None
    if config is not None:
        secrets += _secret_values(config)
        manifest = _store_checks(options, env, config, emit)
    world = _world(env)
    cache_dir = options.data.cache_dir or default_cache_dir(env)
    emit(cache_check(cache_dir, options.data.cache_limit, manifest, world.num_nodes))
    from dlstore.format import shards
    from dlstore.transforms import cpu_decode  # numpy and Pillow: imported only for this check

    emit(decode_check(cpu_decode, shards.tar_headers is not None))
    facts = _torch_checks(options, env, world, emit)
    emit(distributed_check(env, len(facts.devices) or None))
    return checks


def add_doctor_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `dlstore doctor`: `dlstore train`'s data flags, ranks per node, probe size.
    A run's own flags can be checked as they are."""
    parser.add_argument(
        "url", nargs="?", default="", help="dataset URL to check, e.g. swift://imagenet/train (optional)"
    )
    DataConfig.add_arguments(parser)
    parser.add_argument(
        "--ranks-per-node", type=int, help="training processes per node (default: the launcher's, else one per GPU)"
    )
    parser.add_argument("--read-bytes", default="16MiB", help="size of the timed ranged GET (default 16MiB)")


def options_from_args(args: argparse.Namespace) -> DoctorOptions:
    """The options of parsed arguments; `run_doctor` reads and checks the environment."""
    return DoctorOptions(
        data=DataConfig.from_flags(args.url or "", args),
        ranks_per_node=args.ranks_per_node,
        read_bytes=parse_size(args.read_bytes),
    )
