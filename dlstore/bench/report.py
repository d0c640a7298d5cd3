"""What the bench found: one run's records, the verdict with its advice, and the tables printed.
Pure data and arithmetic: no torch, nothing measured here."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field

from dlstore.bench.config import BenchConfig
from dlstore.config import TransformConfig
from dlstore.loader.config import THREADS_SCALE_TO
from dlstore.sample_path import STAGES as SAMPLE_STAGES
from dlstore.transforms import builds_rows_natively
from dlstore.world import available_cores

__all__ = [
    "STAGES",
    "WORKER_STAGES",
    "BenchReport",
    "LoaderResult",
    "LoaderRun",
    "ScalingRow",
    "StageSplit",
    "Verdict",
    "advise",
    "demand_for",
    "format_report",
    "stall_pct",
    "verdict_for",
]

# The sample path's stages, as a loader worker runs them, then the copy to the device.
WORKER_STAGES = SAMPLE_STAGES
STAGES = (*SAMPLE_STAGES, "host_to_device")


@dataclass(frozen=True)
class LoaderRun:
    """One timed pass of the loader over the first `batches` batches of epoch 0.

    The first round, one batch per worker, is timed apart in `startup_s`. `images`, `seconds`
    and the rates are those of the batches after it. `first_batch_s` runs from making the loader
    to its first batch. `bytes_fetched` is what the node cache fetched during the pass, and
    `fetch_mb_per_s` those bytes over the whole pass. `connections` is the most the cache had
    open to the store at once in one process; it is measured only from an empty cache."""

    batches: int
    images: int
    seconds: float
    startup_s: float
    images_per_s: float
    mb_per_s: float
    first_batch_s: float = 0.0
    bytes_fetched: int = 0
    fetch_mb_per_s: float | None = None
    connections: int = 0
    engine: str = ""  # "threads" or "processes": what the loader ran on, once "auto" was resolved


@dataclass(frozen=True)
class LoaderResult:
    """A cold pass, a warm one, and the warm one again beside a thread that only runs Python:
    what a training loop's Python costs the loader, as the GIL is shared."""

    batch_size: int
    workers: int
    cold: LoaderRun
    warm: LoaderRun
    beside_python: LoaderRun | None = None


@dataclass(frozen=True)
class StageSplit:
    """Seconds per stage over `images` images of one instrumented single-process pass."""

    cache: str  # "cold" or "warm"
    batch_size: int
    images: int
    seconds: dict[str, float]
    bytes_fetched: int = 0

    @property
    def ms_per_image(self) -> dict[str, float]:
        return {s: 1000.0 * t / max(self.images, 1) for s, t in self.seconds.items()}

    @property
    def worker_ms_per_image(self) -> float:
        """CPU time one worker spends per image, in all stages but host-to-device."""
        return sum(self.ms_per_image[s] for s in WORKER_STAGES)

    @property
    def worker_images_per_s(self) -> float:
        """What one worker process can deliver: the single-core pipeline rate."""
        return 1000.0 / max(self.worker_ms_per_image, 1e-9)

    @property
    def fetch_mb_per_s(self) -> float | None:
        fetch = self.seconds.get("fetch", 0.0)
        return self.bytes_fetched / fetch / 1e6 if self.bytes_fetched and fetch > 0 else None

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["ms_per_image"] = self.ms_per_image
        out["worker_images_per_s"] = self.worker_images_per_s
        out["fetch_mb_per_s"] = self.fetch_mb_per_s
        return out


@dataclass(frozen=True)
class ScalingRow:
    """Data-parallel ranks, each with its own loader, reading disjoint parts of the epoch."""

    procs: int
    backend: str
    batch_size: int
    workers_per_proc: int
    images_per_s: float
    speedup: float
    efficiency: float
    per_rank_images_per_s: tuple[float, ...]


@dataclass(frozen=True)
class Verdict:
    """Delivered ÷ demanded for one loader configuration, and what would help."""

    batch_size: int
    workers: int
    delivered_images_per_s: float
    demanded_images_per_s: float
    ratio: float
    stall_pct: float
    cold_ratio: float
    cold_stall_pct: float
    shared_cpu_images_per_s: float | None  # CPU device: loader and model share the cores
    advice: tuple[str, ...]
    engine: str = ""  # the row's engine: "threads" or "processes"


@dataclass
class BenchReport:
    config: dict
    environment: dict
    dataset: dict
    loader: list[LoaderResult] = field(default_factory=list)
    stages: list[StageSplit] = field(default_factory=list)
    demand: list[dict] = field(default_factory=list)
    scaling: list[ScalingRow] = field(default_factory=list)
    gpu_decode_images_per_s: float | None = None
    gpu_decoder: str | None = None  # the name of the `device_jpeg_decoder` that decoded
    verdicts: list[Verdict] = field(default_factory=list)
    verdict: Verdict | None = None

    def to_dict(self) -> dict:
        return {
            "config": self.config,
            "environment": self.environment,
            "dataset": self.dataset,
            "loader": [dataclasses.asdict(r) for r in self.loader],
            "stages": [s.to_dict() for s in self.stages],
            "demand": self.demand,
            "scaling": [dataclasses.asdict(r) for r in self.scaling],
            "gpu_decode_images_per_s": self.gpu_decode_images_per_s,
            "gpu_decoder": self.gpu_decoder,
            "verdicts": [dataclasses.asdict(v) for v in self.verdicts],
            "verdict": dataclasses.asdict(self.verdict) if self.verdict else None,
        }

    def write_json(self, path: str) -> None:
        with open(path, "w") as out:
            json.dump(self.to_dict(), out, indent=2)
            out.write("\n")


# -- the verdict ----------------------------------------------------------------------------------
def demand_for(report: BenchReport, row: LoaderResult) -> float | None:
    """The model's measured img/s at `row`'s batch size, if it was measured."""
    for entry in report.demand:
        if entry.get("for_batch_size") == row.batch_size and "images_per_s" in entry:
            return float(entry["images_per_s"])
    return None


def stall_pct(delivered: float, demanded: float) -> float:
    """The share of each step spent waiting for data, in percent."""
    # A step waits whenever the loader is slower than the model. With perfect overlap the step
    # rate is min(delivered, demanded), and the wait is the rest of each step.
    return max(0.0, 1.0 - delivered / demanded) * 100.0 if demanded > 0 else 0.0


def verdict_for(report: BenchReport, row: LoaderResult, cfg: BenchConfig, device_type: str) -> Verdict:
    """Delivered ÷ demanded for one measured loader configuration, with the advice for it."""
    demanded = demand_for(report, row) or 0.0
    delivered = row.warm.images_per_s
    warm = next((s for s in report.stages if s.cache == "warm"), None)
    cold = next((s for s in report.stages if s.cache == "cold"), None)
    shared = None
    if device_type == "cpu" and delivered > 0 and demanded > 0:
        # On a CPU the loader's workers and the training step take turns on the same cores.
        shared = 1.0 / (1.0 / delivered + 1.0 / demanded)
    advice = advise(
        delivered=delivered,
        cold_delivered=row.cold.images_per_s,
        demanded=demanded,
        workers=row.workers,
        cores=available_cores(),
        warm=warm,
        cold=cold,
        cuda=device_type == "cuda",
        gpu_decode_images_per_s=report.gpu_decode_images_per_s,
        mean_source_pixels=report.dataset.get("mean_source_pixels"),
        image_size=cfg.image_size,
        engine=row.warm.engine,
        native_rows=builds_rows_natively(TransformConfig("train", cfg.image_size)),
    )
    return Verdict(
        batch_size=row.batch_size,
        workers=row.workers,
        delivered_images_per_s=delivered,
        demanded_images_per_s=demanded,
        ratio=delivered / demanded if demanded else math.inf,
        stall_pct=stall_pct(delivered, demanded),
        cold_ratio=row.cold.images_per_s / demanded if demanded else math.inf,
        cold_stall_pct=stall_pct(row.cold.images_per_s, demanded),
        shared_cpu_images_per_s=shared,
        advice=tuple(advice),
        engine=row.warm.engine,
    )


def advise(
    *,
    delivered: float,
    cold_delivered: float,
    demanded: float,
    workers: int,
    cores: int,
    warm: StageSplit | None,
    cold: StageSplit | None = None,
    cuda: bool = False,
    gpu_decode_images_per_s: float | None = None,
    mean_source_pixels: float | None = None,
    image_size: int = 224,
    engine: str = "",
    native_rows: bool = False,
) -> list[str]:
    """What would make the loader keep up, read off the stage split; a pure function.

    >>> advise(delivered=900, cold_delivered=850, demanded=3000, workers=4, cores=32, warm=None)[0]
    'The loader delivers 0.30 of what the model consumes: expect ~70% of each step waiting for data.'
    """
    if demanded <= 0:
        return ["No demand measured: nothing to compare the loader with."]
    tips = [_rate_tip(delivered, demanded), _cold_cache_tip(cold_delivered, delivered, demanded, cold)]
    # Where a worker's time goes matters only when the warm loader is the bottleneck.
    if delivered < demanded and warm is not None:
        tips += [
            _engine_tip(engine, workers, cores, native_rows),
            _worker_tip(demanded, workers, cores, warm),
            _decode_tip(warm, cuda, gpu_decode_images_per_s),
            _stored_size_tip(mean_source_pixels, image_size),
            _host_side_tip(warm, cuda, workers),
        ]
    return [tip for tip in tips if tip]


def _rate_tip(delivered: float, demanded: float) -> str:
    ratio = delivered / demanded
    if ratio >= 1.0:
        return f"The loader keeps up: it delivers {ratio:.2f}x what the model consumes (warm cache)."
    return (
        f"The loader delivers {ratio:.2f} of what the model consumes: "
        f"expect ~{stall_pct(delivered, demanded):.0f}% of each step waiting for data."
    )


def _cold_cache_tip(cold_delivered: float, delivered: float, demanded: float, cold: StageSplit | None) -> str | None:
    if cold_delivered >= min(demanded, delivered) * 0.9:
        return None
    fetch_rate = cold.fetch_mb_per_s if cold else None
    via = f" (the store gives {fetch_rate:.0f} MB/s per fetch)" if fetch_rate else ""
    return (
        f"From a cold cache it delivers {cold_delivered:.0f} img/s{via}: the first epoch is fetch-bound. "
        "A cache_limit that holds the dataset keeps later epochs warm; more prefetch_shards hides the fetches."
    )


def _engine_tip(engine: str, workers: int, cores: int, native_rows: bool) -> str | None:
    if engine != "threads" or native_rows or min(workers, cores) <= THREADS_SCALE_TO:
        return None
    return (
        f"Worker processes: decode threads stop scaling past ~{THREADS_SCALE_TO} (the GIL; on 16 cores 14 worker "
        "processes fed ~3x what 14 threads fed); try engine='processes' (`dlstore bench --engines "
        "threads,processes` compares them here)."
    )


def _worker_tip(demanded: float, workers: int, cores: int, warm: StageSplit) -> str | None:
    per_worker = warm.worker_images_per_s
    needed = math.ceil(demanded / (per_worker * 0.9))  # ~90% parallel efficiency
    if needed > workers and needed <= cores:
        return (
            f"More workers: each delivers ~{per_worker:.0f} img/s, so {needed} workers would cover "
            f"{demanded:.0f} img/s (you ran {workers}; this machine has {cores} cores)."
        )
    if needed > cores:
        return (
            f"CPU-bound: keeping up needs ~{needed} cores of decode and augment at {per_worker:.0f} img/s each; "
            f"this machine has {cores}."
        )
    return None


def _decode_tip(warm: StageSplit, cuda: bool, gpu_decode_images_per_s: float | None) -> str | None:
    ms, worker_ms = warm.ms_per_image, warm.worker_ms_per_image
    decode_share = ms["decode"] / worker_ms if worker_ms else 0.0
    if decode_share <= 0.3:
        return None
    if not cuda:
        return f"JPEG decoding is {decode_share:.0%} of a worker's time; on a GPU machine, GPU decode helps."
    gain = worker_ms / max(worker_ms - ms["decode"], 1e-9)
    where = f" (it decodes {gpu_decode_images_per_s:.0f} img/s here)" if gpu_decode_images_per_s else ""
    return (
        f"GPU decode: JPEG decoding is {decode_share:.0%} of a worker's time; moving it to the GPU"
        f"{where} would raise the CPU side up to {gain:.1f}x."
    )


def _stored_size_tip(mean_source_pixels: float | None, image_size: int) -> str | None:
    if not mean_source_pixels:
        return None
    wanted = (image_size / 0.875) ** 2  # a short side of image_size/0.875 leaves room for the crops
    if mean_source_pixels <= 1.5 * wanted:
        return None
    share = wanted / mean_source_pixels
    side = round(math.sqrt(mean_source_pixels) * math.sqrt(share) * 1.15)
    return (
        f"Smaller stored images: they average {mean_source_pixels / 1e6:.2f} MP for {image_size} px "
        f"training; re-converting with `--resize-max-side {side}` cuts decode time roughly to "
        f"{share:.0%} of now."
    )


def _host_side_tip(warm: StageSplit, cuda: bool, workers: int) -> str | None:
    ms, worker_ms = warm.ms_per_image, warm.worker_ms_per_image
    if not cuda and ms["host_to_device"] > 0.15 * worker_ms:
        return (
            f"On a CPU device the training process converts and normalises each batch ({ms['host_to_device']:.2f} ms "
            "per image); most of that is page faults on the fresh float batch, which PyTorch's huge-page "
            "allocation (THP_MEM_ALLOC_ENABLE=1 in the environment) cuts."
        )
    if cuda and ms["host_to_device"] > 0.25 * worker_ms / max(workers, 1):
        return (
            f"The training process spends {ms['host_to_device']:.2f} ms per image on pinning, copying and "
            "normalising: a larger device_lookahead or a lower-precision dtype shortens it."
        )
    return None


# -- the terminal tables --------------------------------------------------------------------------
def format_report(report: BenchReport) -> str:
    """The report as the terminal tables `dlstore bench` prints."""
    sections = (_loader_lines, _cold_lines, _stage_lines, _demand_lines, _scaling_lines, _verdict_lines)
    return "\n".join(_header_lines(report) + [line for section in sections for line in section(report)])


def _fmt_rate(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:,.0f}" if x >= 100 else f"{x:,.1f}"


def _table(headers: list[str], rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        return indent + "  ".join(c.rjust(w) for c, w in zip(cells, widths))

    return [line(headers), indent + "  ".join("-" * w for w in widths), *(line(r) for r in rows)]


def _header_lines(report: BenchReport) -> list[str]:
    cfg, env, data = report.config, report.environment, report.dataset
    return [
        f"dlstore bench {data['url']}",
        f"  {data['samples']:,} samples in {data['shards']} shards, {data['mean_sample_bytes'] / 1e3:.1f} KB per sample; "
        f"{cfg['transform']['preset']} transform at {cfg['image_size']} px; {env['device']} ({env['device_name']}), "
        f"{env['cores']} cores",
    ]


def _loader_lines(report: BenchReport) -> list[str]:
    rows = []
    for r in report.loader:
        demanded = next((d for d in report.demand if d.get("for_batch_size") == r.batch_size), {})
        rate = demanded.get("images_per_s")
        rows.append(
            [
                str(r.batch_size),
                str(r.workers),
                r.warm.engine or "-",
                _fmt_rate(r.cold.images_per_s),
                _fmt_rate(r.cold.mb_per_s),
                _fmt_rate(r.warm.images_per_s),
                _fmt_rate(r.warm.mb_per_s),
                _beside_python(r),
                _fmt_rate(rate),
                f"{r.warm.images_per_s / rate:.2f}" if rate else "-",
                f"{stall_pct(r.warm.images_per_s, rate):.0f}%" if rate else "-",
            ]
        )
    headers = [
        "batch",
        "workers",
        "engine",
        "cold img/s",
        "cold MB/s",
        "warm img/s",
        "warm MB/s",
        "beside Python",
        "demand img/s",
        "warm/demand",
        "stall",
    ]
    title = f"loader (>= {report.config['batches']} batches per pass; the first batch of each worker not timed)"
    return ["", title, *_table(headers, rows)]


def _beside_python(r: LoaderResult) -> str:
    """The warm rate beside a Python-busy thread, and its share of the warm rate alone."""
    if r.beside_python is None:
        return "-"
    beside, alone = r.beside_python.images_per_s, r.warm.images_per_s
    return f"{_fmt_rate(beside)} ({beside / alone:.2f})" if alone else _fmt_rate(beside)


def _cold_lines(report: BenchReport) -> list[str]:
    """The cold passes: what they fetched, how fast, on how many connections, and first-batch time."""
    rows = [
        [
            str(r.batch_size),
            str(r.workers),
            r.cold.engine or "-",
            f"{r.cold.bytes_fetched / 1e6:,.1f}",
            _fmt_rate(r.cold.fetch_mb_per_s),
            str(r.cold.connections or "-"),
            f"{r.cold.first_batch_s:.2f}",
        ]
        for r in report.loader
    ]
    if not rows:
        return []
    headers = ["batch", "workers", "engine", "fetched MB", "fetch MB/s", "connections", "first batch s"]
    title = "cold cache (each pass from an empty cache; MB/s over the whole pass, start-up included)"
    return ["", title, *_table(headers, rows)]


def _stage_lines(report: BenchReport) -> list[str]:
    if not report.stages:
        return []
    split = {s.cache: s for s in report.stages}
    lines = ["", f"stages (one process, batch {report.stages[0].batch_size}, ms per image)"]
    on_device = report.config.get("decode_on") == "device"
    # Decoded on the device, the worker's "decode" is a header read and its "augment" a crop plan.
    # The real work happens in the copy. Named so, the table does not seem to decode for free.
    names = {"decode": "read headers", "augment": "plan crops", "host_to_device": "device decode"} if on_device else {}
    stage_rows = []
    for stage in STAGES:
        cells = [names.get(stage, stage.replace("_", "-"))]
        for cache in ("cold", "warm"):
            s = split.get(cache)
            if s is None:
                cells.append("-")
                continue
            ms = s.ms_per_image[stage]
            share = ms / sum(s.ms_per_image.values()) if s.images else 0.0
            cells.append(f"{ms:.3f} ({share:.0%})")
        stage_rows.append(cells)
    stage_rows.append(
        ["one worker img/s" + (" (its part)" if on_device else "")]
        + [_fmt_rate(split[c].worker_images_per_s) if c in split else "-" for c in ("cold", "warm")]
    )
    lines += _table(["stage", "cold", "warm"], stage_rows)
    if on_device:
        lines.append("  --decode-on device: the workers read and plan; decode and augment run on the device")
    fetch = split.get("cold").fetch_mb_per_s if "cold" in split else None
    if fetch:
        lines.append(f"  cold fetch: {fetch:.0f} MB/s from the store (one shard at a time)")
    if report.gpu_decode_images_per_s:
        decoder = report.gpu_decoder or "nvJPEG"
        lines.append(f"  GPU decode ({decoder}, batched): {report.gpu_decode_images_per_s:,.0f} img/s")
    return lines


def _demand_lines(report: BenchReport) -> list[str]:
    if not report.demand:
        return []
    lines = ["", "demand: training steps on synthetic data already on the device"]
    seen = set()
    for d in report.demand:
        if d["batch_size"] in seen:
            continue
        seen.add(d["batch_size"])
        if "error" in d:
            lines.append(f"  batch {d['batch_size']}: not measured ({d['error']})")
            continue
        lines.append(
            f"  {d['model']} {d['precision']}{' channels_last' if d['channels_last'] else ''}"
            f"{' compiled' if d['compiled'] else ''} on {d['device']}, batch {d['batch_size']}: "
            f"{_fmt_rate(d['images_per_s'])} img/s ({d['step_ms']:.0f} ms per step)"
        )
    return lines


def _scaling_lines(report: BenchReport) -> list[str]:
    if not report.scaling:
        return []
    first = report.scaling[0]
    title = (
        f"scaling (warm cache, batch {first.batch_size} and {first.workers_per_proc} workers per process, "
        f"{first.backend})"
    )
    rows = [
        [str(r.procs), _fmt_rate(r.images_per_s), f"{r.speedup:.2f}x", f"{r.efficiency:.0%}"] for r in report.scaling
    ]
    return ["", title, *_table(["procs", "img/s", "speed-up", "efficiency"], rows)]


def _verdict_lines(report: BenchReport) -> list[str]:
    v = report.verdict
    if v is None:
        return []
    engine = f", {v.engine}" if v.engine else ""
    lines = [
        "",
        f"verdict (batch {v.batch_size}, {v.workers} workers{engine}): delivered {_fmt_rate(v.delivered_images_per_s)} "
        f"/ demanded {_fmt_rate(v.demanded_images_per_s)} img/s = {v.ratio:.2f}; expected data stall "
        f"{v.stall_pct:.0f}% warm, {v.cold_stall_pct:.0f}% cold",
    ]
    if v.shared_cpu_images_per_s:
        lines.append(
            f"  (CPU training: loader and model share the cores, so expect about "
            f"{_fmt_rate(v.shared_cpu_images_per_s)} img/s end to end)"
        )
    lines += [f"  - {tip}" for tip in v.advice]
    return lines
