"""One rank of the scaling run: `python -m dlstore.bench --scaling-rank N < pickled spec`,
started by `dlstore bench --procs` (see `dlstore.bench.scaling`), not by hand."""

from __future__ import annotations

import pickle
import sys

from dlstore.bench.scaling import scaling_rank

if len(sys.argv) != 3 or sys.argv[1] != "--scaling-rank":
    sys.exit("usage: python -m dlstore.bench --scaling-rank RANK < pickled spec (run by `dlstore bench --procs`)")
scaling_rank(int(sys.argv[2]), pickle.load(sys.stdin.buffer))
