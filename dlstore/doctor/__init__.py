"""`dlstore doctor`: check a node's set-up for a training run, and say how to fix what is wrong.

Runs fail on set-up more often than on code: credentials, a full disk, a small `/dev/shm`, a
torch wheel for another CUDA, launcher variables that disagree. Each check prints one line:
`ok`, `warn` or `FAIL`, with the fix below a warn or FAIL. Any FAIL makes the exit code 1.

    $ dlstore doctor swift://imagenet/train --batch-size 256 --workers 8

Checks, in order: `credentials`, `endpoint`, `auth`, `listing`, `manifest`, `read`, `cache`,
`shm`, `torch`, `cuda`, `nccl`, `distributed`. Secrets show as `***`. A check that depends on
one that failed does not run. Each check is a function of explicit inputs: an environment
mapping, paths, facts gathered once. So tests can call it with any situation.

>>> from dlstore.doctor import DoctorOptions, run_doctor, exit_code
>>> checks = run_doctor(DoctorOptions(DataConfig("swift://imagenet/train")), dict(os.environ))   # doctest: +SKIP
"""

from __future__ import annotations

from dlstore.doctor.check import FAIL, OK, WARN, Check, exit_code, format_check
from dlstore.doctor.run import DoctorOptions, add_doctor_arguments, options_from_args, run_doctor

__all__ = [
    "FAIL",
    "OK",
    "WARN",
    "Check",
    "DoctorOptions",
    "add_doctor_arguments",
    "exit_code",
    "format_check",
    "options_from_args",
    "run_doctor",
]
