"""One rank of the scaling run: `python -m dlstore.bench --scaling-rank N < pickled spec`.
`dlstore bench --procs` starts it, not a person."""

from __future__ import annotations

import pickle
import sys

from dlstore.bench.scaling import scaling_rank

if len(sys.argv) != 3 or sys.argv[1] != "--scaling-rank":
    sys.exit("usage: python -m dlstore.bench --scaling-rank RANK < pickled spec (run by `dlstore bench --procs`)")
scaling_rank(int(sys.argv[2]), pickle.load(sys.stdin.buffer))
