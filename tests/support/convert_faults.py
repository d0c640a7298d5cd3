"""Run `dlstore convert` into failures at many points and report, one JSON line per case, how
each run ended and whether a resume then gave the reference dataset.

test_convert.py runs this in a subprocess with a timeout, so that a conversion that hangs
(workers that never end, a pool join that never returns) fails the test instead of hanging
the suite.

    python tests/support/convert_faults.py SOURCE_DIR WORK_DIR   # an ImageNet-layout SOURCE_DIR

Failure points, all real (no patched code): a directory where the store must put a shard's
tar or its index (the local store's rename fails: `DlstoreError`), a corrupt input under
`strict` (`CorruptSample`), and a progress callback that raises in the parent.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import shutil
import sys
import time
from pathlib import Path

from dlstore.convert import ConvertOptions, ConvertProgress, convert
from dlstore.errors import DlstoreError
from dlstore.format.sample_index import index_name
from dlstore.format.shards import shard_name
from dlstore.storage import open_store

OPTIONS = ConvertOptions(samples_per_shard=3, workers=1)
# (kind, point): which object fails, or after how many finished shards the callback raises.
FAULTS = [("tar", 0), ("idx", 1), ("tar", 4), ("idx", 7), ("tar", 8), ("progress", 0), ("progress", 3), ("strict", 0)]


class ProgressStop(Exception):
    """Raised by the progress callback: the caller stopping a conversion."""


def dataset_files(path: Path) -> dict[str, bytes]:
    """Every object of a file:// dataset, as the store lists them."""
    store = open_store(f"file://{path}")
    return {info.key: store.get_bytes(info.key) for info in store.list("")}


def failing_run(source: Path, out: Path, kind: str, point: int, workers: int) -> dict:
    """Set up the fault, run the conversion, and say how it ended."""
    options = dataclasses.replace(OPTIONS, workers=workers, strict=kind == "strict")
    shard = shard_name(OPTIONS.prefix, point)
    blocked = out / (shard if kind == "tar" else index_name(shard))
    if kind in ("tar", "idx"):
        blocked.mkdir(parents=True)

    def stop_after(progress: ConvertProgress) -> None:
        if kind == "progress" and progress.shards_done >= point:
            raise ProgressStop(f"stopped after {progress.shards_done} shards")

    started = time.monotonic()
    error: BaseException | None = None
    try:
        convert("imagenet", source, f"file://{out}", options, progress=stop_after)
    except (DlstoreError, ProgressStop) as exc:
        error = exc
    seconds = time.monotonic() - started
    if kind in ("tar", "idx"):
        blocked.rmdir()
    return {
        "error": type(error).__name__ if error else None,
        "message": str(error) if error else "",
        "seconds": round(seconds, 3),
        "live_workers": len(multiprocessing.active_children()),
        "temp_files": sorted(p.name for p in out.rglob(".dlstore-tmp-*")),
        "manifest_written": (out / "index.json").exists(),
        "blocked": blocked.name if kind in ("tar", "idx") else None,
    }


def main(source: Path, work: Path, repeats: int) -> None:
    reference = work / "reference"
    convert("imagenet", source, f"file://{reference}", OPTIONS)
    expected = dataset_files(reference)
    number = 0
    for repeat in range(repeats):
        for workers in (1, 2):
            for kind, point in FAULTS:
                out = work / f"case-{number}"
                number += 1
                report = {"kind": kind, "point": point, "workers": workers, "repeat": repeat}
                report.update(failing_run(source, out, kind, point, workers))
                convert("imagenet", source, f"file://{out}", OPTIONS)  # the resume
                report["resumed_same"] = dataset_files(out) == expected
                print(json.dumps(report), flush=True)
                shutil.rmtree(out)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 1)
