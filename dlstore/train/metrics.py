"""The run's metrics: a JSONL file of record, a CSV copy and TensorBoard events.

Only rank 0 writes. Every record has `split`, "train" or "val", and `step`, the optimiser
steps done. No split and step pair is written twice. On resume the files are rebuilt from the
checkpoint's records. So a run interrupted any number of times leaves the same files as one
that never was, apart from timings.
"""

from __future__ import annotations

import csv
import json
import logging
import os
from collections.abc import Iterable

__all__ = ["CSV_COLUMNS", "MetricsLog", "read_metrics"]

log = logging.getLogger(__name__)

CSV_COLUMNS = (
    "split",
    "step",
    "epoch",
    "epoch_done",
    "loss",
    "top1",
    "top5",
    "lr",
    "image_size",
    "samples",
    "img_per_s",
    "data_wait_pct",
    "data_wait_ms",
    "compute_ms",
    "elapsed_s",
)
# What TensorBoard shows, per split.
_SCALARS = ("loss", "top1", "top5", "lr", "img_per_s", "data_wait_pct", "image_size")


def read_metrics(path: str) -> list[dict]:
    """The records of a metrics JSONL file."""
    with open(path) as file:
        return [json.loads(line) for line in file if line.strip()]


class MetricsLog:
    """Append-only metrics with files that can be rebuilt from the records at any step.

    For example::

        m = MetricsLog("runs/r1", enabled=True)
        m.start(previous=[])
        m.write({"split": "train", "step": 10, "loss": 2.3})
    """

    def __init__(self, output_dir: str, *, enabled: bool = True, tensorboard: bool = True) -> None:
        self.output_dir = output_dir
        self.enabled = enabled
        self.use_tensorboard = tensorboard
        self.records: list[dict] = []
        self.jsonl_path = os.path.join(output_dir, "metrics.jsonl")
        self.csv_path = os.path.join(output_dir, "metrics.csv")
        self.tb_dir = os.path.join(output_dir, "tensorboard")
        self._jsonl = None
        self._csv = None
        self._csv_writer = None
        self._tb = None

    def start(self, previous: Iterable[dict] = (), resume_step: int | None = None) -> None:
        """Rewrite the files to hold exactly `previous`, the checkpoint's records, then append.

        TensorBoard events cannot be rewritten: the writer purges those from `resume_step` on.
        """
        self.records = [dict(r) for r in previous]
        if not self.enabled:
            return
        os.makedirs(self.output_dir, exist_ok=True)
        self._jsonl = open(self.jsonl_path, "w")  # noqa: SIM115 - held open for the run, closed in close()
        for record in self.records:
            self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        self._csv = open(self.csv_path, "w", newline="")  # noqa: SIM115 - as above
        self._csv_writer = csv.DictWriter(self._csv, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        self._csv_writer.writeheader()
        self._csv_writer.writerows(self.records)
        self._csv.flush()
        if self.use_tensorboard:
            self._start_tensorboard(resume_step)

    def _start_tensorboard(self, resume_step: int | None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            log.warning("tensorboard is not installed: no TensorBoard events (pip install tensorboard)")
            return
        had_events = os.path.isdir(self.tb_dir) and any("tfevents" in n for n in os.listdir(self.tb_dir))
        self._tb = SummaryWriter(self.tb_dir, purge_step=resume_step if had_events else None)
        replay = [r for r in self.records if not had_events or resume_step is None or r["step"] >= resume_step]
        for record in replay:
            self._add_scalars(record)
        self._tb.flush()

    def _add_scalars(self, record: dict) -> None:
        split = record.get("split", "train")
        for name in _SCALARS:
            value = record.get(name)
            if isinstance(value, (int, float)):
                self._tb.add_scalar(f"{split}/{name}", value, record["step"])

    def write(self, record: dict) -> None:
        self.records.append(record)
        if not self.enabled or self._jsonl is None:
            return
        # Flushed per record: a killed process leaves every line it logged.
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        self._csv_writer.writerow(record)
        self._csv.flush()
        if self._tb is not None:
            self._add_scalars(record)

    def jsonl_text(self) -> str:
        return "".join(json.dumps(r) + "\n" for r in self.records)

    def close(self) -> None:
        for handle in (self._jsonl, self._csv):
            if handle is not None:
                handle.close()
        if self._tb is not None:
            self._tb.close()
        self._jsonl = self._csv = self._tb = None
